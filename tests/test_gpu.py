"""GPU variant of the equivalence test: 2 GPUs, NCCL, z3ext's CUDA stream/event path.
fp32 must be bitwise equal to stock ZeRO-3; bf16 equal within bf16 tolerance. Skipped on CPU."""
import pytest

from tests.harness import rank_device, run_on_ranks

pytestmark = pytest.mark.gpus(2)


def compare_on_gpu(dtype, persistence, steps=3, ga=2):
    import torch
    import torch.distributed as dist
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import deepspeed_z3ext
    from tests.models import batch, build_engine, ds_config, full_params
    from tests import training

    assert deepspeed_z3ext._ops().with_cuda, "the CPU flavour of the ops was loaded on a GPU machine"
    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    rank = dist.get_rank()

    def nothing_left_gathered(engine, step):
        gathered = [n for n in deepspeed_z3ext.stats(engine).gathered
                    if not dict(engine.module.named_parameters())[n].ds_persist] if hasattr(
                        engine.optimizer.parameter_offload, "z3ext") else []
        assert not gathered, f"left gathered after step {step}: {gathered}"

    def train(engine):
        return training.train(engine, steps, lambda i: batch(i, rank).cuda(), ga=ga, after_step=nothing_left_gathered)

    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward
        stock = build_engine(ds_config(persistence=persistence, ga=ga, extra=extra))
        stock_losses = train(stock)
        stock_params = full_params(stock)
        z3 = build_engine(ds_config(z3ext=True, persistence=persistence, ga=ga, extra=extra))
        z3_losses = train(z3)
        z3_params = full_params(z3)
    st = deepspeed_z3ext.stats(z3)
    torch.cuda.synchronize()
    if dtype == "fp32":
        diff = [n for n in stock_params if not torch.equal(stock_params[n], z3_params[n])]
    else:
        diff = [n for n in stock_params
                if not torch.allclose(stock_params[n].float(), z3_params[n].float(), rtol=2e-2, atol=2e-2)]
    return dict(stock_losses=stock_losses, z3_losses=z3_losses, diff=diff, collectives=st.collectives,
                device=str(next(z3.module.parameters()).device), peak=st.peak_live_bytes)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("persistence", [0, None], ids=["persist0", "persistdefault"])
def test_gpu_equivalence(dtype, persistence):
    results = run_on_ranks(compare_on_gpu, backend="nccl", dtype=dtype, persistence=persistence)
    for rank, r in enumerate(results):
        assert r["device"] == rank_device(rank)
        assert r["collectives"] > 0
        assert not r["diff"], f"rank {rank}: parameters differ: {r['diff']}"
        if dtype == "fp32":
            assert r["stock_losses"] == r["z3_losses"]
        else:
            assert r["stock_losses"] == pytest.approx(r["z3_losses"], rel=2e-2)


# Ownership cases (2)-(6) of test_ownership.py, on 2 GPUs with NCCL.
OWNERSHIP_CASES = ["gathered_around_forward", "gathered_nesting", "forward_failures"]


@pytest.mark.parametrize("case", OWNERSHIP_CASES)
def test_gpu_ownership(case):
    import tests.test_ownership as T
    checks = {
        "gathered_around_forward": lambda r: (r["extra_gathers_between"] == 0 and r["z3ext_inside_error"] is None
                                              and r["z3ext_status_after_backward"] == "NOT_AVAILABLE"
                                              and r["z3_gathered_after"] == [] and abs(r["z3ext_norm_between"] -
                                                                                      r["true_norm"]) < 1e-4),
        "gathered_nesting": lambda r: ("blocks.0.fc1.weight" in (r["overlap_error"] or "") and r["claims_after_overlap"]
                                       == {} and r["claims_after_body_error"] == {} and r["partition_after_modify"] ==
                                       [0.25] and r["full_after_modify"] == [0.25]),
        "forward_failures": lambda r: (r["z3ext_error"] is None and r["z3ext_gathered"] == [] and r["params_equal"]),
    }
    for rank, r in enumerate(run_on_ranks(getattr(T, case), backend="nccl")):
        assert checks[case](r), f"rank {rank}: {r}"


@pytest.mark.parametrize("case", ["hold-mel", "nohold-nomel", "partial-hold"])
def test_gpu_backward_integrity(case):
    """test_backward_integrity.py's cases (forwards between forward and backward, a module applied
    twice, nested outputs, non-reentrant checkpoint early stop) on 2 GPUs with NCCL, fp32."""
    from tests.test_backward_integrity import train_next_to_stock
    results = run_on_ranks(train_next_to_stock, backend="nccl", case=case, timeout=400)
    for rank, r in enumerate(results):
        assert r["stock_losses"] == r["z3_losses"], f"rank {rank}: losses differ"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
        assert not r["problems"], f"rank {rank}: " + "\n".join(r["problems"])
