"""[Note: schedule check] (schedule.py) on 2 real gloo ranks: ranks that gather different parameters of the same
size (gloo pairs them up and nothing else notices) raise `ScheduleMismatchError` on every rank, naming the module
each rank gathered, at the check after the one that compared the span: the second optimizer step (the default),
or, checking at every outermost forward too ("forward"), the first step; "off" checks nothing. Ranks that make
the same calls pass every check."""
import pytest

from tests.harness import run_on_ranks


def _diverge(mode):
    import deepspeed
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch, build_engine, ds_config

    rank = dist.get_rank()
    # The check is what NCCL has; on gloo the exchange before each collective names the mismatch at once
    # (tests/test_diverged.py), so it is off here.
    z3 = {"enabled": True, "schedule_check": mode, "agree_before_collectives": False}
    engine = build_engine(ds_config(z3ext=z3, persistence=0, ga=1))
    checks = engine.optimizer.parameter_offload.z3ext.schedule_check
    engine.backward(engine(batch(0, rank)))
    engine.step()  # the same calls on both ranks: the check passes
    passed = checks.checks if checks is not None else 0
    # Two parameters of one shape: each rank gathers another one.
    block = engine.module.blocks[rank]
    with deepspeed.zero.GatheredParameters([block.fc1.weight]):
        pass
    error, where = None, None
    try:
        for i in range(1, 4):
            where = (i, "forward")
            loss = engine(batch(i, rank))
            where = (i, "backward")
            engine.backward(loss)
            where = (i, "step")
            engine.step()
        where = None
    except deepspeed_z3ext.ScheduleMismatchError as e:
        error = str(e)
    return dict(passed=passed, error=error, where=where)


@pytest.mark.parametrize("mode,where", [("step", [2, "step"]), ("forward", [1, "step"])])
def test_different_gathers_raise_on_every_rank(mode, where):
    results = run_on_ranks(_diverge, mode=mode, timeout=180)
    for rank, r in enumerate(results):
        assert r["passed"] >= 1, f"rank {rank}: the first step was not checked: {r}"
        assert list(r["where"] or []) == where and r["error"], f"rank {rank}: no mismatch raised at the {where}: {r}"
        assert "module 'blocks.0.fc1'" in r["error"] and "module 'blocks.1.fc1'" in r["error"], r["error"]
        assert "rank 0: module 'blocks.0.fc1'" in r["error"], r["error"]


def test_off_checks_nothing():
    for r in run_on_ranks(_diverge, mode="off", timeout=180):
        assert r["error"] is None and r["where"] is None and r["passed"] == 0, r


def _noted(bucket_numel):
    import torch.distributed as dist
    from deepspeed_z3ext.state import of_engine
    from tests.models import batch, build_engine, ds_config

    rank = dist.get_rank()
    z3 = {"enabled": True, "schedule_check": "step"}
    engine = build_engine(ds_config(z3ext=z3, persistence=0, ga=1, zero_extra={"reduce_bucket_size": bucket_numel}))
    state = of_engine(engine)
    out = []
    for i in range(2):
        loss = engine(batch(i, rank))
        before = state.engine.schedule()
        rs = state.grad_reducer._n_reduce_scatters if state.grad_reducer else 0
        engine.backward(loss)
        after = state.engine.schedule()
        out.append(dict(noted=after[0] - before[0], reduce_scatters=state.grad_reducer._n_reduce_scatters - rs,
                        moved=after[1] != before[1]))
        engine.step()
    return out


@pytest.mark.parametrize("bucket_numel", [500, 50_000_000])
def test_every_gradient_reduce_scatter_is_in_the_fingerprint(bucket_numel):
    """[Note: schedule fingerprint]: each reduce-scatter of a backward is noted (the backward gathers nothing: the
    units are held), so the step's check compares the gradient collectives too."""
    results = run_on_ranks(_noted, bucket_numel=bucket_numel, timeout=180)
    for rank, steps in enumerate(results):
        for r in steps:
            assert r["reduce_scatters"] >= 1 and r["noted"] == r["reduce_scatters"] and r["moved"], (rank, r)
    assert results[0] == results[1]
    if bucket_numel == 500:
        assert results[0][0]["reduce_scatters"] > 1, results[0]
