"""Simulated worlds: this process is rank 0 of a world of N on one device ([Note: simulated world],
noop_pg.cpp). Call `init(N)` before `deepspeed.init_distributed`, which then reuses the group.

    import simworld; simworld.init(8)            # collectives that do nothing (the reported numbers)
    simworld.init(8, backend="fake")             # torch's fake backend, which copies (comparison only)
"""
import os
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKEND = "simworld"


def label(world):
    """What every report of a simulated run says."""
    return f"simulated world {world}: no communication time, values wrong"


_ext = None


def load():
    """JIT-builds (first call per source and torch version, under TORCH_EXTENSIONS_DIR) and registers
    the backend; returns the extension module."""
    global _ext
    if _ext is None:
        import torch.distributed as dist
        from torch.utils.cpp_extension import load as jit_load
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # CPU-only code even on CUDA machines: the backend never launches anything on a device.
            _ext = jit_load(name="z3ext_simworld_pg", sources=[str(HERE / "noop_pg.cpp")], extra_cflags=["-O2"],
                            with_cuda=False, verbose=bool(os.environ.get("SIMWORLD_VERBOSE_BUILD")))
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _ext.create, devices=["cpu", "cuda"])
    return _ext


def steps_whatever_the_values():
    """DeepSpeed's stage-3 step skips the update when the gradient norm is not finite, which leftover
    bytes in the chunks no rank wrote make likely; a skipped update would time a step that never runs
    the optimizer. In a simulated world the update always runs, as it does with finite gradients
    (torch's optimizers, for FSDP2 and the unsharded model, never skip)."""
    try:
        import deepspeed.runtime.zero.stage3 as stage3
    except ImportError:
        return
    stage3.is_invalid_grad_norm = lambda norm: False


def init(world, backend=BACKEND, device=None):
    """Initialises the default process group as rank 0 of `world` ranks on this process's device.
    `backend`: "simworld" (collectives that do nothing) or "fake" (torch's, which copies data)."""
    import torch
    import torch.distributed as dist
    if world < 1:
        raise ValueError(f"a simulated world needs at least 1 rank, not {world}")
    if dist.is_initialized():
        raise RuntimeError("simworld.init: a process group is already initialised")
    # torchrun's environment for rank 0, as DeepSpeed and DeviceMesh read it.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == BACKEND:
        load()
    elif backend == "fake":
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    else:
        raise ValueError(f"unknown simulated-world backend {backend!r} (simworld or fake)")
    steps_whatever_the_values()
    if device.type == "cpu":
        # The chunks no rank wrote hold leftover bytes; denormals among them would slow CPU math.
        torch.set_flush_denormal(True)
    # A HashStore lives in this process: nothing ever waits on another rank's key (torch's store-based
    # barriers after group creation are off unless TORCH_DIST_INIT_BARRIER=1).
    dist.init_process_group(backend=backend, rank=0, world_size=world, store=dist.HashStore())
