"""A collective that one rank never issues ends in a named error on every rank before the process group's own
timeout fires ([Note: hang watchdog] in deepspeed_z3ext/watchdog.py, [Note: the deadline is the group's] in
deepspeed_z3ext/deadline.py), not in a hang nor in the backend's error.

On real gloo ranks, each run under a hard timeout, with a group timeout of 30 s (the deadline 25 s) and
`hang_timeout` 3 s (the warnings' interval):
- a rank stuck in user code (a Python loop) past the group's timeout while the others wait in the next forward's
  all-gather: with the pre-agreement on (the waiting is then in its exchange) and off (in the all-gather itself:
  NCCL's case, as far as gloo shows it), at 2 and 4 ranks;
- one rank runs an extra forward at the end while the others have stopped (pre-agreement off);
- one rank's gather runs out of memory, the rank catches it and retries (a certain divergence: raised at once,
  or by the step's check: the schedules realign a batch apart).
Every rank, the stuck one included, raises a z3ext error whose first line names the rank that has not arrived
and the collective the others wait in, after the deadline and before the group's timeout; the stuck rank is
named with where it is. The verdict itself (which rank, which collective, warning or error) is checked on
reports made by hand.
"""
import time

import pytest

from tests.harness import on_gpu, run_on_ranks

HANG = 3.0
PG_TIMEOUT = 30
DEADLINE = PG_TIMEOUT - 5  # [Note: the deadline is the group's]


def _engine(agree=True, **z3ext):
    from tests.models import build_engine, ds_config
    return build_engine(ds_config(z3ext={"enabled": True, "agree_before_collectives": agree, "hang_timeout": HANG,
                                         **z3ext}, persistence=0, ga=2))


