"""The deadline is the process group's ([Note: the deadline is the group's] in deepspeed_z3ext/deadline.py):
`hang_timeout` is the interval of warnings while a rank is late, and training goes on.

On real gloo ranks (deepspeed.init_distributed with the user's `timeout=`), each under a hard timeout:
- rank 0 asleep for longer than `hang_timeout` but well within the group's timeout, once between steps and
  once inside a forward (a rank-0-only checkpoint write or evaluation): every rank trains to the same bits as
  without the delay, and every rank logs one warning per interval naming rank 0 and where it sleeps;
- group timeouts of 30 s and 120 s read from the engine's group, the deadline 5 s and 12 s before them;
- the watchdog's inquiry through a counting store (a real store, every operation counted) at worlds 2, 4, 8:
  a constant number of operations per rank and inquiry, one per idle poll ([Note: inquiry in O(world)] in
  deepspeed_z3ext/inquiry.py).
A rank stuck past the group's timeout is tests/test_watchdog.py's; a rank-0-only leak, tests/test_agreement.py's.
"""
import time

import pytest

from tests.harness import run_on_ranks

HANG = 2.0
PG_TIMEOUT = 30
SLEEP = 3 * HANG  # rank 0's delay: three warning intervals, far within the group's timeout


def _engine(**z3ext):
    from tests.models import build_engine, ds_config
    return build_engine(ds_config(z3ext={"enabled": True, "hang_timeout": HANG, **z3ext}, persistence=0, ga=1))


def _warnings():
    """The z3ext warnings this rank logs from now on (DeepSpeed's logger, which z3ext logs through)."""
    import logging
    from deepspeed.utils import logger

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            if record.getMessage().startswith("z3ext: "):
                self.messages.append((time.monotonic(), record.getMessage()))

    kept = Kept()
    logger.addHandler(kept)
    return kept


def _asleep(seconds):
    time.sleep(seconds)  # a rank-0-only task: a checkpoint write, an evaluation


