"""[Note: divide after the reduce] (csrc/reduce.h) against stock's arithmetic on real gloo ranks: the flush's
reduce-scatter with the shard divided after the collective gives DeepSpeed's `reduce_scatter_coalesced`
(pre-divide, then sum) bit for bit at power-of-two worlds in fp32 and bf16, for gradients whose magnitudes span
1e-30..1e30; fp16 keeps stock's pre-divide. Below the smallest normal number the two forms may differ (stock's
pre-divide rounds a subnormal quotient): there the pre-divide is what z3ext runs when asked."""
import pytest

from tests.harness import run_on_ranks

SIZES = (1, 7, 64, 129, 1000, 4096)  # padded chunks, a multiple of every world, odd remainders


def _draw(dtype, n, seed, low, high):
    import torch
    g = torch.Generator().manual_seed(seed)
    exponent = torch.empty(n, dtype=torch.float64).uniform_(low, high, generator=g)
    sign = torch.randint(0, 2, (n, ), generator=g, dtype=torch.float64) * 2 - 1
    return (sign * 10.0**exponent * (1 + torch.rand(n, generator=g, dtype=torch.float64))).to(dtype)


def _compare(dtype_name, low, high, divide_after, draws=4):
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    from deepspeed_z3ext import comms
    from deepspeed_z3ext._ops import ops

    dtype = getattr(torch, dtype_name)
    rank, world = dist.get_rank(), dist.get_world_size()
    collective = comms.reduce_scatter_fn(None)
    differing = []
    for d in range(draws):
        for single in (False, True):  # a bucket of several gradients (laid out), one gradient (a direct slice)
            sizes = (world * 512, ) if single else SIZES
            grads = [_draw(dtype, n, 1000 * d + 10 * i + rank, low, high) for i, n in enumerate(sizes)]
            stock = reduce_scatter_coalesced([g.clone() for g in grads])
            dests = [torch.zeros(-(-g.numel() // world), dtype=dtype) for g in grads]
            ops().reduce_scatter_grads(collective, grads, dests, rank, world, dtype, 0.0, False, divide_after)
            for i, (s, z) in enumerate(zip(stock, dests)):
                if not torch.equal(s, z[:s.numel()]):
                    differing.append((d, single, i, int((s != z[:s.numel()]).sum())))
    return differing


# (dtype, exponent range, divide after the reduce): 1e-30..1e30 are normal numbers of fp32 and bf16 (and their
# sums) whichever form divides; fp16 1e-7..1e4 holds subnormal quotients and near-overflow sums, where only the
# pre-divide is stock's; fp32 around the smallest normal number (1.2e-38) shows the note's bound.
FORMS = {
    "fp32": ("float32", -30, 30, True),
    "bf16": ("bfloat16", -30, 30, True),
    "fp16-pre": ("float16", -7, 4, False),
    "subnormal-pre": ("float32", -39.5, -37, False),
    "subnormal-after": ("float32", -39.5, -37, True),
}


def _all_forms(names):
    return {name: _compare(*FORMS[name]) for name in names}


@pytest.mark.parametrize("world", [2, 4])
def test_divide_after_reduce_is_stocks_pre_divide(world):
    names = list(FORMS) if world == 2 else ["fp32", "bf16"]
    results = run_on_ranks(_all_forms, world_size=world, names=names, timeout=240)
    for rank, r in enumerate(results):
        for name in ("fp32", "bf16", "fp16-pre", "subnormal-pre"):
            assert r.get(name, []) == [], f"rank {rank}, {name}: (draw, single, gradient, elements) differ {r[name]}"
    if world == 2:
        # The bound, shown: below the smallest normal number dividing after gives other bits than stock's.
        assert any(r["subnormal-after"] for r in results), "dividing after matched stock for subnormal quotients"


def test_divide_after_reduce_only_where_exact():
    import torch
    from deepspeed_z3ext import comms
    assert comms.divides_after_reduce(2, torch.bfloat16) and comms.divides_after_reduce(8, torch.float32)
    assert not comms.divides_after_reduce(2, torch.float16)  # fp16: stock's pre-divide
    assert not comms.divides_after_reduce(3, torch.float32) and not comms.divides_after_reduce(1, torch.float32)
