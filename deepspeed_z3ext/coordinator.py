"""Z3extCoordinator: module-driven fetch and release through claims.

It stands in for DeepSpeed's PartitionedParameterCoordinator behind the same interface, so
DeepSpeed's own module hooks (and the stage-3 optimizer) drive it unchanged. Each module's
parameters form one fetch unit: one C++ call claims and gathers it, one call releases it.
"""
from deepspeed_z3ext._ops import ops


class Z3extCoordinator:

    def __init__(self, state):
        self.state = state
        self.hierarchy = 0  # read and written by the stage-3 optimizer
        k = ops().ClaimKind
        self._fwd, self._bwd = k.FORWARD, k.BACKWARD
        # Every kind a new outermost forward or an optimizer step ends; Gathered blocks survive both.
        self._step_kinds = [k.FORWARD, k.BACKWARD, k.DIRECT, k.FALLBACK]
        self._all_but_gathered = self._step_kinds + [k.PERSIST]

    # -- trace interface: z3ext records no trace yet, so nothing is ever invalidated ----------------
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
    def reset_step(self):
        """Start of an outermost forward: whatever an abandoned forward or backward left is released."""
        if self.state.config.leak_check:
            self.state.check_leaks("before the next outermost forward")
        self.state.engine.sweep(self._step_kinds)

    def fetch_sub_module(self, sub_module, forward):
        self.state.engine.unshard(self.state.unit_for(sub_module), self._fwd if forward else self._bwd,
                                  sub_module.ds_id)

    def release_sub_module(self, sub_module, forward=False):
        self.state.engine.reshard(self.state.unit_for(sub_module), self._fwd if forward else self._bwd,
                                  sub_module.ds_id, also_direct=True)

    def release_and_reset_all(self, module):
        """Optimizer step or checkpoint: everything but live GatheredParameters blocks is released."""
        self.state.engine.sweep(self._all_but_gathered)

    def release_backward_leftovers(self):
        """End of backward: modules whose post-backward hook never fired (no-grad inputs)."""
        self.state.engine.sweep([self._bwd])