def skew(steps=4):
    """Every rank trains `steps` steps twice from the same start: as is, then with rank 0 asleep for SLEEP
    seconds before step 1 and inside step 2's forward (after blocks.0's, the others waiting in a later gather).
    Returns the losses and parameters of both, and the warnings of the second."""
    import torch
    import torch.distributed as dist
    from deepspeed_z3ext import state
    from tests.models import batch, full_params
    rank = dist.get_rank()
    out = {}
    for delayed in (False, True):
        engine = _engine()
        kept = _warnings() if delayed else None
        hook = None
        if delayed and rank == 0:
            hook = engine.module.blocks[0].fc2.register_forward_hook(
                lambda *args: _asleep(SLEEP) if engine.global_steps == 2 else None)
        losses = []
        for i in range(steps):
            if delayed and rank == 0 and i == 1:
                _asleep(SLEEP)
            loss = engine(batch(i, rank))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out["delayed" if delayed else "plain"] = dict(losses=losses, params=full_params(engine))
        if delayed:  # compared here: tensors do not outlive the rank's process on their way back
            out["differ"] = [n for n, v in out["plain"].pop("params").items()
                             if not torch.equal(v, out["delayed"]["params"][n])]
            out["compared"] = len(out["delayed"].pop("params"))
        if delayed:
            out["warnings"] = kept.messages
            out["watchdog"] = dict(warnings=state.of_engine(engine).watchdog.warnings,
                                   deadline=tuple(state.of_engine(engine).watchdog.deadline))
            if hook is not None:
                hook.remove()
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_asleep_within_the_group_timeout_trains_to_the_same_bits_with_warnings(world):
    out = run_on_ranks(skew, world_size=world, timeout=150 * world // 2, pg_timeout=PG_TIMEOUT)
    for rank, r in enumerate(out):
        plain, delayed = r["plain"], r["delayed"]
        assert plain["losses"] == delayed["losses"], (rank, plain["losses"], delayed["losses"])
        assert r["compared"] > 0 and not r["differ"], (rank, r["differ"])
        assert r["watchdog"]["deadline"] == (PG_TIMEOUT, PG_TIMEOUT - 5, HANG), r["watchdog"]
        messages = [m for _, m in r["warnings"]]
        late = [m for m in messages if m.startswith("z3ext: rank 0 late: ")]
        assert late == messages, (rank, messages)  # every warning names rank 0, and only rank 0
        assert all("test_deadline.py" in m and "in _asleep" in m for m in late), (rank, late)
        assert all("Training goes on" in m for m in late), (rank, late)
        # one warning per interval: two delays of three intervals each, the first one interval in
        assert 2 * 2 <= len(late) <= 2 * (SLEEP / HANG + 1), (rank, len(late), messages)
        times = [t for t, _ in r["warnings"]]
        assert all(b - a > 0.8 * HANG for a, b in zip(times, times[1:])), (rank, times)  # not more often


def deadline_read():
    import torch.distributed as dist
    from deepspeed_z3ext import state
    from deepspeed_z3ext.deadline import group_timeout
    engine = _engine()
    dog = state.of_engine(engine).watchdog
    return dict(deadline=tuple(dog.deadline), world=group_timeout(dist.group.WORLD), answer=dog.answer,
                groups=len(state.of_engine(engine).issued_groups()))


@pytest.mark.parametrize("pg_timeout,deadline", [(30, 25), (120, 108)])
def test_the_deadline_is_the_group_timeout_less_a_margin(pg_timeout, deadline):
    for rank, r in enumerate(run_on_ranks(deadline_read, world_size=2, timeout=120, pg_timeout=pg_timeout)):
        assert r["world"] == pg_timeout, (rank, r)
        assert r["deadline"] == (pg_timeout, deadline, HANG), (rank, r)
        assert r["answer"] <= (pg_timeout - deadline) / 2, (rank, r)  # the reports come within the margin


def _counting_store(inner):
    """A Store that counts every operation made on it, in order, and passes it to the real `inner` store."""
    import torch.distributed as dist

    class Counting(dist.Store):
        def __init__(self):
            super().__init__()
            self.log = []

        def _op(self, name, key, call):
            self.log.append((name, key))
            return call()

        def set(self, key, value):
            return self._op("set", key, lambda: inner.set(key, value))

        def get(self, key):
            return self._op("get", key, lambda: inner.get(key))

        def add(self, key, value):
            return self._op("add", key, lambda: inner.add(key, value))

        def compare_set(self, key, expected, desired):
            return self._op("compare_set", key, lambda: inner.compare_set(key, expected, desired))

        def check(self, keys):
            return self._op("check", ",".join(keys), lambda: inner.check(keys))

        def wait(self, keys, timeout=None):
            return self._op("wait", ",".join(keys), lambda: inner.wait(keys) if timeout is None else
                            inner.wait(keys, timeout))

        def append(self, key, value):
            return self._op("append", key, lambda: inner.append(key, value))

        def delete_key(self, key):
            return self._op("delete_key", key, lambda: inner.delete_key(key))

        def num_keys(self):
            return self._op("num_keys", "", inner.num_keys)

    return Counting()


def count_store_operations(inquiries=2):
    """Every rank but 0 waits in a collective that rank 0 never issues (a real Progress record, no engine);
    rank 0 sleeps. Each rank's watchdog works through a counting store until `inquiries` inquiries closed (two
    warnings); returns its store operations and polls."""
    import torch.distributed as dist
    from deepspeed_z3ext import watchdog
    from deepspeed_z3ext._ops import ops
    rank = dist.get_rank()
    store = _counting_store(dist.distributed_c10d._get_default_store())
    progress = ops().Progress()
    dog = watchdog.Watchdog(progress, dist.group.WORLD, 1.0, dict, store=store)
    dist.barrier()
    if rank != 0:
        progress.begin([1, 0, -1, 64, 1])  # never ends: rank 0 is late
    end = time.monotonic() + 60
    while dog._inquiry < inquiries and time.monotonic() < end:
        _asleep(0.05)
    log, polls = list(store.log), dog.polls
    dog.close()
    dist.barrier()  # no rank leaves while another still reads an inquiry
    watchdog.stop_thread()
    return dict(log=log, polls=polls, inquiries=dog._inquiry, warnings=dog.warnings)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_an_inquiry_costs_each_rank_a_constant_number_of_store_operations(world):
    out = run_on_ranks(count_store_operations, world_size=world, timeout=60 + 15 * world)
    totals = []
    for rank, r in enumerate(out):
        assert r["inquiries"] >= 2 and r["warnings"] >= 2, (rank, r["inquiries"], r["warnings"])
        first = [(op, key) for op, key in r["log"] if "/inquiry/0/" in key + "/"]
        idle_checks = [(op, key) for op, key in first if op == "check"]
        inquiry = [(op, key) for op, key in first if op != "check"]
        # its report appended, counted in, waited for (or the count completed), every report read: 4; the
        # opener's compare_set: 5
        assert 4 <= len(inquiry) <= 5, (rank, inquiry)
        assert {op for op, _ in inquiry} <= {"compare_set", "append", "add", "set", "wait", "get"}, inquiry
        # a poll: one check, or an inquiry's operations (the one in flight at the count's end too)
        assert len(r["log"]) <= r["polls"] + 5 * (r["inquiries"] + 1), (rank, len(r["log"]), r["polls"])
        assert len(idle_checks) <= r["polls"], (rank, len(idle_checks), r["polls"])
        totals.append(len(inquiry))
    print(f"world {world}: store operations of inquiry 0 by rank {totals}, in all {sum(totals)}; "
          f"polls by rank {[r['polls'] for r in out]}, operations by rank {[len(r['log']) for r in out]}")
    assert sum(totals) <= 5 * world, totals  # the world's: O(world)


def hpz_groups():
    import torch.distributed as dist
    from deepspeed_z3ext import state
    from deepspeed_z3ext.deadline import group_timeout
    from tests.test_hpz import _build, _config
    engine = _build(_config({"enabled": True, "hang_timeout": HANG}))
    st = state.of_engine(engine)
    return dict(groups=sorted((dist.get_world_size(g), group_timeout(g)) for g in st.issued_groups()),
                deadline=tuple(st.watchdog.deadline))


def test_the_groups_of_an_hpz_engine_and_the_smallest_timeout():
    """With hpZ over nodes of 2 the engine issues on the world and on DeepSpeed's intra-node group, made by
    `new_group` with torch's default timeout (30 minutes): the deadline follows the smallest, the world's 30 s.
    (On NCCL these are the groups the watchdog aborts: tests/test_watchdog.py, gpus(2).)"""
    out = run_on_ranks(hpz_groups, world_size=4, timeout=180, pg_timeout=PG_TIMEOUT)
    print("(size, timeout) of the groups rank 0 issues on:", out[0]["groups"])
    for rank, r in enumerate(out):
        assert (4, PG_TIMEOUT) in r["groups"] and any(size == 2 for size, _ in r["groups"]), (rank, r)
        assert r["deadline"] == (PG_TIMEOUT, PG_TIMEOUT - 5, HANG), (rank, r)
