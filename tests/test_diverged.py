"""A diverged program ends in a named error on every rank ([Note: agree before the collective] in
csrc/agreement.h), not in gloo's abort in C++ ("Received data size doesn't match expected size") or a hang.

On real gloo ranks, under a hard timeout, one rank does what the others do not:
- an extra `no_grad` forward of one block, or of the whole model, on rank 0;
- rank 1 skips the forward and backward of one micro-step (and still calls `engine.step()`);
- each rank opens `GatheredParameters` on another parameter of the same size (gloo would pair them silently).
Every rank raises `ScheduleMismatchError` before the mismatched collective, naming what each rank was about
to do (a module's all-gather, a reduce-scatter, the step's collectives). With `agree_before_collectives`
off the same programs end in gloo's own errors (a dead rank, a reset connection): what this replaces.
"""
import pytest

from tests.harness import run_on_ranks

TIMEOUT = 180


def diverge(how, agree=True):
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch, build_engine, ds_config
    rank = dist.get_rank()
    engine = build_engine(ds_config(z3ext={"enabled": True, "agree_before_collectives": agree}, persistence=0, ga=2))
    try:
        for i in range(6):
            if i == 3 and rank == 0 and how in ("block", "model"):
                with torch.no_grad():
                    if how == "block":
                        engine.module.blocks[1](torch.randn(2, 16, 32))
                    else:
                        engine(batch(100, rank))
            if i == 3 and how == "gathered":  # the same size, another parameter on each rank
                import deepspeed
                with deepspeed.zero.GatheredParameters([engine.module.blocks[rank % 2].fc1.weight]):
                    pass
            if not (i == 3 and rank == 1 and how == "skip"):
                engine.backward(engine(batch(i, rank)))
            engine.step()
        return None
    except deepspeed_z3ext.ScheduleMismatchError as e:
        return str(e)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("how", ["block", "model", "skip", "gathered"])
def test_a_diverged_rank_raises_a_named_error_on_every_rank(how, world):
    messages = run_on_ranks(diverge, world_size=world, timeout=TIMEOUT * world // 2, pg_timeout=60, how=how)
    for rank, msg in enumerate(messages):
        assert msg is not None and "next collectives differ" in msg, (rank, msg)
        assert all(f"rank {r}:" in msg for r in range(world)), (rank, msg)
    assert len(set(messages)) == 1, messages  # every rank names the same thing
    if how == "block":
        assert "module 'blocks.1" in messages[0], messages[0]
    if how == "gathered":  # where the step's schedule check (NCCL's) would name it a step later
        assert "module 'blocks.0.fc1'" in messages[0] and "module 'blocks.1.fc1'" in messages[0], messages[0]


def test_without_the_exchange_gloo_fails_without_naming_a_module():
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(diverge, world_size=2, timeout=TIMEOUT, pg_timeout=30, how="block", agree=False)
    assert "next collectives differ" not in str(failure.value)
