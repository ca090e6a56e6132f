"""Z3extCoordinator: module-driven fetch and release through claims.

It stands in for DeepSpeed's PartitionedParameterCoordinator behind the same interface, so
DeepSpeed's own module hooks (and the stage-3 optimizer) drive it unchanged. Each module's
parameters form one fetch unit, and in forward a repeated block's modules form one ([Note: fetch
groups] in groups.py): one C++ call claims and gathers it, one call releases it.

[Note: forwards that differ by rank] Ranks may run different modules in a forward (LayerDrop drawn per rank, a
vision tower on some ranks' batches, a head per task): each rank would gather what it runs, and the ranks'
all-gathers would differ. With several ranks (`z3ext.agree_forwards`, on by default):
- The first forward of each grad mode (training; no_grad: evaluation, a reference's logits, generation) is
  recorded by the ranks together: before each fetch the ranks exchange the ds_id of the module each fetches next
  (a rank whose forward is over asks for none); the smallest is served, and a rank
  that asked for another gathers the served module as one it skips, until its own is served. Every rank so
  records the same plan, the union of what ran, in one order ([Note: forward plan] in plan.py); one tiny exchange
  per module, in that forward only. Where the ranks ran different modules, no fetch groups are formed (they are
  formed from what each rank ran), and the members of a list of like modules that no rank ran are put in the plan
  by analogy with one that ran (`plan.fill_siblings`: LayerDrop may drop a layer everywhere in that forward); the
  members of a dict of like modules (a head per task) are, whatever ran ([Note: a dict of like modules]).
- Every later forward of that grad mode walks its plan: a module fetched past the cursor first passes the positions
  it skipped, each gathered (or passed in the prefetch window) as if its module had run there, and the forward's
  end passes what is left of the forward's positions, unless the forward left the plan (a module off it: another
  kind of forward, such as a submodule called on its own, which adopts its own plan as before).
- A skipped module is released as its own forward's end would decide on a rank that ran it (in that rank's grad
  mode: [Note: skipped with the runner's grad mode]; the outermost module's release after the positions skipped
  last): held for backward within the same budgets (`_holds`), or recorded for the backward walk ([Note: backward
  walk] in window.py), so that budgets, holds and backward gathers stay the same on every rank ([Note: outputs
  that need a gradient]); in a no_grad forward released, or kept resident in a generation step ([Note: generation
  residency] in resident_set.py), so that every rank keeps the same units.
[Note: outputs that need a gradient] A module's call needs its backward when an output needs a gradient: its
unit is trainable, or its input needs one. The second differs by rank where ranks skip different modules (a
LoRA layer's frozen base, fed by an earlier adapter that one rank dropped), and a skipping rank cannot see it.
So in a forward recorded together or walked, a call (run or skipped) is taken as needing its backward where
its outputs need a gradient or where its module comes at or after the plan's first trainable unit
(`ForwardPlan.follows`): the plan is the same on every rank, and a gradient can reach a module's input only
from a trainable unit before it (or from the forward's inputs). Frozen units before the first trainable one
(an embedding, a frozen tower on pixels) need none on every rank; a frozen unit after it whose input needs no
gradient on this rank is held or walked for nothing (a LoRA model's first frozen projections, beside the
first adapter): memory or a gather, never a schedule that differs.
The gradients need nothing more ([Note: fixed gradient layout], [Note: presence agreed] in grads.py). Not covered:
a module off the plan on some ranks only (never run while recording, and no sibling to copy), which the ranks'
collectives name ([Note: a module off the plan]); forwards inside backward (recomputation) are not walked.
"""
import collections
import contextlib
import functools
import weakref
from typing import Optional

import torch
from deepspeed.runtime.zero.partition_parameters import register_external_parameter
from deepspeed.utils import log_dist, logger

from deepspeed_z3ext import claims, groups
from deepspeed_z3ext.conditional import is_conditional
from deepspeed_z3ext.groups import MemberClaims
from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext.grads import reducer_of
from deepspeed_z3ext.graphs import BackwardClaims, Phase, claim_per_call, forward_phase, grad_nodes as _grad_nodes, in_backward
from deepspeed_z3ext.plan import ForwardPlan, fill_siblings
from deepspeed_z3ext.resident_set import ResidentSet
from deepspeed_z3ext.window import BackwardWindow, PrefetchWindow

_END = 1 << 62  # what a rank whose forward is over asks for ([Note: forwards that differ by rank])
_RESIDENT_SHARE = 0.5  # of the free memory, what generation may keep gathered ([Note: resident budget])


