"""The `"z3ext"` section of a DeepSpeed config, validated by z3ext itself.

DeepSpeed ignores unknown top-level keys, so without this a misspelt option would be dropped
silently. `true` is shorthand for `{"enabled": true}`.
"""
from typing import Any, Optional

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError

SECTION = "z3ext"


class Z3extConfigError(ValueError):
    """A `z3ext` config problem; the message names the key."""


class Z3extConfig(DeepSpeedConfigModel):
    enabled: bool = False
    """Let z3ext own ZeRO-3 parameter gather and release for this engine."""

    pool_budget_mb: int = Field(1024, ge=0)
    """Bytes (in MiB) of released gather buffers kept for reuse; 0 disables reuse."""

    hold_for_backward: bool = True
    """Parameters a module gathered in a grad-enabled forward stay claimed for its backward (no
    re-gather), while the numel so held stays within `stage3_max_live_parameters`."""

    plan_warning_steps: int = Field(0, ge=0)
    """Log a warning when a forward leaves the recorded module order, at most once per this many
    forwards; 0 (default) never warns (prefetch just degrades for that forward)."""

    leak_check: bool = False
    """At each optimizer step, raise naming every parameter whose released full tensor is still
    referenced outside z3ext (a leak into the next step), or that is gathered without a claim."""

    compile_fallback: bool = True
    """With DeepCompile: parameters read by frames Dynamo skipped are gathered with fallback claims
    (fallback.py). Off, such frames see partitioned parameters (and fail), as without any fallback."""


def parse_section(param_dict: dict) -> Optional[Z3extConfig]:
    """Returns the validated section, or None when the config has none (DeepSpeed unchanged)."""
    if SECTION not in param_dict:
        return None
    raw: Any = param_dict[SECTION]
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    if not isinstance(raw, dict):
        raise Z3extConfigError(f'"{SECTION}" must be true/false or an object, got {type(raw).__name__}: {raw!r}')
    try:
        return Z3extConfig(**raw)
    except ValidationError as e:
        problems = "; ".join(f'"{SECTION}.{".".join(str(p) for p in err["loc"])}": {err["msg"]}' for err in e.errors())
        raise Z3extConfigError(f"invalid z3ext config: {problems}") from None


# Options z3ext cannot honour yet: (where in the config, how to read it, why).
def unsupported_options(ds_config) -> list:
    """Names the enabled DeepSpeed options z3ext refuses, from a parsed `DeepSpeedConfig`."""
    zc = ds_config.zero_config
    found = []

    if getattr(zc, "zero_hpz_partition_size", 1) > 1:
        found.append("zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hpZ)")
    if getattr(zc, "zero_quantized_weights", False):
        found.append("zero_optimization.zero_quantized_weights (ZeRO++ qwZ)")
    if getattr(zc, "zero_quantized_nontrainable_weights", False):
        found.append("zero_optimization.zero_quantized_nontrainable_weights")
    if getattr(zc, "zenflow", None) is not None:
        found.append("zero_optimization.zenflow (ZenFlow)")
    if getattr(getattr(zc, "offload_optimizer", None), "super_offload", False):
        found.append("zero_optimization.offload_optimizer.super_offload (SuperOffload)")
    if getattr(zc, "use_all_reduce_for_fetch_params", False):
        found.append("zero_optimization.use_all_reduce_for_fetch_params")
    op = getattr(zc, "offload_param", None)
    if op is not None and str(getattr(op, "device", "none")).endswith("nvme"):
        # NVMe parameter offload goes through z3ext's I/O op (swap.py), which reads into CPU buffers.
        if (getattr(ds_config, "aio_config", None) or {}).get("use_gds", False):
            found.append('aio.use_gds with offload_param.device = "nvme" (GPUDirect Storage)')
    if getattr(ds_config, "torch_autocast_enabled", False):
        found.append("torch_autocast.enabled")
    compile_cfg = getattr(ds_config, "compile_config", None)
    if compile_cfg is not None and getattr(compile_cfg, "deepcompile", False):
        # DeepCompile's ZeRO-3 passes with its default schedule work (fallback.py); these move
        # partitions, optimizer state or activations in ways z3ext has not been exercised with.
        for key in ("offload_parameters", "offload_opt_states", "offload_activation", "symmetric_memory"):
            if getattr(compile_cfg, key, False):
                found.append(f"compile.{key} with compile.deepcompile")
        if getattr(compile_cfg, "passes", None):
            found.append("compile.passes with compile.deepcompile (only the default schedule)")
        offload_opt = getattr(zc, "offload_optimizer", None)
        if (op is not None and str(getattr(op, "device", "none")).endswith("cpu") and offload_opt is not None
                and str(getattr(offload_opt, "device", "none")).endswith("cpu")):
            found.append("compile.deepcompile with parameters and optimizer offloaded to CPU "
                         "(DeepCompile turns on its offload_parameters pass)")
    return found
