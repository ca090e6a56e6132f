"""The test harness's rendezvous: ranks meet through a file store unique to each run, so several runs at
once (and repeated runs) cannot collide on a port."""
import threading

from tests.harness import run_on_ranks


def rendezvous_facts():
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store
    store = _get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore wraps the real one
        store = store.underlying_store
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"store": type(store).__name__, "sum": float(t), "tcp_env": "MASTER_PORT" in os.environ}


def test_concurrent_runs_rendezvous_through_their_own_file_store():
    results, errors = [], []

    def one():
        try:
            results.append(run_on_ranks(rendezvous_facts, timeout=240))
        except BaseException as e:  # noqa: B902 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(results) == 3
    for run in results:
        assert run == [{"store": "FileStore", "sum": 3.0, "tcp_env": False}] * 2, run