def _free_bytes(device) -> int:
    """What this rank could still allocate on `device`: the device's free memory and the CUDA allocator's cached,
    unused blocks; on the CPU, the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil
    return psutil.virtual_memory().available


class Z3extCoordinator:

    def __init__(self, state, max_live_numel, prefetch_bucket_numel, hold_for_backward=True, hold_max_numel=None,
                 group_max_numel=None, group_claim_max_numel=None, resident_numel=None, resident_from_memory=False):
        self.state = state
        self.plans = {True: ForwardPlan(), False: ForwardPlan()}  # by grad mode, see [Note: forward plan]
        self.plan = self.plans[True]
        self.hierarchy = 0  # read and written by the stage-3 optimizer
        # [Note: hold for backward] Autograd's use of a module's parameters in backward is a claim:
        # at the end of a grad-enabled forward whose outputs need grad, the module's Forward claim
        # becomes a Backward claim of the autograd graph of this forward call ([Note: graph claims]
        # in graphs.py), so backward (and a GatheredParameters block or another forward between
        # forward and backward) needs no re-gather. A unit is held only while the graph's held
        # elements stay within `hold_max_numel` and the elements of all gathered storages within
        # stage3_max_live_parameters; past either, it is released for real ([Note: true release]) and
        # gathered again ahead of its backward ([Note: backward prefetch]), under a claim of that one
        # call. A held unit stays gathered through the whole backward (its graph's claims end with the
        # pass), so what is held adds to the peak of backward, where activations peak too: the budget
        # defaults to what backward prefetch keeps ahead (5e7 elements), not to the live budget (1e9 by
        # default: the whole of a 0.94B model, 1.26x FSDP2's peak at a simulated world of 8).
        self._hold_enabled = hold_for_backward
        self._hold_max = max_live_numel if hold_max_numel is None else hold_max_numel
        self._max_live = max_live_numel
        self.window = PrefetchWindow(prefetch_bucket_numel)  # [Note: prefetch window]
        self.backward_window = BackwardWindow(prefetch_bucket_numel)  # [Note: backward prefetch]
        # Units ahead trust the cache: the module's own fetch checks it and gathers what a stale prefetch missed.
        self._unit_ahead = functools.partial(state.unit_for, checked=False)
        self.running = []      # modules of this engine inside their forward (innermost last; read by external.py)
        self._warn_every = state.config.plan_warning_steps
        self._forwards = 0
        self._last_warning = None
        self._fwd, self._bwd = claims.FORWARD, claims.BACKWARD
        # [Note: generation residency] in resident_set.py: by default what the live budget leaves beside the window
        if resident_numel is None:
            resident_numel = max(0, max_live_numel - max(prefetch_bucket_numel, 0))
        self.resident = ResidentSet(state.engine, resident_numel,
                                    self._resident_from_memory if resident_from_memory else None)
        self._noting = False  # this outermost forward is a no_grad one whose units may stay resident
        self._resident_logged = False
        self.backward_claims = BackwardClaims(state.engine, state.agreement)
        self._in_step = False  # inside the optimizer's step (optimizer_step)
        # [Note: fetch groups] in groups.py: formed when the first plan is adopted
        self._group_max = max_live_numel // 2 if group_max_numel is None else group_max_numel
        self._group_claim_max = (2 * prefetch_bucket_numel if group_claim_max_numel is None else
                                 group_claim_max_numel)  # [Note: group claims] in groups.py
        self._groups_formed = False
        self._covered = {}  # id(member) -> its open FetchGroup
        # [Note: forwards that differ by rank]: this outermost forward records its plan with the other ranks, or
        # walks the plan's positions it skips
        self._recording_together = False
        self._walking = False
        self._by_ds_id = None  # ds_id -> module, made at the first forward recorded together
        self._skipping = []  # (module, unit, ids of its descendants, grad mode): skipped, released after those
        self._descendants = {}  # id(module) -> ids of the modules below it, for `_skipping`
        self._walk_marks = {}  # id(module) -> positions released before its first hold or release ([Note: reductions on the walk])
        self._owner_of = None  # (root, ds_id -> the module owning the parameter): `_owners`
        self._param_by_ds_id = None
        # [Note: a module off the plan]: the collectives' errors name it (a weak reference: the state outlives this)
        me_ = weakref.ref(self)

        def unplanned(ds_id):
            coordinator = me_()
            return coordinator.unplanned(ds_id) if coordinator is not None else None

        for reporter in (state.preagreement, state.watchdog):
            if reporter is not None:
                reporter.unplanned = unplanned
        # The declared conditional modules, which have no hooks of their own ([Note: conditional modules] in
        # conditional.py): each forward's record of which ran ([Note: presence behind a reentrant checkpoint])
        self._conditional = [m for m in state.module.modules() if is_conditional(m)]
        if self._conditional:
            me = weakref.ref(self)

            def ran(module, _args):
                coordinator = me()
                if coordinator is not None:
                    ran = coordinator.plan.conditional_ran  # id -> whether it ran with grad mode on each time
                    ran[id(module)] = ran.get(id(module), True) and torch.is_grad_enabled()

            for m in self._conditional:
                m.register_forward_pre_hook(ran)

    def _resident_from_memory(self):
        """[Note: resident budget] in resident_set.py: the elements half of this rank's free memory holds, at
        most the model's, the smallest over the ranks."""
        params = self.state.params
        if not params:
            return 0
        need = sum(p.ds_numel for p in params)
        numel = min(need, int(_free_bytes(params[0].device) * _RESIDENT_SHARE) // params[0].element_size())
        agreement = self.state.agreement
        if agreement is not None and agreement.world > 1:
            numel = min(row[0] for row in agreement.all_gather([numel], kind=5))
        if not self._resident_logged:
            self._resident_logged = True
            log_dist(f"z3ext: generation keeps up to {numel} of the model's {need} elements gathered (half of the "
                     "free memory, the smallest over the ranks; z3ext.resident_numel sets it)", ranks=[0])
        return numel

    # -- DeepSpeed's trace interface: z3ext's own plan (plan.py) replaces it; nothing to invalidate --
    def trace_prologue(self, sub_module):
        pass

    def is_record_trace(self):
        return False

    def is_complete_trace(self):
        return False

    def is_invalid_trace(self):
        return False

    def _invalidate_trace(self):
        pass

    def record_module(self, sub_module):
        pass

    # -- fetch and release ---------------------------------------------------------------------
    def hidden_runs(self) -> Optional[collections.Counter]:
        """ds_id -> how many times the unit holding it ran with grad mode off in this rank's last training forward (a
        reentrant checkpoint's first forward; not a module it skipped, nor a declared conditional module that did not
        run); None where it cannot tell: [Note: presence behind a reentrant checkpoint] in grads.py."""
        plan, unit_for, out = self.plans[True], self.state.unit_for, collections.Counter()
        for module in plan.ran_without_grad():
            if module is None:  # a member whose forward is no bound method
                return None
            out.update(h.ds_id for h in unit_for(module, checked=False).handles)
        for module in self._conditional:  # gathered with its parent whether it ran or not
            ids = [p.ds_id for p in module.parameters() if hasattr(p, "ds_id")]
            for ds_id in ids:
                out.pop(ds_id, None)
            if plan.conditional_ran.get(id(module)) is False:
                out.update(ids)
        return out

    def running_module(self):
        """The innermost module of this engine running its forward (recomputation included)."""
        return self.running[-1] if self.running else None

    def reset_step(self):
        """Start of an outermost forward: Forward and Direct claims an abandoned forward left are
        released, and Backward claims whose graph or pass is over ([Note: graph claims]); the module
        stack an exception inside a forward left dirty is cleaned, and the gradients of a backward that
        raised are dropped."""
        if self.backward_window.walk_task is not None and not in_backward():
            self._abandon_walk()  # before the raised pass's claims end
        self.backward_claims.start_forward()
        self.state.engine.sweep(claims.FORWARD_START_KINDS)
        if not in_backward():
            grad = torch.is_grad_enabled()
            # before a generation step lifts hooks ([Note: member hooks] in lifted.py); a training forward keeps a
            # kept lift ([Note: kept lift])
            self.close_all_groups(keep=grad)
            # [Note: generation residency] in resident_set.py (after the vote on dead graphs above)
            self.resident.start_forward(grad, self.backward_claims.live_graphs() > 0)
            self._noting = self.resident.keeping
            check = self.state.schedule_check
            if check is not None and check.every_forward:
                check.check("at an outermost forward")  # [Note: schedule check] in schedule.py
            _clean_module_stack()
            self.running.clear()
            if self.backward_window.walk_task is not None:
                # A backward walk that never ended: its pass raised, on every rank that walked it, whether or not
                # a gradient had come ([Note: one-rank faults] in schedule.py)
                self.state.engine.note_fault()
            self.backward_window.reset()
            self._walk_marks.clear()
            if self.state.grad_reducer:
                self.state.grad_reducer.abandon_pass()  # [Note: failed pass] in grads.py
        self.window.reset()
        self._warn_divergence()
        self.plan = self.plans[torch.is_grad_enabled()]
        recorded = self.plan.order
        self.plan.start_forward()
        if self.plan.order is not recorded:
            self._adopted(self.plan)
        self._forwards += 1
        together = not in_backward() and self.state.agreement.world > 1 and self.state.config.agree_forwards
        self._recording_together = together and self.plan.recording
        self._walking = together and not self.plan.recording and self.plan.agreed
        if self._recording_together:
            self.plan.agreed = True

    def _adopted(self, plan):
        """`plan` took a new order: the first one forms the groups ([Note: fetch groups]); each one
        sees a group's members as its owner."""
        state = self.state
        if plan.agreed and plan.diverged_recording:  # [Note: forwards that differ by rank]
            plan.order, plan.forward_len = fill_siblings(plan.order, state.module, plan.forward_len)
        if not self._groups_formed:
            self._groups_formed = True
            # Groups are formed from what each rank ran: not where the ranks ran different modules.
            state.groups = {} if plan.diverged_recording else groups.form(
                plan.order, plan.spans, state.module, self._group_max, lambda m: state.unit_for(m).numel)
            for p in self.plans.values():
                p.spans = {}
                end = p.forward_len
                if end is not None:
                    p.forward_len = len(groups.collapse(p.order[:end], state.groups))
                p.order = groups.collapse(p.order, state.groups)
        else:
            end = plan.forward_len
            if end is not None:
                plan.forward_len = len(groups.collapse(plan.order[:end], state.groups))
            plan.order = groups.collapse(plan.order, state.groups)
        if plan.agreed and not plan.diverged_recording:  # [Note: a dict of like modules]
            formed = state.groups or {}
            plan.order, plan.forward_len = fill_siblings(
                plan.order, state.module, plan.forward_len, lists=False,
                expand=lambda m: formed[id(m)].members if id(m) in formed else (m, ))

    def open_group_of(self, module):
        """The open group `module` is the owner or a member of, or None."""
        group = self._covered.get(id(module))
        if group is None and self.state.groups:
            group = self.state.groups.get(id(module))
        return group if group is not None and group.open else None

    def _open(self, group, unit):
        """The owner's forward fetched the group: its members are covered, and a grad-enabled forward
        decides now whether the group will be held or claimed whole, or each member is held or takes
        its own backward claim ([Note: hold for backward], [Note: group claims])."""
        group.open = True
        self._covered.update(dict.fromkeys(group.member_ids, group))
        claims_ = MemberClaims.NONE
        if not torch.is_grad_enabled():
            pass
        elif in_backward():
            if not self.backward_claims.held_by_graph(group.owner):
                claims_ = MemberClaims.RECOMPUTE
        elif unit.numel > self._group_claim_max and not self._holds(self.backward_claims.open, id(group.owner),
                                                                     unit.numel):
            claims_ = MemberClaims.FORWARD
        group.member_claims = claims_
        lifted = self.resident.lifted
        if claims_ is MemberClaims.NONE and lifted is not None and not self.state.compiled:
            lifted.lift_members(group, torch.is_grad_enabled())  # [Note: member hooks] in lifted.py
            if self._noting:
                for module in lifted.modules(group):
                    self.resident.seen(module)
        elif group.lifted:  # kept from a forward before ([Note: kept lift] in lifted.py): each member's hooks decide
            lifted.restore_members(group)

    def _holds(self, g, key, numel) -> bool:
        """Whether the open graph `g` (None: none yet) holds, or would hold, a unit of `numel` elements
        of module `key` ([Note: hold for backward])."""
        if not self._hold_enabled:
            return False
        if g is not None and key in g.held:
            return True
        held_numel = g.held_numel if g is not None else 0
        return self.state.engine.live_numel <= self._max_live and held_numel + numel <= self._hold_max

    def _close(self, group):
        group.open = False
        for key in group.member_ids:
            self._covered.pop(key, None)
        if group.lifted or group.lifted_dicts:
            self.resident.lifted.close_members(group)

    def close_all_groups(self, keep=False):
        """Every group closed (one an abandoned forward left open), its members' hooks back; with `keep`, a kept
        lift stays ([Note: kept lift] in lifted.py)."""
        self._covered.clear()
        for group in self.state.groups.values():
            if keep and not group.open:
                continue
            group.open = False
            if group.lifted or group.lifted_dicts:
                if keep:
                    self.resident.lifted.close_members(group)
                else:
                    self.resident.lifted.restore_members(group)

    def _warn_divergence(self):
        plan, n = self.plan, self._warn_every
        if not n or plan.divergence is None:
            return
        if self._last_warning is not None and self._forwards - self._last_warning < n:
            return
        self._last_warning = self._forwards
        d = plan.divergence
        logger.warning(f"z3ext: a forward left the recorded module order at position {d.position} (expected "
                       f"{d.expected}, got {d.got}); prefetch was reduced for that forward and the plan now "
                       f"follows the new order ({plan.diverged_forwards} diverged forwards so far; this warning "
                       f"repeats at most once per {n} forwards: z3ext.plan_warning_steps)")

    def fetch_sub_module(self, sub_module, forward):
        state = self.state
        if not forward:
            state.engine.unshard(state.unit_for(sub_module), self._bwd, sub_module.ds_id)
            return
        self.running.append(sub_module)
        if self._noting:
            self.resident.seen(sub_module)
        if self._covered and id(sub_module) in self._covered:
            if not torch.is_grad_enabled():  # [Note: presence behind a reentrant checkpoint] in grads.py
                self.plan.members_without_grad.append(sub_module)
            return  # its group's owner fetched it ([Note: fetch groups])
        plan = self.plan
        if plan.recording:
            plan.enter(sub_module)
        unit = state.unit_for(sub_module)
        if not len(unit):
            # A module without parameters (the root, a block) starts the window when nothing is
            # ahead: prefetch begins before the first module with parameters.
            if self.window.enabled and self.window.empty() and plan.cursor < len(plan.order):
                self._prefetch(plan.cursor)
            return
        if self._recording_together and forward_phase() is Phase.FORWARD:
            self._record_together(sub_module.ds_id)
        elif self._walking:
            c = plan.cursor
            if c < len(plan.order) and plan.order[c] is not sub_module and forward_phase() is Phase.FORWARD:
                p = plan.ahead(sub_module)
                if p is not None:
                    self._walk_forward(p)
        pos = plan.observe(sub_module)
        state.engine.unshard(unit, self._fwd, sub_module.ds_id)
        if state.groups:
            group = state.groups.get(id(sub_module))
            if group is not None:
                self._open(group, unit)
        if pos is not None and self.window.enabled:
            self._prefetch(pos)

    # -- [Note: forwards that differ by rank] ---------------------------------------------------------
    def _record_together(self, ds_id, param_id=-1):
        """Before this rank's fetch of module `ds_id` (`_END`: this rank's forward is over; with `param_id`: its
        discovery of that parameter as an external of the module) in a forward recorded together: the ranks
        exchange what each does next, and in which grad mode ([Note: skipped with the runner's grad mode]); the
        smallest (ds_id, parameter) asked for is served (the ranks that asked for another gather it as a skipped
        module, or as that module's new external) until this rank's own is."""
        agreement, plan = self.state.agreement, self.plan
        mine = (ds_id, param_id)
        grad_enabled = int(torch.is_grad_enabled())
        while True:
            rows = agreement.all_gather([*mine, grad_enabled], kind=11)
            served = min((r[0], r[1]) for r in rows)
            if served == mine or served[0] == _END:
                self._end_skipped()
                return
            plan.diverged_recording = True
            if self._by_ds_id is None:
                self._by_ds_id = {m.ds_id: m for m in self.state.module.modules() if hasattr(m, "ds_id")}
            module = self._by_ds_id[served[0]]
            if served[1] >= 0:
                self._discovered_elsewhere(module, served[1])
                continue
            ran_with_grad = any(r[2] for r in rows if (r[0], r[1]) == served)
            plan.observe(module, ran_with_grad)
            self._skipped(module, None, ran_with_grad)

    def discover_together(self, module, param) -> bool:
        """[Note: discoveries recorded together] A parameter read in the forward of a module that does not own it
        (PEFT's LoRA layer reads `lora_A.weight` before calling `lora_A`) is gathered at once ([Note: external
        discovery] in external.py), outside any module's fetch: in a forward recorded together, a rank that skips the
        module would not gather it. So the discovery goes through the exchange too, and the ranks that skip the
        module make the parameter its external as well, gathered with it and released with it: the module's unit,
        and with it every later gather, is the same on every rank. Whether it was gathered so."""
        if not self._recording_together or forward_phase() is not Phase.FORWARD:
            return False
        self._record_together(module.ds_id, param.ds_id)
        self.state.discover_external(module, param)
        return True

    def _discovered_elsewhere(self, module, ds_id):
        """Another rank discovered parameter `ds_id` in `module`'s forward ([Note: discoveries recorded together]):
        the modules skipped inside it are released first, as that rank's forwards of them have ended."""
        self._end_skipped(module, keep=True)
        skipping = self._skipping
        param = self._params_by_ds_id()[ds_id]
        external = getattr(module, "_external_params", None)
        if external is None or id(param) not in external:
            register_external_parameter(module, param)
        self.state.discover_external(module, param)
        if skipping and skipping[-1][0] is module:  # released with the module's unit, the parameter in it now
            skipping[-1] = (module, self.state.unit_for(module), *skipping[-1][2:])

    # [Note: a dict of like modules] A task's head in an `nn.ModuleDict` of like heads that no rank ran in the forward
    # the ranks recorded together (every rank's first batch was another task's) may be chosen by some ranks only at a
    # later batch. So every agreed plan, not only one whose ranks ran different modules, holds the members of such a
    # dict that did not run, placed by analogy with one that ran (`fill_siblings`, dicts only: a list of layers of
    # which a uniform program runs a prefix would pay for the rest): every rank gathers each head in each forward of
    # that grad mode (and walks it in backward), and the ranks that do not run it reduce zeros for it, DDP's numbers
    # with nothing declared. The cost is one unit per such head and forward, also where every rank always runs the
    # same one; a dict inside a fetch group is not filled (its members are no positions of the plan).
    # [Note: a module off the plan] A module that no rank ran in the forward the ranks recorded together (a tower
    # first fed at a later batch, a head that is a plain attribute) is in no plan, and no sibling's position tells
    # where it would be (`fill_siblings`). Where every rank runs it, the plan follows the new order; where some ranks
    # do, the others cannot know: nothing is exchanged in a walked forward (that is what makes it cheap), and
    # exchanging before every fetch of every forward while some module has never run (an unused pooler, a tower no
    # batch feeds) would cost every such program a host exchange per module. So the ranks' collectives differ and
    # every rank raises (`agree_before_collectives` on gloo, the hang watchdog on NCCL), and the error names the
    # module, that no rank ran it in the recorded forward, and what trains it: declared in `conditional_modules` it
    # is gathered with its parent on every rank.
    def unplanned(self, ds_id) -> Optional[str]:
        """The name of the module owning parameter `ds_id` where the forwards are walked and it is in no position of
        the plan (nor a member of a planned fetch group); else None."""
        plan = self.plan
        if not plan.agreed or plan.recording:
            return None
        module = self._owners().get(ds_id)
        if module is None:
            return None
        planned = {id(m) for p in self.plans.values() for m in p.order}
        for group in (self.state.groups or {}).values():
            if id(group.owner) in planned:
                planned.update(group.member_ids)
        if id(module) in planned:
            return None
        return next((n for n, m in self.state.module.named_modules() if m is module), type(module).__name__)

    def _walk_forward(self, stop):
        """Plan positions from the cursor to `stop` that this rank's forward skips: each gathered (or passed in
        the window) and released as if its module had run."""
        plan, grad_enabled = self.plan, torch.is_grad_enabled()
        while plan.cursor < stop:
            module = plan.order[plan.cursor]
            ran_with_grad = plan.grad_modes.get(id(module), grad_enabled)
            self._skipped(module, plan.observe(module, ran_with_grad), ran_with_grad)
        self._end_skipped()

    # [Note: skipped with the runner's grad mode] A skipped module is released as a rank that ran it decides, and
    # that rank's grad mode decides whether its call has a backward: a module run with grad mode off (a frozen
    # teacher under `torch.no_grad()`, a reentrant checkpoint's first forward) is released, neither held nor walked.
    # The skipping rank learns of the skip at its own next fetch, where its grad mode may differ (a no_grad block over,
    # or begun: the next module it runs is the teacher). So the exchange of a forward recorded together carries each
    # rank's grad mode, and a walked forward takes it from the plan: the mode its recorded forward ran the module in
    # (`ForwardPlan.grad_modes`; a module run in both modes, or not recorded, takes the mode of the skip).
    def _skipped(self, module, pos, grad_enabled):
        """`module` is gathered for a forward this rank does not run (`pos`: the plan position after it), then
        released, or held for backward, or recorded for backward's walk, as its forward's end would decide on
        a rank that ran it (in grad mode `grad_enabled`: [Note: skipped with the runner's grad mode]), so that every
        rank's budgets, holds and backward gathers stay the same. A module's forward ends after those of the modules
        it calls: a skipped module's release waits for its descendants skipped after it (`_end_skipped`), as the
        backward walk's order follows the forwards' ends."""
        self._end_skipped(module)
        self.plan.skip_last()
        if self._noting:
            self.resident.seen(module)
        unit = self.state.unit_for(module, checked=False)
        if not len(unit):
            return
        self.state.engine.unshard(unit, self._fwd, module.ds_id)
        if pos is not None and self.window.enabled:
            self._prefetch(pos)
        below = self._descendants.get(id(module))
        if below is None:
            below = self._descendants[id(module)] = frozenset(id(m) for m in module.modules() if m is not module)
        self._skipping.append((module, unit, below, grad_enabled))

    def _end_skipped(self, within=None, keep=False):
        """Releases the skipped modules waiting for their descendants, innermost first, down to an ancestor of
        `within` (all of them without one; `keep`: down to `within` itself too)."""
        skipping = self._skipping
        while skipping and (within is None or id(within) not in skipping[-1][2]) and not (
                keep and skipping[-1][0] is within):
            module, unit, _, grad_enabled = skipping.pop()
            self._release_skipped(module, unit, grad_enabled)

    def _release_skipped(self, module, unit, grad_enabled):
        engine = self.state.engine
        if not grad_enabled or not self._follows_trainable(module):
            # No backward ([Note: outputs that need a gradient]): nothing held or claimed; in a generation step,
            # resident as on a rank that ran it ([Note: generation residency])
            if self._noting:
                self.resident.keep(id(module), unit)
            engine.reshard(unit, self._fwd, module.ds_id, also_direct=True)
            return
        group = self.state.groups.get(id(module)) if self.state.groups else None
        if group is not None and unit.numel > self._group_claim_max and not self._holds(
                self.backward_claims.open, id(module), unit.numel):
            for member in group.members:  # [Note: group claims]: each member held or gathered again alone
                self._held_as_if(member, self.state.unit_for(member, checked=False))
        else:
            self._held_as_if(module, unit)
        engine.reshard(unit, self._fwd, module.ds_id, also_direct=True)

    def _params_by_ds_id(self):
        by_id = self._param_by_ds_id
        if by_id is None:
            by_id = self._param_by_ds_id = {p.ds_id: p for p in self.state.params}
        return by_id

    def _trainable(self, unit) -> bool:
        by_id = self._params_by_ds_id()
        return any(by_id[h.ds_id].requires_grad for h in unit.handles if h.ds_id in by_id)

    def _follows_trainable(self, module) -> bool:
        """[Note: outputs that need a gradient] In a forward recorded together or walked."""
        return self.plan.follows(module, self._trainable_module)

    def _trainable_module(self, module) -> bool:
        return self._trainable(self.state.unit_for(module, checked=False))

    def _held_as_if(self, module, unit):
        if len(unit) and not self._held(module, unit):
            self._released(module)

    def _prefetch(self, pos):
        """Gathers the next plan positions ahead of their modules ([Note: prefetch window])."""
        window, engine = self.window, self.state.engine
        if not window.reach(pos):
            return
        batch = window.next_batch(self.plan.order, self._unit_ahead, self._max_live - engine.live_numel,
                                  skip_gathered=self.resident.numel > 0)
        if batch is None:
            return
        window.commit(batch)
        # One call: each unit claimed for its module's forward, all gathered in one collective.
        engine.unshard_batch(batch.units, self._fwd, batch.owners, True)

    def release_sub_module(self, sub_module, grad_enabled=False, args=(), outputs=(), raised=False):
        """End of a module's forward (also one that raised, or that checkpoint recomputation stopped
        early): its Forward claim is dropped or becomes a Backward claim ([Note: graph claims]).
        `args`/`outputs`: the tensors of its inputs and outputs, any nesting already walked."""
        running = self.running
        if running and running[-1] is sub_module:
            running.pop()
        else:
            self._pop_running(sub_module)
        state = self.state
        if self._covered:
            group = self._covered.get(id(sub_module))
            if group is not None:  # a member of an open group ([Note: fetch groups])
                mode = group.member_claims
                if mode is not MemberClaims.NONE and grad_enabled and not raised and _needs_grad(outputs):
                    unit = state.unit_for(sub_module, checked=False)
                    if mode is MemberClaims.FORWARD:
                        self._hold_or_claim(sub_module, unit, args, outputs)
                    else:
                        self._claim_recomputed(sub_module, unit, args, outputs)
                return
        phase = forward_phase()
        outermost = not running and phase is Phase.FORWARD
        if outermost and not raised:
            # The positions this rank skipped are passed before the outermost module's own release: a module's
            # forward ends after those of the modules it calls, and the backward walk's order follows the forwards'
            # ends. A root with parameters of its own (a position table, a declared conditional module's, an
            # external) was a walk position before them on a rank that skipped the last modules, after them on the
            # others ([Note: forwards that differ by rank]).
            plan = self.plan
            if self._recording_together:
                self._record_together(_END)
            elif self._walking and plan.divergence is None and plan.forward_len is not None and \
                    plan.cursor < plan.forward_len:
                self._walk_forward(plan.forward_len)  # (not after a module off the plan: another kind of forward)
        if self.plan.recording:
            self.plan.leave(sub_module)
        group = state.groups.get(id(sub_module)) if state.groups else None
        if group is not None and group.open:
            self._close(group)
            unit = state.unit_for(sub_module, checked=group.dirty)
        else:
            group = None
            unit = state.unit_for(sub_module)  # checked: an external discovered in this forward joins
        if len(unit):
            if not grad_enabled or raised or not (_needs_grad(outputs) or (
                    (self._walking or self._recording_together) and phase is Phase.FORWARD and
                    self._follows_trainable(sub_module))):
                # No output needs grad (or no grad, or it raised): its backward cannot run
                # ([Note: outputs that need a gradient]: nor on another rank).
                if self._noting and not grad_enabled and not raised:
                    self.resident.keep(id(sub_module), unit)  # [Note: generation residency]
                state.engine.reshard(unit, self._fwd, sub_module.ds_id, also_direct=True)
            elif group is not None and group.member_claims is not MemberClaims.NONE:  # each member has its own
                state.engine.reshard(unit, self._fwd, sub_module.ds_id, also_direct=True)
            elif phase is Phase.RECOMPUTE:
                self._recomputed(sub_module, unit, args, outputs)
            else:
                self._hold_or_claim(sub_module, unit, args, outputs)
                state.engine.reshard(unit, self._fwd, sub_module.ds_id, also_direct=True)
        if outermost:
            plan = self.plan
            plan.end_forward()
            nodes = _grad_nodes(outputs) if not raised else ()
            self.backward_claims.seal(nodes)
            if self.backward_window.order:  # a rank whose backward fetches none of them walks them too
                for node in nodes:
                    node.register_prehook(self._walk_hook)
            else:  # [Note: presence behind a reentrant checkpoint] in grads.py
                for node in nodes:
                    node.register_prehook(self._reentrant_hook)
            if self._noting:
                self._noting = False
                self.resident.end_forward()

    def _hold_or_claim(self, module, unit, args, outputs):
        """The gathered `unit` of a grad-enabled call of `module` is held for the graph's backward, or
        the call takes a claim that gathers it again for its backward."""
        if not self._held(module, unit):
            claim_per_call(self, module, self.backward_claims.new_token(), args, outputs, gathered=False)
            self._released(module)

    def _held(self, module, unit) -> bool:
        """Whether the open graph holds `unit` of `module` for backward, within the budgets (taking the hold)."""
        if not self._hold_enabled:
            return False
        g, key = self.backward_claims.open or self.backward_claims.graph(), id(module)
        if not self._holds(g, key, unit.numel):
            return False
        self.state.engine.unshard(unit, self._bwd, g.token)  # already gathered: adds the claim only
        self._mark(module)
        if key not in g.held:
            g.held.add(key)
            g.held_numel += unit.numel
        return True

    def _released(self, module):
        """`module`'s call is gathered again for its backward: a position of the backward walk."""
        self._mark(module)
        self.backward_window.released(module)

    def _mark(self, module):
        """[Note: reductions on the walk] in window.py: the positions released before `module`'s first hold or
        release in this forward (the lowest of a module applied twice)."""
        if self._walking or self._recording_together:
            self._walk_marks.setdefault(id(module), len(self.backward_window.order))

    def _recomputed(self, module, unit, args, outputs):
        """A forward inside a backward pass (activation-checkpoint recomputation): the module stays
        gathered under a claim of this call, whatever `hold_for_backward` and the live budget say.
        Non-reentrant checkpointing compares the recomputed saved tensors (parameters included) with
        the original ones when backward unpacks them, later in the pass: released parameters there
        fail its metadata check. Reentrant checkpointing backpropagates the recomputed graph at once:
        the module's input hooks drop the claim after its backward; otherwise the pass's end does.
        A module a graph already holds (non-reentrant, held in the original forward) needs nothing."""
        self._claim_recomputed(module, unit, args, outputs)
        self.state.engine.reshard(unit, self._fwd, module.ds_id, also_direct=True)

    def _claim_recomputed(self, module, unit, args, outputs):
        graphs = self.backward_claims
        if not graphs.held_by_graph(module):
            token = graphs.new_token()
            self.state.engine.unshard(unit, self._bwd, token)
            graphs.on_pass_end(token)
            claim_per_call(self, module, token, args, outputs, gathered=True)

    def fetch_for_backward(self, module, token):
        """A module that was not held: its backward is about to run (tensor hook on its outputs). The
        positions above it are passed and the modules before it gathered ahead ([Note: backward prefetch],
        [Note: backward walk])."""
        engine, window = self.state.engine, self.backward_window
        pos = window.position(module)
        if pos is not None:
            self.start_backward_walk()
            if pos + 1 < window.walked:
                self._walk(pos + 1)
        engine.unshard(self.state.unit_for(module), self._bwd, token)
        self.backward_claims.on_pass_end(token)
        if pos is None:
            return
        ahead = window.reach(pos)
        if ahead is not None:  # its own claim holds it now
            engine.reshard(ahead.unit, self._bwd, ahead.token, also_direct=False)
        self._refill_backward()

    def start_backward_walk(self):
        """A backward pass reaches this forward's released modules (a module's fetch, or the forward's
        outputs): the pass's end passes the positions it did not reach ([Note: backward walk])."""
        window = self.backward_window
        if not window.order:
            return
        task = torch._C._current_graph_task_id()
        if task < 0 or task == window.walk_task:
            return
        window.walk_task = task
        window.start()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_walk)
        reducer = self._reducer()
        if reducer is not None:  # [Note: presence agreed] in grads.py
            unneeded = reducer.agree_presence(window.order, self._unit_ahead)
            window.skip = frozenset(i for i, u in enumerate(unneeded) if u)

    def _reducer(self):
        ref = self.state.optimizer
        optimizer = ref() if ref is not None else None
        if optimizer is None:
            return None
        return reducer_of(optimizer)

    def _walk_hook(self, grad_outputs):
        self.start_backward_walk()

    def _reentrant_hook(self, grad_outputs):
        reducer = self._reducer()
        if reducer is not None and torch._C._current_graph_task_id() >= 0:
            reducer.agree_reentrant()

    def _owners(self):
        """ds_id -> the module owning the parameter (made once per root)."""
        owner = self._owner_of
        if owner is None or owner[0] is not self.state.module:
            owner = self._owner_of = (self.state.module, {p.ds_id: m for m in self.state.module.modules()
                                                          for p in m.parameters(recurse=False) if hasattr(p, "ds_id")})
        return owner[1]

    def walk_above(self, params):
        """Before a walked pass reduces the bucket of `params`: the walk passes the positions above their modules
        ([Note: reductions on the walk] in window.py)."""
        window = self.backward_window
        if not window.walked:
            return
        owner = self._owners()
        marks, stop = self._walk_marks, None
        for p in params:
            module = owner.get(p.ds_id)
            if module is None:
                continue
            k = marks.get(id(module))
            if k is not None and (stop is None or k < stop):
                stop = k
        if stop is not None and stop < window.walked:
            self._walk(stop)
            self._refill_backward()

    def _end_backward_walk(self):
        window = self.backward_window
        if window.walked:
            self._walk(0)
        self._drop_passed()
        window.walk_task = None
        reducer = self._reducer()
        if reducer is not None:
            reducer.finish_walk()

    def _abandon_walk(self):
        """[Note: a walk that raised] A backward pass that raised stops where the error left each rank, and where
        the ranks ran different modules that is not the same walk position: a rank that ran a module fetched it
        before the error, one that skipped it would have passed it later. So the next outermost forward first
        passes what the raised walk did not reach, as its end would have, on every rank that walked it: the
        same gathers in the same order everywhere, each released at once (the pass's claims end after)."""
        if self.backward_window.walked:
            self._walk(0)
        self._drop_passed()

    def _walk(self, stop):
        """Passes the positions from the walk's down to `stop`, each as if its module were fetched there."""
        engine, window, claims_ = self.state.engine, self.backward_window, self.backward_claims
        for q in range(window.walked - 1, stop - 1, -1):
            if q in window.skip:
                continue
            ahead = window.reach(q)
            if ahead is not None:
                window.passed.append((ahead.unit, ahead.token))
            else:
                unit, t = self._unit_ahead(window.order[q]), claims_.new_token()
                engine.unshard(unit, self._bwd, t)
                claims_.on_pass_end(t)
                window.passed.append((unit, t))
            self._refill_backward()

    def _refill_backward(self):
        """The window refilled after a position was reached, then the claims of positions passed dropped
        ([Note: backward walk])."""
        engine, window = self.state.engine, self.backward_window
        if window.enabled:
            batch = window.next_batch(self._unit_ahead, self._max_live - engine.live_numel)
            if batch is not None:
                positions, units = batch
                ahead_token = self.backward_claims.new_token()
                self.backward_claims.on_pass_end(ahead_token)
                window.commit(positions, units, ahead_token)
                engine.unshard_batch(units, self._bwd, [ahead_token] * len(units), True)
        self._drop_passed()

    def _drop_passed(self):
        passed = self.backward_window.passed
        if passed:
            engine = self.state.engine
            for unit, t in passed:
                engine.reshard(unit, self._bwd, t, also_direct=False)
            passed.clear()

    def release_for_backward(self, module, token):
        """Its inputs' gradients are complete: its backward has run."""
        self.state.engine.reshard(self.state.unit_for(module), self._bwd, token, also_direct=True)

    def _pop_running(self, module):
        # Pops `module` and anything above it: an inner forward that raised, or a recomputation that
        # torch.utils.checkpoint stopped early, never reached its post-forward hook.
        running = self.running
        for i in range(len(running) - 1, -1, -1):
            if running[i] is module:
                del running[i:]
                return

    @contextlib.contextmanager
    def optimizer_step(self):
        """The stage-3 optimizer's step runs inside (seams.py): its release of everything keeps the
        persistent parameters gathered ([Note: persistent refresh] in csrc/engine.h)."""
        check = self.state.schedule_check
        if check is not None:
            check.check("at the optimizer step")  # [Note: schedule check] in schedule.py
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def release_and_reset_all(self, module):
        """Optimizer step, checkpoint, emptied partition cache: everything but live GatheredParameters
        blocks is released (the step rewrites partitions: a full parameter kept across it would be
        stale); in the step, persistent parameters stay gathered and are re-gathered in place by their
        next claim."""
        self.resident.forget()  # the sweep drops Resident claims too
        if self._in_step:
            self.state.engine.sweep_step(claims.STEP_KINDS)  # [Note: persistent refresh] in csrc/engine.h
        else:
            self.state.engine.sweep(claims.RESET_KINDS)
        self.backward_claims.forget_all()
        if self.state.config.leak_check:
            self.state.check_leaks("at the optimizer step")

    def release_resident(self):
        """Generation is over ([Note: generation residency] in resident_set.py): resident units are released."""
        self.resident.release()

    def release_backward_leftovers(self):
        """DeepSpeed's end-of-backward epilogue (every rank's backward ends here). Backward claims end with
        their graph or pass ([Note: graph claims]), which may outlive this backward; graphs freed on every
        rank are dropped, by a vote while any is sealed ([Note: one schedule on every rank] in schedule.py)."""
        self.backward_claims.collect()


def _needs_grad(outputs) -> bool:
    """Whether any of a module call's output tensors needs a gradient (most have one output: no generator)."""
    return outputs[0].requires_grad if len(outputs) == 1 else any(t.requires_grad for t in outputs)


def _clean_module_stack():
    """DeepSpeed's forward module stack is process-global; a module whose forward raised never
    popped itself. Between outermost forwards it must hold only engine roots (ds_id 0), once each."""
    stack, seen, clean = private.forward_module_stack(), set(), []
    for m in stack:
        if getattr(m, "ds_id", None) == 0 and id(m) not in seen:
            seen.add(id(m))
            clean.append(m)
    if len(clean) != len(stack):
        stack[:] = clean
