"""Z3extState: everything z3ext holds for one DeepSpeed engine.

[Note: per-engine state] The C++ GatherEngine (handles, claims, gathered storages, gather stream) is created per
engine; parameters point at their handle through `param._z3ext_handle`, so re-wrapping a model with a
new engine re-points them and the old engine's state is unreachable from the model. Nothing is
process-global except the class-level seams installed at import (seams.py).

[Note: re-wrapped parameters] An engine kept alive after a later one wrapped its module (TRL's DPO keeps the
inference engine that precomputed the reference log-probs, over the policy the trainer then wraps) still has
its hooks on the module, as stock's does. Adopting a parameter of such an engine, the new one takes it whole:
the old one's claims on it are dropped and its cached units forgotten, so its hooks find none of its parameters
there and the new engine alone gathers and releases them (before, the old hooks went on claiming them through
their old handles, and with the old engine's persistence kept the whole model gathered). A parameter is
persistent where its engine's DeepSpeedZeRoOffload marked it (`persistent_parameters`, what stock gathers again
after every step), not by its `ds_persist`, which stock never resets: a threshold of the earlier engine
(prepare_deepspeed's "auto" left unresolved: DeepSpeed's 1e5) would make the whole model resident.
"""
import atexit
import weakref
from typing import Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus, ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params
from deepspeed.utils import z3_leaf_module

from deepspeed_z3ext import claims, comms, schedule, watchdog
from deepspeed_z3ext.conditional import conditional_params
from deepspeed_z3ext.epoch import TREE, watch_module_registrations
from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext._ops import ops
from deepspeed_z3ext import entry

HANDLE_ATTR = "_z3ext_handle"
STATE_ATTR = "_z3ext_state"


# Live states, weakly: at interpreter exit each is torn down while Python and CUDA are still up
# (its C++ side holds Python objects and CUDA events that must not outlive them).
_LIVE = weakref.WeakSet()


@atexit.register
def _teardown_at_exit():
    for state in list(_LIVE):
        state.destroy()
    watchdog.stop_thread()  # no store call of its thread may be running while Python finalizes


def live_states() -> list:
    """The states of z3ext engines not destroyed yet (unreachable ones collected first)."""
    import gc
    gc.collect()
    return list(_LIVE)


def offload_of(engine):
    """The DeepSpeedZeRoOffload of a DeepSpeedEngine (or of its stage-3 optimizer, or itself)."""
    opt = getattr(engine, "optimizer", engine)
    return getattr(opt, "parameter_offload", opt)


def of_engine(engine) -> "Optional[Z3extState]":
    """The z3ext state of a DeepSpeedEngine (or of its optimizer / DeepSpeedZeRoOffload); None when
    z3ext is not enabled for it."""
    return getattr(offload_of(engine), "z3ext", None) if engine is not None else None


def of_optimizer(optimizer) -> "Optional[Z3extState]":
    """The z3ext state of a stage-3 optimizer (its DeepSpeedZeRoOffload's); None when not z3ext's."""
    return getattr(getattr(optimizer, "parameter_offload", None), "z3ext", None)


def of_param(param) -> "Optional[Z3extState]":
    """The z3ext state that owns a ZeRO-3 parameter; None for a parameter of no z3ext engine."""
    return getattr(param, STATE_ATTR, None)


def group_of(param):
    """The process group a ZeRO-3 parameter is partitioned over (None means the world)."""
    group = getattr(param, "ds_process_group", None)
    return group if group is not None else tdist.group.WORLD


