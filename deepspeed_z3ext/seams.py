"""Every place z3ext changes DeepSpeed's code, in one table ([Note: seams]).

[Note: seams] z3ext plugs into DeepSpeed by replacing the attributes of DeepSpeed classes (and one
function stage 3 calls by its module-global name) listed in `_table`, at `import deepspeed_z3ext`
(`install`); `deepspeed_z3ext.uninstall()` puts DeepSpeed's own back. Every replacement falls through to
DeepSpeed's code for what is not z3ext's (a config without `"z3ext"`, a parameter of no z3ext engine, a
stock engine), so stock and z3ext engines can share a process. A replacement is built from the attribute
it replaces (`build(stock)`), so it reaches DeepSpeed's version without a module global and this table
is the only record of what was there.
The `__new__` seams dispatch at construction (DeepSpeed builds these objects in several places, and
its isinstance checks stay true); all go through `_dispatch_new`, which reads the argument it needs
by name from the stock constructor's signature, never by guessing its position.
Layering: behaviour modules (config, offload, gathered, external, fallback, swap) hold behaviour
only and never import this module; DeepSpeed internals they read (module globals, name-mangled
privates) are behind deepspeed_private.py. Not in the table: per-parameter entry points, replaced on
the parameters of each z3ext engine and given back at its destroy (entry.py), and the stage-3
module hooks, which Z3extZeRoOffload registers through DeepSpeed's own method (hooks.py).
"""
import inspect
from typing import Any, Callable, NamedTuple

from deepspeed_z3ext.errors import Z3extError


class Seam(NamedTuple):
    owner: Any                   # the DeepSpeed class (or module: a global its code calls) whose attribute is replaced
    attr: str
    build: Callable[[Any], Any]  # DeepSpeed's attribute -> its replacement
    why: str


_ABSENT = object()  # the class had no attribute of its own (e.g. __new__ inherited from object)


def plain_new(cls, *args, **kwargs):
    """What an inherited `object.__new__` seam is given back as. CPython cannot return a class to
    object's own construction slot once `__new__` was assigned (deleting it again leaves a slot that
    passes the constructor's arguments on to object.__new__, which refuses them), so uninstall sets
    this: object.__new__(cls), ignoring the arguments, exactly what the inherited slot did."""
    return object.__new__(cls)


def _dispatch_new(cls, arg: str, choose: Callable[[Any], Any]):
    """A `__new__` seam for `cls`: `choose(value of the constructor argument named arg)` returns the
    object to build instead (a z3ext subclass, or any object whose __init__ Python then skips), or
    None for DeepSpeed's own class. Subclasses of `cls` are never dispatched."""
    signature = inspect.signature(cls.__init__)
    if arg not in signature.parameters:
        raise Z3extError(f"z3ext: {cls.__qualname__}.__init__ has no argument {arg!r} in this DeepSpeed version "
                         f"(see deepspeed_private.TESTED_VERSIONS)")

    def build(stock_new):
        def __new__(klass, *args, **kwargs):
            if klass is cls:
                try:
                    value = signature.bind_partial(None, *args, **kwargs).arguments.get(arg)
                except TypeError:
                    value = None  # a bad call: DeepSpeed's own __init__ raises its own error
                obj = choose(value)
                if obj is not None:
                    return obj
            return object.__new__(klass)

        return __new__

    return build


