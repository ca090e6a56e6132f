"""Z3extCoordinator: module-driven fetch and release through claims.

It stands in for DeepSpeed's PartitionedParameterCoordinator behind the same interface, so
DeepSpeed's own module hooks (and the stage-3 optimizer) drive it unchanged. Each module's
parameters form one fetch unit: one C++ call claims and gathers it, one call releases it.
"""
from collections import deque

import torch
from deepspeed.runtime.zero import parameter_offload
from deepspeed.utils import logger

from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.plan import ForwardPlan


class Z3extCoordinator:

    def __init__(self, state, max_live_numel, prefetch_bucket_numel):
        self.state = state
        self.plans = {True: ForwardPlan(), False: ForwardPlan()}  # by grad mode, see [Note: forward plan]
        self.plan = self.plans[True]
        self.bucket_numel = prefetch_bucket_numel
        self.hierarchy = 0  # read and written by the stage-3 optimizer
        # [Note: hold for backward] Autograd's use of a module's parameters in backward is a claim:
        # at the end of a grad-enabled forward the module's Forward claim becomes a Backward claim,
        # so backward (and a GatheredParameters block between forward and backward) needs no
        # re-gather. A unit is held only while the elements of all gathered buffers (not just of
        # held units: a held parameter keeps its whole coalesced buffer alive) are within
        # stage3_max_live_parameters; past it, it is released as stock does.
        self._hold = state.config.hold_for_backward
        self._max_live = max_live_numel
        self._held = set()  # module ds_ids holding a Backward claim from their forward
        # [Note: prefetch window] Units of the next modules in the plan are gathered ahead, in one
        # collective per batch, claimed for those modules' forwards, without making the compute
        # stream wait ([Note: deferred wait]); the numel gathered ahead and not yet reached stays
        # within stage3_prefetch_bucket_size (and the engine's
        # live_numel + ahead within stage3_max_live_parameters). A unit larger than the window is
        # fetched by its module.
        self._ahead = deque()  # (plan position, numel) gathered ahead, not yet reached
        self._ahead_numel = 0
        self._frontier = 0     # plan positions before this one are gathered or passed
        self._running = []     # modules of this engine inside their forward (innermost last)
        self._warn_every = state.config.plan_warning_steps
        self._forwards = 0
        self._last_warning = None
        k = ops().ClaimKind
        self._fwd, self._bwd = k.FORWARD, k.BACKWARD
        # Every kind a new outermost forward or an optimizer step ends; Gathered blocks survive both.
        self._step_kinds = [k.FORWARD, k.BACKWARD, k.DIRECT, k.FALLBACK]
        self._all_but_gathered = self._step_kinds + [k.PERSIST]

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
    def running_module(self):
        """The innermost module of this engine running its forward (recomputation included)."""
        return self._running[-1] if self._running else None

    def _forget_held(self):
        self._held.clear()

    def reset_step(self):
        """Start of an outermost forward: whatever an abandoned forward or backward left is released,
        and the module stack an exception inside a forward left dirty is cleaned."""
        self.state.engine.sweep(self._step_kinds)
        self._forget_held()
        _clean_module_stack()
        self._running.clear()
        self._ahead.clear()
        self._ahead_numel = 0
        self._frontier = 0
        self._warn_divergence()
        self.plan = self.plans[torch.is_grad_enabled()]
        self.plan.start_forward()
        self._forwards += 1

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
        unit = state.unit_for(sub_module)
        if not forward:
            state.engine.unshard(unit, self._bwd, sub_module.ds_id)
            return
        self._running.append(sub_module)
        if not len(unit):
            return
        pos = self.plan.observe(sub_module)
        state.engine.unshard(unit, self._fwd, sub_module.ds_id)
        if pos is not None and self.bucket_numel > 0:
            self._prefetch(pos)

    def _prefetch(self, pos):
        """Gathers the next plan positions ahead of their modules ([Note: prefetch window])."""
        ahead = self._ahead
        while ahead and ahead[0][0] < pos:
            self._ahead_numel -= ahead.popleft()[1]
        self._frontier = max(self._frontier, pos)
        # Refill only once half the window has been reached: a full batch per collective (host time
        # per collective is what a host-bound forward pays), while the rest still overlaps compute.
        if self._ahead_numel * 2 > self.bucket_numel:
            return
        room = min(self.bucket_numel - self._ahead_numel, self._max_live - self.state.engine.live_numel)
        order, state = self.plan.order, self.state
        units, owners, taken, numel, i = [], [], [], 0, self._frontier
        while i < len(order):
            unit = state.unit_for(order[i])
            n = unit.numel  # a C++ loop over the unit's handles: read once
            if numel + n > room:
                break
            units.append(unit)
            owners.append(order[i].ds_id)
            taken.append((i, n))
            numel += n
            i += 1
        if not units:
            return
        # [Note: batch size] A batch under half the window, cut short by the window while two or more
        # units are still ahead, waits for a later module: the next module's unit is gathered and the
        # one after it still covers this batch's gather, so waiting costs no stall and saves a
        # collective (the GPT's blocks, 4 units of 4-17 M elements against a 5e7 window: 49 -> 34 per
        # forward). With fewer units ahead, or at the plan's end, the batch goes now.
        if numel * 2 < self.bucket_numel and len(ahead) >= 2 and i < len(order):
            return
        ahead.extend(taken)
        self._frontier = i
        # One call: each unit claimed for its module's forward, all gathered in one collective.
        state.engine.unshard_batch(units, self._fwd, owners, True)
        self._ahead_numel += numel

    def release_sub_module(self, sub_module, forward=False, grad_enabled=False):
        unit = self.state.unit_for(sub_module)
        engine, owner = self.state.engine, sub_module.ds_id
        if forward:
            self._pop_running(sub_module)
        if not len(unit):  # a module without parameters (a block, the root): nothing claimed
            return False
        if forward and self._hold and grad_enabled:
            held = owner in self._held
            if not held and engine.live_numel <= self._max_live:
                engine.unshard(unit, self._bwd, owner)  # already gathered: moves the claim only
                self._held.add(owner)
                held = True
            if held:
                engine.reshard(unit, self._fwd, owner, also_direct=True)
                return True
        engine.reshard(unit, self._fwd if forward else self._bwd, owner, also_direct=True)
        if not forward:
            self._held.discard(owner)
        return False

    def needs_backward_hooks(self, module):
        """A module released after a grad-enabled forward must fetch again for its backward."""
        return len(self.state.unit_for(module)) > 0

    def _pop_running(self, module):
        # Pops `module` and anything above it: an inner forward that raised, or a recomputation that
        # torch.utils.checkpoint stopped early, never reached its post-forward hook.
        running = self._running
        for i in range(len(running) - 1, -1, -1):
            if running[i] is module:
                del running[i:]
                return

    def release_and_reset_all(self, module):
        """Optimizer step or checkpoint: everything but live GatheredParameters blocks is released."""
        self.state.engine.sweep(self._all_but_gathered)
        self._forget_held()
        if self.state.config.leak_check:
            self.state.check_leaks("at the optimizer step")

    def release_backward_leftovers(self):
        """End of backward: modules whose post-backward hook never fired (no-grad inputs)."""
        self.state.engine.sweep([self._bwd])
        self._forget_held()


def _clean_module_stack():
    """DeepSpeed's forward module stack is process-global; a module whose forward raised never
    popped itself. Between outermost forwards it must hold only engine roots (ds_id 0), once each."""
    stack, seen, clean = parameter_offload.FWD_MODULE_STACK, set(), []
    for m in stack:
        if getattr(m, "ds_id", None) == 0 and id(m) not in seen:
            seen.add(id(m))
            clean.append(m)
    if len(clean) != len(stack):
        stack[:] = clean