class Z3extState:

    def __init__(self, module: torch.nn.Module, config, persistent=None):
        self.config = config
        # [Note: re-wrapped parameters]: the offload's persistent parameters; None: each one's ds_persist
        self._persistent = None if persistent is None else {id(p) for p in persistent}
        self.module = module
        self.engine = ops().GatherEngine(ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE)
        if comms.enabled():  # DeepSpeed's comms logger records z3ext's gathers ([Note: comms logger])
            self.engine = comms.LoggedGatherEngine(self.engine, tdist.get_world_size(), private.hpz_node_world())
        self._units = {}  # id(module) -> (key, FetchUnit, its own parameters, tree epoch checked at)
        self._param_dicts = (-1, [])  # (tree epoch, the tree's ZeROOrderedDicts) ([Note: forward flags])
        self.groups = {}  # id(owner module) -> groups.FetchGroup ([Note: fetch groups])
        self.coordinator = None  # set by Z3extZeRoOffload
        self.compiled = False    # set when DeepCompile takes over the forward (fallback.py)
        self.grad_reducer = None  # grads.GradReducer at the first gradient, False: DeepSpeed's path
        self.optimizer = None     # a weak reference to the stage-3 optimizer, once it hooked the gradients
        self.conditional_params = []  # reduced at each backward's end ([Note: conditional modules])
        self.params = []
        names = {id(p): n for n, p in module.named_parameters()}
        for p in module.parameters():
            self._adopt(p, names.get(id(p), f"<ds_id {p.ds_id}>"))
        # The engine's ranks: the largest group its parameters are partitioned over ([Note: one schedule on
        # every rank] in schedule.py).
        groups = [group_of(p) for p in self.params] or [tdist.group.WORLD]
        self.agreement = schedule.RankAgreement(max(groups, key=tdist.get_world_size))
        # [Note: agree before the collective] in csrc/agreement.h: on gloo, every z3ext collective is named first
        self.preagreement = None
        if config.agree_before_collectives and self.agreement.world > 1 and \
                tdist.get_backend(self.agreement.group) == "gloo":
            self.preagreement = schedule.Preagreement(self.engine)
            self.agreement.preagreement = self.preagreement
            self.engine.set_disagree(self.preagreement.disagree)
        # [Note: hang watchdog] in watchdog.py: every z3ext collective is recorded; a stalled one is named
        self.watchdog = None
        if config.hang_timeout > 0 and self.agreement.world > 1:
            progress = ops().Progress()
            self.engine.set_progress(progress)
            self.agreement.progress = progress
            try:
                self.watchdog = watchdog.Watchdog(progress, self.agreement.group, config.hang_timeout,
                                                  lambda: {h.ds_id: h.name for h in self.engine.handles},
                                                  self.issued_groups)
            except Exception as e:  # noqa: BLE001 (no store to reach the other ranks through: no watchdog)
                from deepspeed.utils import logger
                logger.warning(f"z3ext: no hang watchdog ({type(e).__name__}: {e}); hang_timeout has no effect")
        self.schedule_check = (None if config.schedule_check == "off" else schedule.ScheduleCheck(
            self.engine, self.agreement, every_forward=config.schedule_check == "forward"))
        watch_module_registrations()  # [Note: tree epoch]
        _LIVE.add(self)

    def _adopt(self, param, name):
        prior = getattr(param, STATE_ATTR, None)
        if prior is not None and prior is not self:
            prior._disown(param)  # [Note: re-wrapped parameters]
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            # Gathered by stock code before z3ext took over (e.g. GatheredParameters at load time).
            param.partition()
        group = group_of(param)
        handle = self.engine.make_handle(param, name, param.ds_id, param.ds_numel, param.ds_tensor.ds_numel,
                                         list(param.ds_shape), group, tdist.get_rank(group),
                                         tdist.get_world_size(group), self._persists(param))
        hpz = getattr(param, "ds_zero_param_process_group", None)
        if hpz is not None and getattr(param, "ds_secondary_tensor_group_size", 1) > 1:
            # ZeRO++ hpZ ([Note: hpZ secondary partition] in csrc/secondary.h)
            self.engine.set_secondary(handle, hpz, tdist.get_rank(hpz), tdist.get_world_size(hpz),
                                      PartitionedParamStatus.AVAILABLE)
        setattr(param, HANDLE_ATTR, handle)
        setattr(param, STATE_ATTR, self)
        entry.take_over(param, self)
        self.params.append(param)

    def _persists(self, param) -> bool:
        if self._persistent is None:
            return bool(param.ds_persist)
        return id(param) in self._persistent

    def _disown(self, param):
        """A later engine adopts `param` ([Note: re-wrapped parameters]): this engine's claims on it but a live
        GatheredParameters block's are dropped (its storage released, as at DeepSpeed's release of everything), and
        the units cached with its handle are rebuilt at their next use."""
        self.engine.drop_kinds(self.unit_of([param]), list(claims.RESET_KINDS))
        self._units.clear()
        TREE.advance()  # this engine's fetch groups rebuild from the units

    def owns(self, param) -> bool:
        return getattr(param, STATE_ATTR, None) is self

    def unit_of(self, params):
        handles = []
        for p in params:
            h = getattr(p, HANDLE_ATTR, None)
            if h is None or not self.owns(p):
                raise RuntimeError(f"z3ext: parameter {getattr(p, 'ds_id', '?')} with shape "
                                   f"{tuple(getattr(p, 'ds_shape', p.shape))} does not belong to this engine")
            handles.append(h)
        return ops().FetchUnit(handles)

    def unit_for(self, module, checked=True):
        """The fetch unit of a module: its direct (or, for a z3 leaf, all) and external parameters.
        `checked=False` (the prefetch path, which reads every upcoming unit) trusts the cached unit: the
        module's own fetch checks it and gathers what a stale prefetch missed. A group's owner: the
        union of its members' units ([Note: fetch groups])."""
        if self.groups:
            group = self.groups.get(id(module))
            if group is not None:
                unit = group.unit
                if unit is not None and (not checked or (group.epoch == TREE.value and not group.dirty)):
                    return unit  # [Note: tree epoch]
                return self._group_unit(group)
        return self._module_unit(module, checked)

    def _module_unit(self, module, checked):
        cached = self._units.get(id(module))
        epoch = TREE.value
        if cached is not None and (not checked or cached[3] == epoch):
            return cached[1]  # [Note: tree epoch]
        # [Note: late parameters] A ZeRO parameter created under zero.Init after initialize (set on, or
        # replacing one of, an existing module) has no handle: it is adopted here and gathered, as stock
        # gathers whatever ZeRO parameters a module has. The cache is keyed by the module's parameters
        # (held in the entry, so their ids cannot be reused) to see such a change.
        own = tuple(module._parameters.values())
        key = (len(module._external_params) if hasattr(module, "_external_params") else 0, tuple(map(id, own)))
        if cached is not None and cached[0] == key:
            self._units[id(module)] = (key, cached[1], own, epoch)
            return cached[1]
        params = list(iter_params(module, recurse=z3_leaf_module(module))) + conditional_params(module)
        for p in params:
            if hasattr(p, "ds_id") and getattr(p, STATE_ATTR, None) is None:
                self._adopt(p, next((n for n, q in self.module.named_parameters() if q is p), f"<ds_id {p.ds_id}>"))
        unit = self.unit_of([p for p in params if self.owns(p)])
        self._units[id(module)] = (key, unit, own, epoch)
        return unit

    def external_count_seen(self, module, count):
        """`module` has `count` external parameters (external.py): a unit cached with another count is
        checked again at its next use ([Note: tree epoch])."""
        cached = self._units.get(id(module))
        if cached is not None and cached[0][0] != count:
            TREE.advance()

    def param_dicts(self):
        """The model's ZeROOrderedDicts, every module's `_parameters` made one first (DeepSpeed's
        `ensure_zero_ordered_dict`, which its forward prologue applies to modules added after
        initialize); walked again only when the tree epoch moved ([Note: forward flags])."""
        epoch, dicts = self._param_dicts
        if epoch != TREE.value:
            from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict
            for m in self.module.modules():
                ensure_zero_ordered_dict(m)
            dicts = [m._parameters for m in self.module.modules() if isinstance(m._parameters, ZeROOrderedDict)]
            self._param_dicts = (TREE.value, dicts)  # after the walk: converting a dict moved the epoch
        return dicts

    def _group_unit(self, group):
        """A group's unit made again (unit_for: its cached one is stale)."""
        # The owner's own unit: no parameters of its own, but externals its forward may discover.
        units = [self._module_unit(group.owner, True)] + [self._module_unit(m, True) for m in group.members]
        if group.unit is None or any(u is not c for u, c in zip(units, group.member_units)):
            group.unit = ops().FetchUnit([h for u in units for h in u.handles])
            group.member_units = units
            group.ds_ids = frozenset(h.ds_id for h in group.unit.handles)
        group.dirty = False
        group.epoch = TREE.value
        return group.unit

    def discover_external(self, module, param):
        """Claims `param` for `module`'s running forward ([Note: external discovery]); the module's
        release drops the claim, as its unit (rebuilt with the new external) now holds the parameter.
        Inside an open group, for the group's owner, whose release rebuilds the group with it."""
        TREE.advance()  # the module's unit gains it ([Note: tree epoch])
        group = self.coordinator.open_group_of(module) if self.coordinator is not None else None
        if group is not None:
            group.dirty = True
            module = group.owner
        self.engine.unshard(self.unit_of([param]), claims.FORWARD, module.ds_id)

    def destroy(self):
        """Drops every claim, returns every buffer, hands the parameters back to stock DeepSpeed."""
        _LIVE.discard(self)
        if self.watchdog is not None:
            self.watchdog.close()
        self.engine.destroy()
        for p in self.params:
            if self.owns(p):
                entry.give_back(p)
                delattr(p, HANDLE_ATTR)
                delattr(p, STATE_ATTR)
        self.params = []
        self._units.clear()
        self.groups = {}
        self.coordinator = None
        self.grad_reducer = None

    def issued_groups(self) -> list:
        """Every process group this engine's collectives go over, once: the engine's, each parameter's, hpZ's, the
        gradient norm's, the votes' gloo world ([Note: the deadline is the group's] in deadline.py)."""
        found = {}
        candidates = [self.agreement.group, schedule._HOST_WORLD or None]
        for p in self.params:
            candidates.append(group_of(p))
            if getattr(p, "ds_secondary_tensor_group_size", 1) > 1:  # hpZ ([Note: hpZ secondary partition])
                candidates.append(getattr(p, "ds_zero_param_process_group", None))
        if self.grad_reducer and self.grad_reducer.norm_group is not None:
            candidates.append(self.grad_reducer.norm_group[0])
        for g in candidates:
            if g is not None:
                found.setdefault(id(g), g)
        return list(found.values())

    def check_leaks(self, when):
        """Raises `LeakError` on every rank naming parameters gathered without a claim, or whose released (empty)
        gathered storage is still referenced outside z3ext ([Note: a leak named on every rank] in leaks.py)."""
        from deepspeed_z3ext import leaks
        leaks.check(self, when)