def _table():
    from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload, ZeROOrderedDict
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    from deepspeed_z3ext import (config, epoch, external, fallback, gathered, generation, grad_hooks, grads, handover,
                                 linear, master, norm, offload, swap)
    return [
        Seam(DeepSpeedConfig, "_do_sanity_check", config.sanity_check,
             "validates the z3ext section at deepspeed.initialize, naming bad keys and refused options"),
        Seam(DeepSpeedZeRoOffload, "__new__", _dispatch_new(DeepSpeedZeRoOffload, "ds_config", offload.new_offload),
             "a Z3extZeRoOffload (z3ext's coordinator and hooks) when the config enables z3ext"),
        Seam(GatheredParameters, "__enter__", gathered.enter, "a Gathered claim on z3ext parameters"),
        Seam(GatheredParameters, "__exit__", gathered.exit, "write-back and the claim's drop"),
        Seam(ZeROOrderedDict, "__getitem__", external.getitem,
             "external parameters discovered inside z3ext module forwards, resident or not"),
        Seam(ZeROOrderedDict, "__setitem__", epoch.setitem,
             "a parameter set on a ZeRO module moves the tree epoch ([Note: tree epoch])"),
        Seam(ZeROOrderedDict, "__delitem__", epoch.delitem,
             "a parameter removed from a ZeRO module moves the tree epoch ([Note: tree epoch])"),
        Seam(DeepSpeedEngine, "_configure_zero_optimizer", handover.configure_zero_optimizer,
             "a z3ext engine logs one line (rank 0) of what z3ext owns and hands to DeepSpeed ([Note: handover line])"),
        Seam(DeepSpeedEngine, "_forward_prologue", external.forward_prologue,
             "an eager z3ext engine flags its cached parameter dicts instead of walking every module "
             "([Note: forward flags])"),
        Seam(DeepSpeedEngine, "_forward_epilogue", external.forward_epilogue,
             "the same at the forward's end ([Note: forward flags])"),
        Seam(DeepSpeedEngine, "backward", generation.engine_backward,
             "a backward releases what no_grad forwards kept resident ([Note: generation residency])"),
        Seam(DeepSpeedEngine, "train", generation.engine_train,
             "training mode releases what no_grad forwards kept resident ([Note: generation residency])"),
        Seam(DeepCompileZ3EagerFallback, "__new__",
             _dispatch_new(DeepCompileZ3EagerFallback, "engine", fallback.new_fallback),
             "DeepCompile's eager fallback on z3ext claims for z3ext engines"),
        Seam(AsyncPartitionedParameterSwapper, "__new__",
             _dispatch_new(AsyncPartitionedParameterSwapper, "ds_config", swap.new_swapper),
             "NVMe parameter swapping on z3ext's aio_handle"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_rigid_load_state_dict", swap.rigid_load_state_dict,
             "checkpoint load with NVMe-resident sub-groups (stock 0.19.8 crashes there)"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "create_reduce_and_remove_grad_hooks", grad_hooks.create_hooks,
             "a z3ext engine's per-parameter gradient hooks make stock's calls without its wrappers "
             "([Note: lean gradient hook])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "reduce_independent_p_g_buckets_and_remove_grads", grads.note_gradient,
             "a gradient is noted in z3ext's bucket, reduce-scattered by the C++ op ([Note: gradient path])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "independent_gradient_partition_epilogue", grads.epilogue,
             "the backward's end flushes z3ext's gradient bucket before DeepSpeed's epilogue"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_pre_step", grads.pre_step,
             "the step drops gradients never reduced, as DeepSpeed clears its buckets there"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "step", offload.optimizer_step,
             "the step's release of everything keeps persistent parameters gathered, re-gathered in place "
             "after it ([Note: persistent refresh])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_post_step", grads.post_step,
             "with z3ext.free_grad_partitions, the gradient partitions are freed until the next flush (zeroed where DeepSpeed reduces)"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_overflow_clean_up", grads.overflow_clean_up,
             "a step skipped for an fp16 overflow frees (or zeroes) the gradient partitions as a step does"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_create_fp32_partitions", master.create_fp32_partitions,
             "a bf16/fp16 parameter's partition becomes its fp32 master ([Note: partition is the master])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "offload_states", master.offload_states,
             "freed gradient partitions are re-allocated before DeepSpeed copies them out; lp_params that are "
             "the masters move as the masters ([Note: partition is the master])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "reload_states", master.reload_states,
             "masters moved as lp_params come back; the partitions' views follow ([Note: partition is the master])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_get_fp32_grad_state_partition", grads.partitions_first,
             "freed gradient partitions are re-allocated (zeros) before a gradient accessor reads or writes them"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "set_fp32_grad_for_param", grads.partitions_first,
             "freed gradient partitions are re-allocated (zeros) before a gradient accessor reads or writes them"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "set_local_grad_for_param", grads.partitions_first,
             "freed gradient partitions are re-allocated (zeros) before a gradient accessor reads or writes them"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "update_fp32_grad_for_param_vectorized", grads.partitions_first,
             "freed gradient partitions are re-allocated (zeros) before a gradient accessor reads or writes them"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_prepare_fp32_grad_for_sub_group", grads.prepare_step_gradient,
             "the optimizer steps on a view of the gradient buffer, not a flattened copy ([Note: step gradient view])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "unscale_and_clip_grads", grads.unscale,
             "an unscale by exactly 1 (no loss scale, no clipping triggered) is skipped, one done in the step "
             "gradient's copy too ([Note: fused unscale])"),
        Seam(DeepSpeedZeroOptimizer_Stage3, "_get_norm_groups", norm.get_norm_groups,
             "the gradient norm in one multi-tensor pass per sub-group and one all-reduce ([Note: gradient norm])"),
        Seam(LinearFunctionForZeroStage3, "apply", linear.stock_apply_seam,
             "memory_efficient_linear on a z3ext weight: under no_grad its forward without autograd's per-call "
             "binding ([Note: no_grad linear]), in grad mode its ops as one C++ node ([Note: grad-mode linear]), "
             "each one C++ call ([Note: linear in one call])"),
        Seam(stage3, "count_used_parameters_in_backward", grads.count_used_parameters,
             "the gradient hooks' count of the parameters a backward reaches, in one C++ call "
             "([Note: backward hook count])"),
    ]


class _Installed(NamedTuple):
    seam: Seam
    stock: Any        # the class's own attribute before install, or _ABSENT
    replacement: Any


_installed = []  # in install order; empty when not installed


def install():
    """Replaces every seam's attribute (idempotent)."""
    if _installed:
        return
    for seam in _table():
        stock = seam.owner.__dict__.get(seam.attr, _ABSENT)
        replacement = seam.build(getattr(seam.owner, seam.attr))
        setattr(seam.owner, seam.attr, replacement)
        _installed.append(_Installed(seam, stock, replacement))


def uninstall():
    """Puts DeepSpeed's own attributes back. Refused while a z3ext engine is alive: its parameters and
    module hooks are z3ext's until `engine.destroy()`."""
    from deepspeed_z3ext.state import live_states
    live = live_states()
    if live:
        raise Z3extError(f"z3ext: cannot uninstall while {len(live)} z3ext engine(s) are alive "
                         f"(models: {sorted({type(s.module).__name__ for s in live})}); call engine.destroy() first")
    moved = [f"{_name(i.seam.owner)}.{i.seam.attr}" for i in _installed
             if i.seam.owner.__dict__.get(i.seam.attr) is not i.replacement]
    if moved:
        raise Z3extError(f"z3ext: {', '.join(moved)} were replaced by someone else after z3ext installed its "
                         "seams; nothing was restored")
    while _installed:
        seam, stock, _ = _installed.pop()
        if stock is _ABSENT and seam.attr == "__new__":
            seam.owner.__new__ = plain_new
        elif stock is _ABSENT:
            delattr(seam.owner, seam.attr)
        else:
            setattr(seam.owner, seam.attr, stock)


def installed() -> list:
    """`(class name, attribute, why)` of each installed seam."""
    return [(_name(i.seam.owner), i.seam.attr, i.seam.why) for i in _installed]


def _name(owner) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__