def _user_code(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # stuck in user code: a Python loop the watchdog can interrupt
        time.sleep(0.05)


def stuck(agree, hpz=False):
    """The last rank stays in user code at step 3 for twice the group's timeout; returns (error name, message,
    seconds from step 3's start to the error, warnings logged before it). `hpz`: ZeRO++ hpZ over nodes of 2."""
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch
    rank, world = dist.get_rank(), dist.get_world_size()
    if hpz:
        from tests.test_hpz import _build, _config
        engine = _build(_config({"enabled": True, "agree_before_collectives": agree, "hang_timeout": HANG}))
    else:
        engine = _engine(agree)
    t0 = None
    try:
        for i in range(6):
            if i == 3:
                t0 = time.monotonic()
                if rank == world - 1:
                    _user_code(2 * PG_TIMEOUT)
            x = batch(i, rank)
            engine.backward(engine(x.cuda() if on_gpu() else x))
            engine.step()
        return ("finished", "", 0.0, _warned(engine), _groups(engine))
    except BaseException as e:  # a z3ext error, or the backend's (which the test names)
        return (type(e).__name__, str(e), time.monotonic() - t0, _warned(engine), _groups(engine))


def _warned(engine):
    from deepspeed_z3ext import state
    return state.of_engine(engine).watchdog.warnings


def _groups(engine):
    """The NCCL groups the engine issues on (how many, their sizes) and how many the watchdog aborted."""
    import torch.distributed as dist
    from deepspeed_z3ext import state
    st = state.of_engine(engine)
    nccl = [dist.get_world_size(g) for g in st.issued_groups() if dist.get_backend(g) == "nccl"]
    return dict(nccl=len(nccl), sizes=sorted(nccl), aborted=st.watchdog.aborted_groups)


def _check_stuck(out, world):
    late = world - 1
    print("seconds to the error by rank:", [round(o[2], 1) for o in out], "warnings:", [o[3] for o in out])
    for rank, (name, msg, seconds, warned, _) in enumerate(out):
        assert name == "RankTimeoutError", (rank, name, msg)
        first = msg.splitlines()[0]
        assert first.startswith(f"z3ext: rank {late} kept collective #") and "waiting" in first, (rank, first)
        assert "an all-gather" in first or "exchange" in first or "reduce-scatter" in first, first
        assert f"rank {late}: has not arrived at collective #" in msg, (rank, msg)
        assert "test_watchdog.py" in msg and "_user_code" in msg, (rank, msg)  # where the stuck rank is
        assert all(f"rank {r}: waiting in collective #" in msg for r in range(late)), (rank, msg)
        # after the deadline (less a poll), before the group's timeout: the backend's error never came
        assert DEADLINE - 1 < seconds < PG_TIMEOUT, f"rank {rank} raised {seconds:.1f}s after the stall began: {msg}"
        assert warned >= 2, (rank, warned)  # warned every hang_timeout until the deadline
    assert len({o[1] for o in out}) == 1, [o[1] for o in out]  # every rank names the same thing


@pytest.mark.parametrize("world,agree", [(2, True), (2, False), (4, True)],
                         ids=["2-agree", "2-no-agree", "4-agree"])
def test_a_rank_stuck_in_user_code_is_named_on_every_rank(world, agree):
    _check_stuck(run_on_ranks(stuck, world_size=world, timeout=90 * world // 2 + 30, pg_timeout=PG_TIMEOUT,
                              agree=agree), world)


@pytest.mark.gpus(2)
def test_a_rank_stuck_in_user_code_is_named_on_gpus():
    """On NCCL the waiting rank's host does not wait: the watchdog sees the gather's fence pending, names the rank
    and aborts every group z3ext issues on; as ranks on one GPU (gloo) the fences are real, the waits the
    host's."""
    out = run_on_ranks(stuck, backend="nccl", timeout=240, pg_timeout=PG_TIMEOUT, agree=False)
    _check_stuck(out, len(out))


@pytest.mark.gpus(2)
def test_a_rank_stuck_with_hpz_on_gpus_aborts_every_group_z3ext_issues_on():
    """On NCCL a host blocked behind any of z3ext's groups (the engine's, DeepSpeed's data-parallel clone, hpZ's)
    returns only when that group is aborted: every rank raises the named error before the group's timeout, and
    the watchdog aborted each NCCL group the engine issues on and the world's."""
    from tests.harness import skip_on_one_gpu
    skip_on_one_gpu("NCCL's abort is what is tested")
    out = run_on_ranks(stuck, backend="nccl", timeout=240, pg_timeout=PG_TIMEOUT, agree=False, hpz=True)
    _check_stuck(out, len(out))
    for rank, (*_, groups) in enumerate(out):
        assert 2 in groups["sizes"] and groups["nccl"] >= 2, (rank, groups)  # the engine's and hpZ's at least
        assert groups["aborted"] >= groups["nccl"], (rank, groups)


def extra_forward_at_the_end():
    """Rank 0 runs one more forward after the loop; the other ranks have stopped (user code until their watchdog
    raises). Pre-agreement off: rank 0 waits in the all-gather itself."""
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch
    rank = dist.get_rank()
    engine = _engine(agree=False)
    for i in range(2):
        engine.backward(engine(batch(i, rank)))
        engine.step()
    t0 = time.monotonic()
    try:
        if rank == 0:
            engine(batch(9, rank))
        else:
            _user_code(2 * PG_TIMEOUT)
        return ("finished", "", 0.0)
    except deepspeed_z3ext.Z3extError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def test_an_extra_forward_on_one_rank_names_the_module_it_waits_for():
    out = run_on_ranks(extra_forward_at_the_end, world_size=2, timeout=120, pg_timeout=PG_TIMEOUT)
    for rank, (name, msg, seconds) in enumerate(out):
        assert name == "RankTimeoutError", (rank, name, msg)
        assert msg.startswith("z3ext: rank 1 kept collective #"), msg
        assert "rank 0: waiting in collective #" in msg and "an all-gather" in msg and "from module '" in msg, msg
        assert "rank 1: has not arrived at collective #" in msg, msg
        assert DEADLINE - 1 < seconds < PG_TIMEOUT, (rank, seconds, msg)


def oom_then_retry():
    """Rank 1's forward gather runs out of memory in step 1; it catches it and goes on (a retry loop)."""
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.faults import allocator
    from tests.models import build_engine, ds_config
    from tests.test_faults import B, _net
    fa = allocator()
    fa.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    eng = build_engine(ds_config(z3ext={"enabled": True, "hang_timeout": HANG}, persistence=0, mel=False, ga=1),
                       model_fn=_net())
    gathered = eng.module.odd.weight.ds_tensor.ds_numel * world * 4
    t0, ooms = time.monotonic(), []
    try:
        for i in range(6):
            x = torch.randn(B, 16, generator=torch.Generator().manual_seed(100 * i + rank))
            if i == 1 and rank == 1:
                fa.arm(gathered, 0)
                t0 = time.monotonic()
            try:
                eng.backward(eng(x))
                eng.step()
            except torch.OutOfMemoryError:
                ooms.append(i)
            finally:
                fa.disarm()
        return ("finished", "", 0.0, ooms)
    except deepspeed_z3ext.Z3extError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0, ooms)


