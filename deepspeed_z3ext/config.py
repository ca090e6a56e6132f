"""The `"z3ext"` section of a DeepSpeed config, validated by z3ext itself.

DeepSpeed ignores unknown top-level keys, so without this a misspelt option would be dropped
silently. `true` is shorthand for `{"enabled": true}`.

[Note: strict section] The section is a plain pydantic model with strict types and
`extra="forbid"`, not a `DeepSpeedConfigModel`: that base class drops every `"auto"` value before
validation (so `"enabled": "auto"` silently became the default, false), takes a `strict` key as its
own constructor argument (so `"strict": 1` vanished), and validates laxly (`"yes"` -> true,
`"64"` -> 64). Here each of those is an error naming the key. `"auto"` is refused by name: HF
Trainer fills `"auto"` only in DeepSpeed keys it knows, so nothing would ever decide a z3ext one.
"""
import os
from typing import Any, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from deepspeed_z3ext.errors import Z3extConfigError

SECTION = "z3ext"


class Z3extConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    enabled: StrictBool = False
    """Let z3ext own ZeRO-3 parameter gather and release for this engine."""

    pool_budget_mb: StrictInt = Field(1024, ge=0)
    """Accepted for existing configs; no effect: released gathered memory goes back to the allocator at
    once, no buffer pool ([Note: true release] in csrc/engine.h)."""

    hold_for_backward: StrictBool = True
    """Parameters a module gathered in a grad-enabled forward stay claimed for its backward (no
    re-gather), within `hold_max_numel` per forward and `stage3_max_live_parameters` live; the others
    are released and gathered again ahead of their backward ([Note: hold for backward])."""

    hold_max_numel: StrictInt = Field(50_000_000, ge=0)
    """Elements one forward's graph holds for its backward at most (DeepSpeed's default prefetch bucket:
    as much as backward prefetch gathers ahead). Larger trades memory for fewer re-gathers."""

    fetch_group_numel: Optional[StrictInt] = Field(None, ge=0)
    """Largest fetch group: the modules of one repeated block (a transformer layer) fetched as one unit
    in the forward ([Note: fetch groups] in groups.py). Default: stage3_max_live_parameters / 2; 0: one
    unit per module. Off as well with stage3_max_reuse_distance 0 and with NVMe parameter offload."""

    fetch_group_claim_numel: Optional[StrictInt] = Field(None, ge=0)
    """Largest fetch group gathered again for backward as one unit when it is not held; larger groups
    are gathered member by member ([Note: group claims] in groups.py). Default: twice
    stage3_prefetch_bucket_size; 0: always member by member."""

    resident_numel: Optional[StrictInt] = Field(None, ge=0)
    """Elements that generation steps (no_grad forwards given a KV cache, one per token; or any no_grad forward
    inside `deepspeed_z3ext.resident`) keep gathered for the next one, until another kind of forward, a
    backward, `train()`, the step or `deepspeed_z3ext.release_resident` ([Note: generation residency] in
    resident_set.py). Default: stage3_max_live_parameters less stage3_prefetch_bucket_size; where neither this
    nor the live budget is set, sized from memory at each generation round's start ([Note: resident budget]);
    0: off."""

    plan_warning_steps: StrictInt = Field(0, ge=0)
    """Log a warning when a forward leaves the recorded module order, at most once per this many
    forwards; 0 (default) never warns (prefetch just degrades for that forward)."""

    leak_check: StrictBool = False
    """At each optimizer step, raise naming every parameter whose released full tensor is still
    referenced outside z3ext (a leak into the next step), or that is gathered without a claim."""

    reduce_gradients: StrictBool = True
    """z3ext reduce-scatters gradients into the stage-3 optimizer's partitions, one collective per
    `reduce_bucket_size` elements, from the gradients autograd made (grads.py); false: DeepSpeed's
    bucket copies. Either way the partitions hold the same bits."""

    divide_after_reduce: StrictBool = True
    """At a power-of-two world (not in fp16) the flush divides this rank's reduced shard by the world, the
    bits of stock's pre-divide at 1/world of its pass ([Note: divide after the reduce] in csrc/reduce.h);
    false: stock's `div_` of the whole bucket before the collective everywhere."""

    exact_grad_norm: StrictBool = False
    """The step's gradient norm by stock's per-parameter loop; false (default): one multi-tensor norm
    per sub-group and one all-reduce, stock's bits on CPU, within rounding of them on CUDA ([Note:
    gradient norm] in norm.py)."""

    free_grad_partitions: StrictBool = True
    """A trainable parameter that gets no gradient in an accumulation window steps on a zero gradient, as
    in ZeRO stage 1/2, never on the partition an earlier window left (stock stage 3); on z3ext's gradient
    path the optimizer's gradient partitions (2 bytes per parameter per rank in bf16) are also freed from
    the end of each step to the window's first reduce-scatter, which re-allocates them zeroed ([Note:
    gradient partitions between steps] in grads.py). Stock's numbers whenever every trainable parameter
    gets a gradient in each window. false: stock's partitions, kept and reused."""

    partition_from_master: StrictBool = True
    """A bf16 or fp16 parameter's partition is its fp32 master: no low-precision copy is kept between gathers
    (2 bytes per parameter per rank less in bf16); a gather casts this rank's master slice ([Note: partition is
    the master] in master.py). Same values as stock's; a GatheredParameters write-back lands in the master.
    Not with optimizer or parameter offload. false: stock's low-precision partitions."""

    conditional_modules: List[StrictStr] = Field(default_factory=list)
    """Submodules that some ranks or steps skip (module names, or class names), each gathered with its parent and
    its gradients reduced at the end of every backward, zeros where it did not run ([Note: conditional modules]
    in conditional.py)."""

    conditional_blocks: StrictBool = True
    """A mixture-of-experts block with one module per expert (a list of experts beside a router) is one
    unit, gathered whole, so every rank gathers the same whatever its tokens' routing ([Note: conditional
    blocks] in conditional.py); false: per-module units (ranks whose routing differs then diverge)."""

    schedule_check: Literal["step", "forward", "off"] = "step"
    """Ranks compare a fingerprint of their all-gathers (one tiny all-gather) at every optimizer step
    ("step"), also at every outermost forward ("forward", for debugging), or never ("off"); a mismatch
    raises on every rank naming the first module where they differ ([Note: schedule check] in schedule.py)."""

    agree_before_collectives: StrictBool = True
    """On gloo (CPU, and ranks sharing a GPU), the ranks exchange a descriptor of each z3ext collective before
    issuing it, so that ranks about to issue different ones raise `ScheduleMismatchError` naming each rank's
    module instead of gloo aborting in C++ ([Note: agree before the collective] in csrc/agreement.h); one tiny
    all-gather per collective. No effect on NCCL."""

    agree_forwards: StrictBool = True
    """Several ranks record the first training forward's and the first no_grad forward's module order together
    (one tiny exchange per module fetch in that forward), and each later forward of that grad mode gathers the
    positions it skips as if it ran them, so that ranks running different modules (LayerDrop drawn per rank, a
    tower on some ranks' batches, a head per rank in evaluation) still issue the same collectives ([Note: forwards that differ by rank] in coordinator.py). Off: a rank-divergent forward
    raises `ScheduleMismatchError` naming each rank's module (gloo), or at the step's check (NCCL)."""

    hang_timeout: float = Field(60.0, ge=0)
    """Seconds a z3ext collective may stay incomplete before the ranks compare what they did: where they differ
    (another module, other sizes, different collectives waited in) every rank raises at once, naming each rank's
    module; where a rank is late (a rank-0-only checkpoint write, a rank stuck) every rank logs a warning naming
    it and where it is, once per this many seconds, and training goes on until the process group's own timeout
    less a margin, when every rank raises `RankTimeoutError` before the backend's error ([Note: hang watchdog] in
    watchdog.py, [Note: the deadline is the group's] in deadline.py); 0: no watchdog."""

    compile_fallback: StrictBool = True
    """With DeepCompile: parameters read by frames Dynamo skipped are gathered with fallback claims
    (fallback.py). Off, such frames see partitioned parameters (and fail), as without any fallback."""


