"""External parameters: a ZeRO-3 parameter used inside the forward of a module that does not own it.

[Note: external discovery] DeepSpeed's getter (`ZeROOrderedDict.__getitem__`) registers such an
access only when the parameter happens to be partitioned at that moment and only inside
`engine.forward`. A resident parameter (persistent, inside a GatheredParameters block, held for
another module's backward) is therefore never registered, and activation-checkpoint recomputation,
which runs inside backward, reads whatever state the parameter is in then: a shape-[0] tensor.
z3ext registers every access made while a module of its engine runs its forward (recomputation
included), resident or not: the parameter joins that module's fetch unit, so every later fetch,
recomputation and plan prefetch of the module includes it, and it is claimed for the module's
forward at once. Accesses of a module's own parameters cost one identity check (inside an open
fetch group whose members' hooks are lifted, a parameter of the group's unit is the owner's own).
Outside any z3ext module forward (code between forwards) a gathered parameter is returned as it is
([Note: gathered outside a module forward]); there otherwise, while Dynamo traces, and for an engine
DeepCompile took over (its eager fallback, fallback.py, is driven from DeepSpeed's getter)
DeepSpeed's getter runs.
"""
import sys
from collections import OrderedDict

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, register_external_parameter

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext.epoch import TREE
from deepspeed_z3ext.state import STATE_ATTR, of_engine

_dict_getitem = OrderedDict.__getitem__
_AVAILABLE = ZeroParamStatus.AVAILABLE
_modules, _FALLBACK_MODULE = sys.modules, private.EAGER_FALLBACK_MODULE

# [Note: gathered outside a module forward] Outside z3ext's module forwards (code between forwards, the root's own
# parameters in a generation step on the resident fast path) DeepSpeed's getter does nothing for a gathered
# parameter but record it in an active DeepCompile eager fallback, at the cost of an import statement and a dozen
# attribute reads per access: z3ext returns it. (The fast path's other modules need no getter at all: [Note:
# lifted getters] in lifted.py.)


def getitem(stock_getitem):
    """`ZeROOrderedDict.__getitem__` (seams.py): registers every access inside a z3ext module's
    forward ([Note: external discovery]); outside them a gathered z3ext parameter as it is ([Note: gathered
    outside a module forward]); DeepSpeed's getter for everything else."""

    def __getitem__(self, key):
        param = _dict_getitem(self, key)
        if param is None:
            return None  # (a bias registered as None) as DeepSpeed's getter returns it
        if torch.compiler.is_compiling():  # Dynamo traces DeepSpeed's getter, which it knows
            return stock_getitem(self, key)
        state = getattr(param, STATE_ATTR, None)
        if state is None and self._in_forward and hasattr(param, "ds_id"):
            # A ZeRO parameter z3ext has not adopted (a module attached after initialize): DeepSpeed's
            # getter registers it as an external of the running module, whose unit adopts it at its
            # next check ([Note: late parameters], [Note: tree epoch]).
            TREE.advance()
        if state is None or state.coordinator is None or state.compiled:
            return stock_getitem(self, key)
        running = state.coordinator.running
        if not running:
            if param.ds_status is _AVAILABLE:  # [Note: gathered outside a module forward]
                fallbacks = _modules.get(_FALLBACK_MODULE)  # DeepCompile's, if imported
                if fallbacks is None or fallbacks._ACTIVE_FALLBACK is None:
                    return param
            return stock_getitem(self, key)
        top = running[-1]
        if self._parent_module is not top:
            # Inside an open group whose members' hooks are lifted, the owner runs for them: a parameter of the
            # group's unit is its own ([Note: member hooks] in lifted.py).
            group = state.groups.get(id(top)) if state.groups else None
            if group is None or not group.open or param.ds_id not in group.ds_ids:
                discover(state, top, param)
        return param

    return __getitem__


def discover(state, module, param):
    """`param` is used in `module`'s forward: make it part of the module's unit and claim it now."""
    if getattr(param, "ds_z3_leaf_module", None) is module:
        return  # a z3 leaf module's unit holds all its descendants' parameters
    external = getattr(module, "_external_params", None)
    if external is None or id(param) not in external:
        register_external_parameter(module, param)
    elif param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
        # Registered before this fetch (so in the unit), or already gathered for it; or registered by
        # the user since the unit was cached: it joins the unit at the module's release ([Note: tree epoch]).
        state.external_count_seen(module, len(external))
        return
    coordinator = state.coordinator
    if coordinator is not None and coordinator.discover_together(module, param):
        return  # [Note: discoveries recorded together] in coordinator.py
    state.discover_external(module, param)


# [Note: forward flags] DeepSpeed's forward prologue and epilogue walk every module of the model twice
# per forward: the prologue turns each module's `_parameters` into a ZeROOrderedDict (modules added
# after initialize) and sets its `_in_forward`, which DeepSpeed's getter reads to gather external
# parameters, and the epilogue clears it (on the CPU VM, 2.0M of the 36M instructions of a 16-layer
# GPT's tiny forward). For an eager z3ext engine the same is done on the list of the model's
# ZeROOrderedDicts, walked again only when the tree epoch moved ([Note: tree epoch]), and DeepSpeed's
# own walks are skipped (deepspeed_private.without_forward_walk); the rest of its prologue and
# epilogue (timers, profilers, casts) runs as it is. A compiled engine (Dynamo traces DeepSpeed's
# getter; DeepCompile's fallback drives it) keeps DeepSpeed's walks.
def _eager_state(engine):
    state = of_engine(engine)
    if state is None or state.compiled or engine.is_compiled:
        return None
    return state


def forward_prologue(stock):
    """`DeepSpeedEngine._forward_prologue` (seams.py) ([Note: forward flags])."""
    def _forward_prologue(self, inputs, kwargs):
        state = _eager_state(self)
        if state is None:
            return stock(self, inputs, kwargs)
        for d in state.param_dicts():
            d._in_forward = True
        with private.without_forward_walk(self):
            return stock(self, inputs, kwargs)

    return _forward_prologue


def forward_epilogue(stock):
    """`DeepSpeedEngine._forward_epilogue` (seams.py) ([Note: forward flags])."""
    def _forward_epilogue(self):
        state = _eager_state(self)
        if state is None:
            return stock(self)
        for d in state.param_dicts():
            d._in_forward = False
        with private.without_forward_walk(self):
            return stock(self)

    return _forward_epilogue
