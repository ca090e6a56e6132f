"""Runs a function on N real ranks (processes of their own, gloo on CPU or NCCL on GPUs).

[Note: ranks on one GPU] NCCL refuses two ranks on one GPU, but gloo moves CUDA tensors between processes on
it. With `Z3EXT_RANKS_ON_ONE_GPU=N` (bench/device_run.sh ranks-on-one-gpu), a test that asks for NCCL ranks
runs them (two become N; another count stays) every one on cuda:0, through gloo (`GLOO_SOCKET_IFNAME=lo`:
without it the processes crashed there): values, streams and kernels are real; NCCL's own reductions and
streams are not. `on_gpu()` tells a rank function where its tensors go, `rank_device(rank)` which device a
rank computes on.

A rank that raises fails the test with its traceback; a rank that hangs is killed at the timeout,
so a collective mismatch shows up as a named failure, never as a hung CI job.

[Note: rank processes] CPU ranks (gloo, with `DS_ACCELERATOR=cpu` in the test process) are forks of a fork
server that imported torch, DeepSpeed and transformers once per test session, not new interpreters that import
them again: 1.7-2.7 s of CPU per rank, most of what a short test costs on 2 cores. The server holds those imports
and nothing else (no process group, engine, seam or ops), so each run starts as clean as a spawned one; a rank
takes the test process's environment as it is at the call (the imported modules read theirs when the session's
first run started the server). GPU ranks are spawned (nothing that touched CUDA is forked), and so is every rank
with `Z3EXT_TEST_SPAWN=1`.

The ranks meet through a file store in a fresh temporary folder (`init_method="file://..."`), not a
TCP port: picking a free port and binding it later in the ranks raced with other processes
(EADDRINUSE), while a new file is unique to this run, so parallel and repeated runs cannot collide.
"""
import os
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp


def ranks_on_one_gpu() -> int:
    """N of `Z3EXT_RANKS_ON_ONE_GPU` ([Note: ranks on one GPU]), 0 when unset."""
    return int(os.environ.get("Z3EXT_RANKS_ON_ONE_GPU", "0") or 0)


def on_gpu() -> bool:
    """Inside a rank: whether this run's tensors live on a GPU (NCCL, or gloo ranks sharing one GPU)."""
    return os.environ.get("Z3EXT_TEST_ON_GPU") == "1"


def skip_on_one_gpu(reason):
    """Skips a test that cannot run as ranks on one GPU ([Note: ranks on one GPU]), naming why."""
    import pytest
    if ranks_on_one_gpu():
        pytest.skip(f"not as ranks on one GPU: {reason}")


def rank_device(rank) -> str:
    return "cuda:0" if ranks_on_one_gpu() else f"cuda:{rank}"


_PRELOAD = ["torch", "deepspeed", "transformers"]  # [Note: rank processes]


def _context(backend):
    if backend == "gloo" and os.environ.get("DS_ACCELERATOR") == "cpu" and os.environ.get("Z3EXT_TEST_SPAWN") != "1":
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the first run starts the server
        return ctx
    return mp.get_context("spawn")


def _worker(rank, world_size, store_file, backend, fn, kwargs, queue, timeout, pg_timeout=None, env=None):
    if env is not None:  # the test process's environment now ([Note: rank processes])
        os.environ.clear()
        os.environ.update(env)
    import faulthandler
    faulthandler.enable()  # a crash prints its Python stack
    faulthandler.dump_traceback_later(max(timeout - 15, 5), exit=False)  # a hang prints its stacks
    # MASTER_ADDR/PORT stay unset: nothing may rendezvous over TCP behind the file store's back.
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    shared = backend == "nccl" and ranks_on_one_gpu() > 0
    if shared:  # [Note: ranks on one GPU]: DeepSpeed picks the device (and torch the group's) from LOCAL_RANK
        backend = "gloo"
        os.environ.update(GLOO_SOCKET_IFNAME="lo", LOCAL_RANK="0")
    elif backend == "gloo":
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["Z3EXT_TEST_ON_GPU"] = "1" if backend == "nccl" or shared else "0"
    try:
        import torch
        if shared:
            torch.cuda.set_device(0)
        elif backend == "nccl":
            torch.cuda.set_device(rank)
        import deepspeed
        import datetime
        extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        if shared:
            # Not bound to a device (DeepSpeed binds one on CUDA): a bound group makes every new_group a split,
            # which torch 2.11's gloo lacks. deepspeed.init_distributed reuses this group.
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                                    **extra)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, init_method=f"file://{store_file}",
                                   rank=rank, world_size=world_size, **extra)
        result = fn(**kwargs)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # the result is out before any teardown
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(fn, world_size=2, backend="gloo", timeout=300, pg_timeout=None, **kwargs):
    """`fn(**kwargs)` on every rank; its results in rank order. `pg_timeout`: the process group's collective
    timeout in seconds (default: torch's)."""
    if backend == "nccl" and world_size == 2 and ranks_on_one_gpu():
        world_size = ranks_on_one_gpu()  # [Note: ranks on one GPU]: "two GPUs" means N ranks there
    ctx = _context(backend)
    queue = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="z3ext-rdzv-")
    store_file = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store_file, backend, fn, kwargs, queue, timeout, pg_timeout,
                                          dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    import queue as q
    try:
        import time
        deadline = time.monotonic() + timeout
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, payload = queue.get(timeout=1)
                    break
                except q.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:  # a crash (e.g. a signal in C++) reports nothing through the queue
                        raise AssertionError(f"{fn.__name__}: rank(s) died: {dead} (negative = signal)")
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(results))} "
                                             f"did not finish within {timeout}s (hang?)")
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