def param_dict_of(ds_config) -> dict:
    """The raw config dict behind what DeepSpeed passes around: a DeepSpeedConfig, a dict or a path."""
    from deepspeed.runtime.config import DeepSpeedConfig
    if isinstance(ds_config, DeepSpeedConfig):
        return ds_config._param_dict
    if isinstance(ds_config, dict):
        return ds_config
    if isinstance(ds_config, (str, os.PathLike)) and os.path.exists(ds_config):
        import hjson
        with open(ds_config) as f:
            return hjson.load(f)
    return {}


def parse_section(param_dict: dict) -> Optional[Z3extConfig]:
    """Returns the validated section, or None when the config has none (DeepSpeed unchanged)."""
    if SECTION not in param_dict:
        return None
    raw: Any = param_dict[SECTION]
    if isinstance(raw, bool):
        raw = {"enabled": raw}
    if raw == "auto":
        raise Z3extConfigError(f'"{SECTION}": "auto" is not supported (HF Trainer fills "auto" only in DeepSpeed\'s '
                               'own keys, so nothing would decide it): write true or false')
    if not isinstance(raw, dict):
        raise Z3extConfigError(f'"{SECTION}" must be true/false or an object, got {type(raw).__name__}: {raw!r}')
    autos = [k for k, v in raw.items() if isinstance(v, str) and v == "auto"]
    if autos:
        raise Z3extConfigError("invalid z3ext config: " + "; ".join(
            f'"{SECTION}.{k}": "auto" is not supported (HF Trainer fills "auto" only in DeepSpeed\'s own keys, so '
            "nothing would decide it): write the value" for k in autos))
    try:
        return Z3extConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f'"{SECTION}.{".".join(str(p) for p in err["loc"])}": {err["msg"]} (got {err["input"]!r})'
                             + _did_you_mean(err) for err in e.errors())
        keys = _valid_keys(e.errors())
        if keys:
            problems += (" " if problems.endswith("?") else ". ") + keys
        raise Z3extConfigError(f"invalid z3ext config: {problems}") from None


