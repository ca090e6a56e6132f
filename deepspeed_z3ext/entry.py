"""The per-parameter entry points DeepSpeed calls directly, routed to claims.

DeepSpeed attaches `all_gather`, `all_gather_coalesced` and `partition` to every ZeRO-3 parameter and
calls them from the external-parameter getter, the memory-efficient linear's backward, the stage-3
optimizer (initial hooks, post-step re-gather of persistent parameters), checkpoint save/load and
GatheredParameters. z3ext replaces them per parameter with functions bound to its engine state.

[Note: direct claims] A direct `all_gather()` takes a Direct claim (owner SHARED_OWNER), which `partition()`
drops, as does the release of any module whose fetch unit holds the parameter (stock releases
directly gathered external parameters with the module they were registered to). `partition()` also
drops the Persist claim, since DeepSpeed calls it on persistent parameters around checkpoints;
claims of running modules, autograd and GatheredParameters blocks keep the parameter gathered.
"""
from deepspeed_z3ext import claims

ENTRY_POINTS = ("all_gather", "all_gather_coalesced", "partition")
_SAVED = "_z3ext_stock_entry_points"


class _Done:
    """What async gathers return: z3ext's unshard has already made the parameters usable."""

    def wait(self, *args, **kwargs):
        return None


def take_over(param, state):
    if not hasattr(param, _SAVED):
        setattr(param, _SAVED, {name: getattr(param, name) for name in ENTRY_POINTS})
    direct, persist, owner = claims.DIRECT, claims.PERSIST, claims.SHARED_OWNER
    own = state.unit_of([param])  # the common call has no list: no unit built per call

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        state.engine.unshard(own if param_list is None else state.unit_of(param_list), direct, owner)
        return [_Done()] if async_op else None

    def all_gather_coalesced(params, safe_mode=False, quantize=False):
        state.engine.unshard(state.unit_of(params), direct, owner)
        return _Done()

    def partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        unit = own if param_list is None else state.unit_of(param_list)
        if has_been_updated:
            state.engine.write_back(unit)
        state.engine.drop_kinds(unit, [direct, persist])

    param.all_gather = all_gather
    param.all_gather_coalesced = all_gather_coalesced
    param.partition = partition


def give_back(param):
    saved = getattr(param, _SAVED, None)
    if saved is not None:
        for name, fn in saved.items():
            setattr(param, name, fn)
        delattr(param, _SAVED)
