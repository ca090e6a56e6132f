"""Z3extCoordinator: module-driven fetch and release through claims.

It stands in for DeepSpeed's PartitionedParameterCoordinator behind the same interface, so
DeepSpeed's own module hooks (and the stage-3 optimizer) drive it unchanged. Each module's
parameters form one fetch unit: one C++ call claims and gathers it, one call releases it.
"""
from collections import deque

import torch
from deepspeed.utils import logger

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext import claims
from deepspeed_z3ext.graphs import BackwardClaims, claim_per_call, grad_nodes as _grad_nodes, in_backward
from deepspeed_z3ext.plan import ForwardPlan


class Z3extCoordinator:

    def __init__(self, state, max_live_numel, prefetch_bucket_numel, hold_for_backward=True):
        self.state = state
        self.plans = {True: ForwardPlan(), False: ForwardPlan()}  # by grad mode, see [Note: forward plan]
        self.plan = self.plans[True]
        self.bucket_numel = prefetch_bucket_numel
        self.hierarchy = 0  # read and written by the stage-3 optimizer
        # [Note: hold for backward] Autograd's use of a module's parameters in backward is a claim:
        # at the end of a grad-enabled forward whose outputs need grad, the module's Forward claim
        # becomes a Backward claim of the autograd graph of this forward call ([Note: graph claims]
        # in graphs.py), so backward (and a GatheredParameters block or another forward between
        # forward and backward) needs no re-gather. A unit is held only while the elements of all
        # gathered buffers (not just of held units: a held parameter keeps its whole coalesced buffer
        # alive) are within stage3_max_live_parameters; past it, it is released as stock does and
        # tensor hooks gather it again for its backward, under a claim of that one call.
        self._hold_enabled = hold_for_backward
        self._max_live = max_live_numel
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
        self._fwd, self._bwd = claims.FORWARD, claims.BACKWARD
        self.backward_claims = BackwardClaims(state.engine)

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

    def reset_step(self):
        """Start of an outermost forward: Forward and Direct claims an abandoned forward left are
        released, and Backward claims whose graph or pass is over ([Note: graph claims]); the module
        stack an exception inside a forward left dirty is cleaned."""
        self.backward_claims.start_forward()
        self.state.engine.sweep(claims.FORWARD_START_KINDS)
        if not in_backward():
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
            # A module without parameters (the root, a block) starts the window when nothing is
            # ahead: prefetch begins before the first module with parameters.
            if self.bucket_numel > 0 and not self._ahead and self.plan.cursor < len(self.plan.order):
                self._prefetch(self.plan.cursor)
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
            unit = state.unit_for(order[i], checked=False)
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

    def release_sub_module(self, sub_module, grad_enabled=False, args=(), outputs=(), raised=False):
        """End of a module's forward (also one that raised, or that checkpoint recomputation stopped
        early): its Forward claim is dropped or becomes a Backward claim ([Note: graph claims]).
        `args`/`outputs`: the tensors of its inputs and outputs, any nesting already walked."""
        self._pop_running(sub_module)
        unit = self.state.unit_for(sub_module)  # checked: an external discovered in this forward joins
        recomputing = in_backward()
        if len(unit):
            if grad_enabled and not raised and any(t.requires_grad for t in outputs):
                if recomputing:
                    self._recomputed(sub_module, unit, args, outputs)
                else:
                    self._hold(sub_module, unit, args, outputs)
            else:
                # No output needs grad (or no grad, or it raised): its backward cannot run.
                self.state.engine.reshard(unit, self._fwd, sub_module.ds_id, also_direct=True)
        if not self._running and not recomputing:
            self.backward_claims.seal(_grad_nodes(outputs) if not raised else ())

    def _hold(self, module, unit, args, outputs):
        engine, owner, claims = self.state.engine, module.ds_id, self.backward_claims
        if self._hold_enabled:
            g = claims.graph()
            if id(module) in g.held or engine.live_numel <= self._max_live:
                engine.unshard(unit, self._bwd, g.token)  # already gathered: adds the claim only
                g.held.add(id(module))
                engine.reshard(unit, self._fwd, owner, also_direct=True)
                return
        engine.reshard(unit, self._fwd, owner, also_direct=True)
        claim_per_call(self, module, claims.new_token(), args, outputs, gathered=False)

    def _recomputed(self, module, unit, args, outputs):
        """A forward inside a backward pass (activation-checkpoint recomputation): the module stays
        gathered under a claim of this call, whatever `hold_for_backward` and the live budget say.
        Non-reentrant checkpointing compares the recomputed saved tensors (parameters included) with
        the original ones when backward unpacks them, later in the pass: released parameters there
        fail its metadata check. Reentrant checkpointing backpropagates the recomputed graph at once:
        the module's input hooks drop the claim after its backward; otherwise the pass's end does.
        A module a graph already holds (non-reentrant, held in the original forward) needs nothing."""
        engine, claims = self.state.engine, self.backward_claims
        if not claims.held_by_graph(module):
            token = claims.new_token()
            engine.unshard(unit, self._bwd, token)
            claims.on_pass_end(token)
            claim_per_call(self, module, token, args, outputs, gathered=True)
        engine.reshard(unit, self._fwd, module.ds_id, also_direct=True)

    def fetch_for_backward(self, module, token):
        """A module that was not held: its backward is about to run (tensor hook on its outputs)."""
        self.state.engine.unshard(self.state.unit_for(module), self._bwd, token)
        self.backward_claims.on_pass_end(token)

    def release_for_backward(self, module, token):
        """Its inputs' gradients are complete: its backward has run."""
        self.state.engine.reshard(self.state.unit_for(module), self._bwd, token, also_direct=True)

    def _pop_running(self, module):
        # Pops `module` and anything above it: an inner forward that raised, or a recomputation that
        # torch.utils.checkpoint stopped early, never reached its post-forward hook.
        running = self._running
        for i in range(len(running) - 1, -1, -1):
            if running[i] is module:
                del running[i:]
                return

    def release_and_reset_all(self, module):
        """Optimizer step or checkpoint: everything but live GatheredParameters blocks is released
        (the step rewrites partitions: a full parameter kept across it would be stale)."""
        self.state.engine.sweep(claims.STEP_KINDS)
        self.backward_claims.forget_all()
        if self.state.config.leak_check:
            self.state.check_leaks("at the optimizer step")

    def release_backward_leftovers(self):
        """DeepSpeed's end-of-backward epilogue. Backward claims end with their graph or pass
        ([Note: graph claims]), which may outlive this backward; only freed graphs are dropped."""
        self.backward_claims.collect()


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
