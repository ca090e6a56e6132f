"""DeepSpeed internals that z3ext reads or writes, in one place ([Note: deepspeed internals]).

[Note: deepspeed internals] Public DeepSpeed API does not reach everything z3ext must touch: the
forward module stack (a module global of parameter_offload), DeepCompile's active eager fallback and
its process-global backward hook lists, the stage-3 optimizer's gradient partitions (a
name-mangled private), and the swapper's I/O handle factory (a module global). Each is read here by name, so a DeepSpeed upgrade that moves one breaks one
function, which says what it looked for. The classes z3ext replaces attributes of are seams.py's.
Tested with the DeepSpeed versions in TESTED_VERSIONS; another version warns once at import.
"""
import collections
import contextlib
import sys

import deepspeed
from deepspeed.runtime.zero import parameter_offload

TESTED_VERSIONS = ("0.19.8", )

# DeepSpeedZeroOptimizer_Stage3.__param_id_to_grad_partition: ds_id -> this rank's gradient partition.
_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def check_version():
    """Warns (once, at import) when DeepSpeed is not a version these accessors were tested with."""
    if deepspeed.__version__ not in TESTED_VERSIONS:
        from deepspeed.utils import logger
        logger.warning(f"deepspeed_z3ext is tested with DeepSpeed {', '.join(TESTED_VERSIONS)}; this is "
                       f"{deepspeed.__version__}: its internals in deepspeed_z3ext/deepspeed_private.py may differ")


def forward_module_stack() -> list:
    """DeepSpeed's process-global stack of modules inside their forward (external-parameter tracking)."""
    return parameter_offload.FWD_MODULE_STACK


def hpz_node_world():
    """The size of DeepSpeed's process-global ZeRO++ hpZ intra-node group; None before one is made."""
    from deepspeed.utils import groups
    if groups._get_zero_param_intra_parallel_group() is None:
        return None
    return groups._get_zero_param_intra_parallel_group_world_size()


def grad_partitions(optimizer):
    """The stage-3 optimizer's ds_id -> gradient partition map, or None (no such optimizer)."""
    return getattr(optimizer, _GRAD_PARTITIONS, None)


def backward_hook_state(optimizer):
    """The optimizer's backward-hook bookkeeping (hooks fired, expected, reentrant phases, the epilogue
    decision): the object stock's optimizer methods of those names delegate to."""
    return optimizer._backward_hook_state


def routine_hook(optimizer):
    """The optimizer's backward-hook state if a gradient hook firing now is a routine one ([Note: routine gradient
    hook] in grad_hooks.py), else None: not the first of its backward (phase), the post-backward callback queued.
    For such a hook the refresh predicate is false, the re-entry does nothing and the update only counts it
    (`count_routine_hook`). 0.19.8's `BackwardHookState` methods."""
    hooks = optimizer._backward_hook_state
    if (hooks.hooks_fired_this_backward and hooks.post_backward_callback_queued
            and not (hooks.remaining_grad_acc_hooks == 0 and hooks.backward_active_depth == 0
                     and hooks.backward_seen_this_step)):
        return hooks
    return None


def count_routine_hook(hooks):
    """`update_hook_state_and_maybe_run_epilogue(max_expected_hooks_seen)` for a routine hook: one more fired,
    the expected count unchanged, the callback already queued, so only the remaining count moves."""
    fired = hooks.hooks_fired_this_backward + 1
    hooks.hooks_fired_this_backward = fired
    hooks.remaining_grad_acc_hooks = max(hooks.max_expected_hooks_seen - fired, 0)


def active_fallback():
    """DeepCompile's module-global eager fallback of the running engine.forward (None outside)."""
    from deepspeed.compile import z3_eager_fallback
    return z3_eager_fallback._ACTIVE_FALLBACK


# The module whose `_ACTIVE_FALLBACK` is DeepCompile's running fallback (active_fallback); external.py reads it
# through sys.modules on each parameter access, without importing it.
EAGER_FALLBACK_MODULE = "deepspeed.compile.z3_eager_fallback"


def set_active_fallback(fallback):
    from deepspeed.compile import z3_eager_fallback
    z3_eager_fallback._ACTIVE_FALLBACK = fallback


def backward_hook_lists():
    """DeepCompile's process-global (pre-backward, post-backward) hook lists, edited in place."""
    from deepspeed.compile import util
    return util.pre_backward_hooks, util.post_backward_hooks


@contextlib.contextmanager
def swapper_io_builder(builder):
    """The partitioned-parameter swapper names its I/O handle factory through its module global
    AsyncIOBuilder: rebound to `builder` for the duration of one `_configure_aio` call only
    (construction is single-threaded), so everything else the swapper sets up stays DeepSpeed's."""
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps
    saved = pps.AsyncIOBuilder
    pps.AsyncIOBuilder = builder
    try:
        yield
    finally:
        pps.AsyncIOBuilder = saved


def _false():
    return False


@contextlib.contextmanager
def without_forward_walk(engine):
    """Inside, `engine._forward_prologue` and `_forward_epilogue` skip their walk over every module
    ([Note: forward flags] in external.py): in 0.19.8 `zero_optimization_partition_weights()` gates that
    walk and nothing else in either, and an instance attribute shadows the method for this call."""
    engine.__dict__["zero_optimization_partition_weights"] = _false
    try:
        yield
    finally:
        del engine.__dict__["zero_optimization_partition_weights"]


class _GatheredDict(parameter_offload.ZeROOrderedDict):
    """A module's ZeROOrderedDict while all its parameters are gathered for the time ([Note: lifted getters] in
    lifted.py): OrderedDict's lookup, DeepSpeed's setter and deleter (and z3ext's seams on them)."""
    __slots__ = ()
    __getitem__ = collections.OrderedDict.__getitem__


# A ZeROOrderedDict whose class is set to GATHERED_DICT looks parameters up without DeepSpeed's getter until
# `zero_lookups` (lifted.py swaps many in a loop, without a call each).
ZERO_DICT, GATHERED_DICT = parameter_offload.ZeROOrderedDict, _GatheredDict


def zero_lookups(params):
    if type(params) is _GatheredDict:
        params.__class__ = parameter_offload.ZeROOrderedDict