# Words of an unknown key that ask for what DeepSpeed's own stage-3 keys set ([Note: stage-3 options]).
_DEEPSPEED_SIZES = ("prefetch", "bucket", "live", "persist", "reuse")


def _did_you_mean(err) -> str:
    """For an unknown key, the closest of the section's keys (`hold_max_numell` -> `hold_max_numel`) when one is
    close, the section's keys always, and where the key asks for a fetch size, the DeepSpeed keys that set it."""
    if err["type"] != "extra_forbidden" or len(err["loc"]) != 1:
        return ""
    import difflib
    key = str(err["loc"][0])
    close = difflib.get_close_matches(key, list(Z3extConfig.model_fields), n=1)
    said = f'; did you mean "{SECTION}.{close[0]}"?' if close else ""
    if any(word in key.lower() for word in _DEEPSPEED_SIZES):
        said += ("; DeepSpeed's own zero_optimization keys (stage3_prefetch_bucket_size, stage3_max_live_parameters, "
                 "stage3_param_persistence_threshold, reduce_bucket_size) set prefetch, live, persistence and bucket "
                 "sizes, and z3ext honours them")
    return said


def _valid_keys(errors) -> str:
    """After a message with an unknown key: the section's keys, once."""
    if not any(err["type"] == "extra_forbidden" for err in errors):
        return ""
    return f'The keys of "{SECTION}": {", ".join(sorted(Z3extConfig.model_fields))}'


# [Note: stage-3 options] DeepSpeed 0.19.8's stage-3 keys for parameter fetch and what z3ext does
# with each. Honoured: stage3_prefetch_bucket_size, stage3_max_live_parameters,
# stage3_param_persistence_threshold, stage3_model_persistence_threshold, leaf_module
# (z3_leaf_module). DeepSpeed's own code still runs them, so they work unchanged:
# stage3_gather_16bit_weights_on_model_save (GatheredParameters, gathered.py), offload_param,
# memory_efficient_linear, override_module_apply, pipeline_loading_checkpoint, the gradient hooks, the
# optimizer and checkpoints (overlap_comm, sub_group_size, round_robin_gradients, ...; overlap_comm's
# other use, gathering on a side stream, z3ext always does on CUDA). z3ext's gradient path (grads.py)
# honours reduce_bucket_size and communication_data_type; contiguous_gradients needs no buffer there;
# zero_quantized_gradients, reduce_scatter false and optimizer offload keep DeepSpeed's path. allgather_partitions/allgather_bucket_size,
# ignore_unused_parameters, use_multi_rank_bucket_allreduce are stage 1/2 keys. The keys below ask for a
# fetch behaviour z3ext does not have; they are accepted at DeepSpeed's default (which HF's
# standard ZeRO-3 config uses: stage3_max_reuse_distance 1e9, the others absent) and refused at any
# other value, so that no setting is silently ignored. stage3_max_reuse_distance is also accepted at
# 0 (release right after each module: z3ext then does not hold for backward, main's c73c887) and
# above the default (keep for reuse: what holding for backward does, within max_live_parameters);
# only a bound in between, which z3ext does not track, is refused.
_REFUSED_UNLESS_DEFAULT = (
    # (DeepSpeedZeroConfig field, config key, values accepted besides the default, what z3ext does instead)
    ("max_reuse_distance", "stage3_max_reuse_distance", lambda v, default: v == 0 or v >= default,
     "0 or at least the default: z3ext releases a module's parameters after its forward unless held for "
     "backward (z3ext.hold_for_backward, bounded by stage3_max_live_parameters), it tracks no reuse distance"),
    ("allgather_sequential", "stage3_allgather_sequential", None,
     "z3ext gathers a unit in one coalesced collective"),
    ("enable_sanity_checks", "enable_sanity_checks", None,
     "z3ext does not check GatheredParameters blocks for in-place edits without modifier_rank"),
    ("log_trace_cache_warnings", "log_trace_cache_warnings", None,
     "use z3ext.plan_warning_steps to log forwards that leave the recorded order"),
)