@pytest.mark.parametrize("world", [2, 4])
def test_an_out_of_memory_on_one_rank_then_a_retry_ends_in_a_named_error(world):
    from tests.faults import allocator
    allocator()
    out = run_on_ranks(oom_then_retry, world_size=world, timeout=120 * world // 2, pg_timeout=PG_TIMEOUT)
    assert out[1][3] == [1] and all(o[3] == [] for r, o in enumerate(out) if r != 1), out
    for rank, (name, msg, seconds, _) in enumerate(out):
        assert name in ("ScheduleMismatchError", "RankTimeoutError"), (rank, name, msg)
        # the module where the ranks' collectives differ, or (schedules realigned a batch apart) the rank that raised
        first = msg.splitlines()[0]
        assert "module '" in first or ("an op raised on some ranks only" in first and "rank 1: 1" in first), (rank, msg)
        assert seconds < PG_TIMEOUT, (rank, seconds, msg)


def test_the_verdict_names_the_first_difference_the_late_rank_and_the_silent_one():
    from deepspeed_z3ext.deadline import Deadline
    from deepspeed_z3ext.schedule import ScheduleMismatchError
    from deepspeed_z3ext.watchdog import RankTimeoutError, verdict
    names = {3: "blocks.0.fc1.weight", 7: "blocks.1.fc1.weight", 9: "head.weight"}
    deadline = Deadline(timeout=30.0, deadline=25.0, interval=3.0)

    def rec(index, ds_id, state=0, kind=1, numel=64, age=1.0):
        return [index, kind, 0, ds_id, numel, 1, age, state]

    def rep(issued, records, stalled=4.0, since=-1, where=""):
        return dict(issued=issued, since=since, stalled=stalled, records=records, where=where)

    same = [rec(10, 3), rec(11, 7)]
    # rank 1 gathered another module at #12: a certain divergence, named by module on both ranks, at once
    reports = {0: rep(13, same + [rec(12, 9, 1)]), 1: rep(13, same + [rec(12, 3, 1)])}
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is ScheduleMismatchError and "#12" in msg and "'head'" in msg and "'blocks.0.fc1'" in msg, msg
    # the same module, other sizes: at once too
    reports = {0: rep(13, same + [rec(12, 9, 1)]), 1: rep(13, same + [rec(12, 9, 1, numel=32)])}
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is ScheduleMismatchError and "#12" in msg, msg
    # every rank waiting, in different collectives (their records agree where both have one), for longer than an
    # interval: at once
    reports = {0: rep(13, same + [rec(12, 9, 1, age=4.0)]), 1: rep(12, [rec(10, 3), rec(11, 7, 1, age=4.0)])}
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is ScheduleMismatchError and msg.startswith("z3ext: the ranks wait in different collectives"), msg
    assert "rank 0: #12" in msg and "rank 1: #11" in msg, msg
    # ... but one wait is younger: the late rank may have just arrived, left #11 and waits in #12: a warning
    reports[0]["records"][-1][6] = 0.2
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is None and "late" in msg, msg
    # rank 1 stopped after #11, rank 2 did not answer: before the deadline a warning naming them ...
    reports = {0: rep(13, same + [rec(12, 9, 1)]), 1: rep(12, same, stalled=0.0, since=5.0, where="train.py:7 in loop")}
    cls, msg = verdict(reports, 3, deadline, names)
    assert cls is None and msg.startswith("z3ext: ranks 1, 2 late: collective #12"), msg
    assert "train.py:7 in loop" in msg and "Training goes on" in msg and "at 25s" in msg, msg
    # ... past it, the error: its first line names the late ranks and the collective
    reports[0]["stalled"] = 25.5
    cls, msg = verdict(reports, 3, deadline, names)
    assert cls is RankTimeoutError, msg
    first = msg.splitlines()[0]
    assert first.startswith("z3ext: ranks 1, 2 kept collective #12") and "'head'" in first, first
    assert "the process group's timeout of 30s" in first, first
    assert "rank 0: waiting in collective #12" in msg and "'head'" in msg, msg
    assert "rank 1: has not arrived at collective #12" in msg and "train.py:7 in loop" in msg, msg
    assert "rank 2: did not answer" in msg, msg
    # every rank in the same collective: slow, not diverged (a warning); past the deadline, the error
    reports = {r: rep(13, same + [rec(12, 9, 1)]) for r in range(2)}
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is None and "slow, not diverged" in msg, msg
    # ... but rank 0 arrived in it just now, after rank 1 waited 6 s for it: the late rank has arrived, nothing
    # to say (not "slow": the collective has run for no time yet)
    reports = {0: rep(13, same + [rec(12, 9, 1, age=0.0)], stalled=0.0),
               1: rep(13, same + [rec(12, 9, 1, age=6.0)], stalled=6.0)}
    assert verdict(reports, 2, deadline, names) == (None, None)
    reports[0]["records"][-1][6] = reports[0]["stalled"] = 3.5  # both an interval in: slow
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is None and "slow, not diverged" in msg, msg
    reports[0]["records"][-1][6] = reports[0]["stalled"] = 0.0
    reports[1]["stalled"] = 26.0
    cls, msg = verdict(reports, 2, deadline, names)
    assert cls is RankTimeoutError and "did not complete on any rank" in msg.splitlines()[0], msg


def exit_teardown():
    """What the interpreter's exit runs (the engines' teardown, `state._teardown_at_exit`): afterwards no
    watchdog thread is alive and no engine is polled."""
    import threading
    from deepspeed_z3ext import state, watchdog
    engine = _engine()  # noqa: F841 (kept alive until the teardown)
    alive_before = [t.name for t in threading.enumerate() if t.name == "z3ext-watchdog"]
    state._teardown_at_exit()
    alive_after = [t.name for t in threading.enumerate() if t.name == "z3ext-watchdog"]
    return alive_before, alive_after, len(watchdog._RUNNER._dogs)


def test_the_watchdog_thread_ends_at_exit():
    """A daemon thread still in a store call while Python finalizes is unwound through C++ frames, which
    aborts the process (a finished `accelerate launch` run ended in SIGABRT once): the exit's teardown stops
    and joins it after the engines' teardown."""
    for rank, (before, after, dogs) in enumerate(run_on_ranks(exit_teardown, world_size=2, timeout=120)):
        assert before == ["z3ext-watchdog"] and after == [] and dogs == 0, (rank, before, after, dogs)
