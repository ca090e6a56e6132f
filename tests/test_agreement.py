"""Arguments that shape the schedule agree across ranks ([Note: arguments that must agree] in schedule.py).

On 2 real gloo ranks (4 for `resident` and `leak_check`), each case passes a different value on each rank, as a program does that sizes a budget
from each GPU's free memory, or decides something on one rank:
- `deepspeed_z3ext.resident(engine, numel)` with another numel per rank: every rank keeps the smallest
  budget's units, issues the same collectives and decodes what stock decodes (before: rank 1 died with a
  closed connection on the next token's gathers);
- `full_weights(engine, bucket_bytes)` with another bucket size per rank: the same buckets everywhere; with
  other parameter names per rank: `ScheduleMismatchError` on every rank, naming each rank's values;
- `leak_check` where only rank 0 keeps a released tensor: every rank raises `LeakError` at the step, its first
  line naming rank 0 and the parameter.
Each under a hard timeout: a divergence would hang or abort instead.
"""
import pytest

from tests.harness import run_on_ranks

TIMEOUT = 180


def _engine(z3ext=True, options=None):
    from tests.models import build_engine, ds_config
    return build_engine(ds_config(z3ext={"enabled": True, **(options or {})} if z3ext else False, persistence=0,
                                  ga=1))


def resident_per_rank():
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch
    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        engine = _engine(name == "z3ext")
        engine.eval()
        numel = sum(p.ds_numel for p in engine.module.parameters())
        values = []
        with torch.no_grad():
            ctx = deepspeed_z3ext.resident(engine, numel // (1 + 2 * rank)) if name == "z3ext" else None
            if ctx is not None:
                ctx.__enter__()
            try:
                for step in range(4):
                    values.append(engine(batch(step, rank)).item())
                    if name == "z3ext" and step == 0:
                        coordinator = engine.optimizer.parameter_offload.param_coordinator
                        out["budget"] = coordinator.resident.budget
                        out["resident"] = coordinator.resident.numel
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        out[name] = values
        if name == "z3ext":
            out["collectives"] = deepspeed_z3ext.stats(engine).collectives
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_resident_numel_differing_by_rank_keeps_the_smallest_on_every_rank(world):
    results = run_on_ranks(resident_per_rank, world_size=world, timeout=TIMEOUT * world // 2, pg_timeout=60)
    assert len({r["budget"] for r in results}) == 1 and len({r["resident"] for r in results}) == 1, results
    assert len({r["collectives"] for r in results}) == 1, [r["collectives"] for r in results]
    for rank, r in enumerate(results):
        assert r["stock"] == r["z3ext"], f"rank {rank}: values differ from stock"


def weights_per_rank(names_differ):
    import torch.distributed as dist
    import deepspeed_z3ext
    rank = dist.get_rank()
    engine = _engine()
    names = [n for n, _ in engine.module.named_parameters()]
    try:
        chosen = names[:3] + ([names[3 + rank]] if names_differ else [])
        buckets = [[w.name for w in b] for b in deepspeed_z3ext.full_weights(engine, 2000 * (1 + 5 * rank), chosen)]
        return dict(buckets=buckets)
    except deepspeed_z3ext.ScheduleMismatchError as e:
        return dict(error=str(e))


def test_full_weights_bucket_bytes_differing_by_rank_give_the_same_buckets():
    results = run_on_ranks(weights_per_rank, timeout=TIMEOUT, pg_timeout=60, names_differ=False)
    assert results[0]["buckets"] == results[1]["buckets"] and len(results[0]["buckets"]) > 1, results


def test_full_weights_names_differing_by_rank_raise_on_every_rank():
    for r in run_on_ranks(weights_per_rank, timeout=TIMEOUT, pg_timeout=60, names_differ=True):
        assert "error" in r and "full_weights" in r["error"] and "rank 0:" in r["error"] and "rank 1:" in r["error"], r


def leak_on_rank0():
    import deepspeed
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch
    rank = dist.get_rank()
    engine = _engine(options={"leak_check": True})
    engine.backward(engine(batch(0, rank)))
    engine.step()
    w = engine.module.blocks[1].fc2.weight
    kept = None
    with deepspeed.zero.GatheredParameters([w]):
        if rank == 0:
            kept = w.detach()  # outlives the block on rank 0 only
    engine.backward(engine(batch(1, rank)))
    try:
        engine.step()
        return None
    except deepspeed_z3ext.Z3extError as e:
        return dict(name=type(e).__name__, runtime=isinstance(e, RuntimeError), message=str(e), kept=kept is not None)


@pytest.mark.parametrize("world", [2, 4])
def test_leak_check_on_one_rank_raises_on_every_rank(world):
    """Rank 0 alone keeps a released parameter: every rank raises `LeakError` (a RuntimeError, as before), its
    first line naming rank 0 and the parameter, on the ranks that did not leak too."""
    results = run_on_ranks(leak_on_rank0, world_size=world, timeout=TIMEOUT * world // 2, pg_timeout=60)
    for rank, r in enumerate(results):
        assert r is not None and r["name"] == "LeakError" and r["runtime"], (rank, r)
        first = r["message"].splitlines()[0]
        assert first == ("z3ext leak check (at the optimizer step): rank 0: 1 released but still referenced: "
                         "parameter 'blocks.1.fc2.weight'"), (rank, first)
        assert f"(rank {rank} here)" in r["message"], (rank, r["message"])
    assert results[0]["kept"] and not any(r["kept"] for r in results[1:]), results
