"""Out of memory for real on one CUDA GPU (tests/test_faults.py::test_out_of_memory_on_cuda): rank 0 of a
simulated world of 8 (bench/simworld: gathers allocate full storages, collectives do nothing, values
wrong), the caching allocator capped with `set_per_process_memory_fraction` just above what is in use,
so that the next 64 MiB allocation fails: a forward gather, a backward re-fill (hold off), autograd's
gradient (hold on). After each: torch.OutOfMemoryError from the expected phase, the cap lifted, and the
next step with a smaller batch trains; nothing stays gathered or claimed, the failed pass's gradients
are gone, and the memory in use after that step is what it was after the step before the fault."""
import os
import sys
from pathlib import Path

# The cap below is set just above what the allocator reserves, after empty_cache. A segment holding one live
# block cannot be returned, and its free part would serve the gather under the cap (z3ext frees DeepSpeed's
# 1.9 GB reduce bucket (its ipg buffer) at initialize, and Adam's states then land in that segment): expandable segments
# return the free pages of a segment too, so what is reserved is what is in use.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import simworld  # noqa: E402

simworld.init(8)
import deepspeed  # noqa: E402
import deepspeed_z3ext  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
WIDTH, MIB = 4096, 2**20  # a 4096 x 4096 fp32 weight gathers 64 MiB


def build(options):
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "z3ext": {"enabled": True, **options}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def step(engine, bsz, cap=None, headroom=0):
    """One step; `cap` ("forward"/"backward"): the allocator capped `headroom` MiB above what it holds
    just before that phase. Returns the phase that raised torch.OutOfMemoryError, or None."""
    x = torch.randn(bsz, WIDTH, device="cuda")
    phase = "forward"
    try:
        if cap == "forward":
            limit(headroom)
        loss = engine(x).square().mean()
        phase = "backward"
        if cap == "backward":
            limit(headroom)
        engine.backward(loss)
    except torch.OutOfMemoryError as e:
        assert "out of memory" in str(e).lower(), e
        return phase
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    engine.step()
    return None


def limit(headroom):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + headroom * MIB) / total)


# name, z3ext options, phase capped (and raising), MiB above the allocator's reserve, passes abandoned
for name, options, cap, headroom, abandoned in [
        ("gather", {}, "forward", 32, 0),                               # the first gather
        ("refill", {"hold_for_backward": False}, "backward", 32, 0),    # the last layer's re-fill
        ("autograd", {"hold_max_numel": 10**9}, "backward", 100, 1)]:   # the second weight gradient
    engine = build(options)
    assert step(engine, 8) is None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    got = step(engine, 8, cap, headroom)
    expect = cap
    assert got == expect, (name, got, expect)
    assert step(engine, 4) is None and step(engine, 4) is None, name
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    state = engine.optimizer.parameter_offload.z3ext
    live, claimed = deepspeed_z3ext.stats(engine).live_bytes, [h.name for h in state.engine.handles if h.claims]
    g = deepspeed_z3ext.grad_stats(engine)
    assert live == 0 and not claimed, (name, live, claimed)
    assert g.abandoned_passes == abandoned and g.bucket_elements == 0, (name, g)
    assert after <= before, f"{name}: {after - before} bytes more in use than before the fault"
    print(f"{name}: torch.OutOfMemoryError in {got}, then trained; in use {before / MIB:.1f} -> {after / MIB:.1f} MiB")
    engine.destroy()
    del engine, state
print("cuda out-of-memory: ok")