def _zero_default(field):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig.model_fields[field].default


# Options z3ext cannot honour yet: (where in the config, how to read it, why).
def unsupported_options(ds_config) -> list:
    """Names the enabled DeepSpeed options z3ext refuses, from a parsed `DeepSpeedConfig`."""
    zc = ds_config.zero_config
    found = []

    for field, key, also_accepted, instead in _REFUSED_UNLESS_DEFAULT:
        value, default = getattr(zc, field, None), _zero_default(field)
        if value is None or value == default or (also_accepted is not None and also_accepted(value, default)):
            continue
        found.append(f"zero_optimization.{key} = {value!r} (only DeepSpeed's default {default!r}: {instead})")

    if getattr(zc, "zero_quantized_weights", False):
        # Stock quantizes what one coalesced call gathers (a module's parameters and its prefetch), so
        # its numbers follow its prefetch batching, which z3ext's units do not reproduce (bench/NOTES.md v19).
        found.append("zero_optimization.zero_quantized_weights (ZeRO++ qwZ: stock quantizes what one of its coalesced "
                     "gathers holds, so its numbers follow stock's prefetch batching, which z3ext's units do not "
                     "reproduce; hpZ, zero_hpz_partition_size, is supported)")
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
        if getattr(zc, "zero_hpz_partition_size", 1) > 1:
            # Stock makes the secondary partition on the "nvme" device, which torch has not.
            found.append('zero_optimization.zero_hpz_partition_size > 1 with offload_param.device = "nvme" (ZeRO++ hpZ)')
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


def sanity_check(stock_check):
    """`DeepSpeedConfig._do_sanity_check` (seams.py): DeepSpeed's checks, then the `"z3ext"` section's,
    so a bad key, ZeRO stage != 3 or a refused option fails `deepspeed.initialize` by name."""

    def _do_sanity_check(self):
        stock_check(self)
        cfg = parse_section(self._param_dict)
        self.z3ext_config = cfg
        if cfg is None or not cfg.enabled:
            return
        if self.zero_optimization_stage != 3:
            raise Z3extConfigError(f'"{SECTION}" needs zero_optimization.stage 3, got stage '
                                   f"{self.zero_optimization_stage}")
        refused = unsupported_options(self)
        if refused:
            raise Z3extConfigError(f'"{SECTION}" does not support yet: ' + "; ".join(refused))

    return _do_sanity_check


def _stock_gradient_path(ds_config, cfg) -> Optional[str]:
    """The config keys that keep gradients on DeepSpeed's stage-3 path (grads.stock_path_reason decides
    at run time; these are the ones a config alone shows)."""
    zc = ds_config.zero_config
    offload = getattr(zc, "offload_optimizer", None)
    if not cfg.reduce_gradients:
        return f"{SECTION}.reduce_gradients = false"
    if offload is not None and not str(getattr(offload, "device", "none")).endswith("none"):
        return "zero_optimization.offload_optimizer"
    if getattr(zc, "zero_quantized_gradients", False):
        return "zero_optimization.zero_quantized_gradients"
    if not getattr(zc, "reduce_scatter", True):
        return "zero_optimization.reduce_scatter = false"
    return None
