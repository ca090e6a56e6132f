"""Z3extCoordinator: module-driven fetch and release through claims.

It stands in for DeepSpeed's PartitionedParameterCoordinator behind the same interface, so
DeepSpeed's own module hooks (and the stage-3 optimizer) drive it unchanged. Each module's
parameters form one fetch unit: one C++ call claims and gathers it, one call releases it.
"""
from deepspeed.runtime.zero import parameter_offload

from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.plan import ForwardPlan

# Owner of the transient claim that carries a coalesced prefetch until each module's own claim is in.
_PREFETCH_OWNER = -1


class Z3extCoordinator:

    def __init__(self, state, max_live_numel, prefetch_bucket_numel):
        self.state = state
        self.plan = ForwardPlan(prefetch_bucket_numel)  # see [Note: forward plan]
        self.hierarchy = 0  # read and written by the stage-3 optimizer
        # [Note: hold for backward] Autograd's use of a module's parameters in backward is a claim:
        # at the end of a grad-enabled forward the module's Forward claim becomes a Backward claim,
        # so backward (and a GatheredParameters block between forward and backward) needs no
        # re-gather. Held numel is bounded by stage3_max_live_parameters; past it, release as stock.
        self._hold = state.config.hold_for_backward
        self._max_held = max_live_numel
        self._held = {}  # module ds_id -> numel held for its backward
        self._held_numel = 0
        k = ops().ClaimKind
        self._fwd, self._bwd, self._direct = k.FORWARD, k.BACKWARD, k.DIRECT
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
    def _forget_held(self):
        self._held.clear()
        self._held_numel = 0

    def reset_step(self):
        """Start of an outermost forward: whatever an abandoned forward or backward left is released,
        and the module stack an exception inside a forward left dirty is cleaned."""
        self.state.engine.sweep(self._step_kinds)
        self._forget_held()
        _clean_module_stack()
        self.plan.start_forward()

    def fetch_sub_module(self, sub_module, forward):
        unit = self.state.unit_for(sub_module)
        if forward and len(unit):
            upcoming = self.plan.observe(sub_module)
            if upcoming and self.plan.bucket_numel > 0 and unit.partitioned:
                self._prefetch(unit, upcoming)
        self.state.engine.unshard(unit, self._fwd if forward else self._bwd, sub_module.ds_id)

    def _prefetch(self, unit, upcoming):
        """One collective for this unit and the next ones in the plan ([Note: forward plan])."""
        state, engine = self.state, self.state.engine
        batch, numel = [], unit.numel
        for m in upcoming:
            u = state.unit_for(m)
            if numel + u.numel > self.plan.bucket_numel:
                break
            batch.append((m, u))
            numel += u.numel
        if not batch:
            return
        combined = state.combine([unit] + [u for _, u in batch])
        engine.unshard(combined, self._direct, _PREFETCH_OWNER)
        for m, u in batch:
            engine.unshard(u, self._fwd, m.ds_id)  # already gathered: claims only
        engine.reshard(combined, self._direct, _PREFETCH_OWNER)

    def release_sub_module(self, sub_module, forward=False, grad_enabled=False):
        unit = self.state.unit_for(sub_module)
        engine, owner = self.state.engine, sub_module.ds_id
        if forward and self._hold and grad_enabled:
            numel = self._held.get(owner)
            if numel is None and self._held_numel + unit.numel <= self._max_held:
                engine.unshard(unit, self._bwd, owner)  # already gathered: moves the claim only
                self._held[owner] = numel = unit.numel
                self._held_numel += numel
            if numel is not None:
                engine.reshard(unit, self._fwd, owner, also_direct=True)
                return
        engine.reshard(unit, self._fwd if forward else self._bwd, owner, also_direct=True)
        if not forward:
            self._held_numel -= self._held.pop(owner, 0)

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
