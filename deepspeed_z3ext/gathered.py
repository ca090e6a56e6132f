"""GatheredParameters on z3ext parameters: a Gathered claim owned by the context.

[Note: gathered claims] The block claims its parameters strictly (an overlapping nested block is a
duplicate claim, an error naming the parameter) and drops the claim on exit, even when the body or the exit raises. A
parameter that a module or autograd also claims stays gathered after the block; one that only the
block claimed is released. With `modifier_rank`, that rank's values are broadcast and written back
into every rank's partition before the claim is dropped. Parameters of no z3ext engine take
DeepSpeed's own path.
"""
import deepspeed.comm as dist

from deepspeed_z3ext.claims import GATHERED, SHARED_OWNER, ClaimError
from deepspeed_z3ext.state import of_param


# All blocks claim as one owner (SHARED_OWNER): overlapping blocks are then a duplicate claim (an error
# naming the parameter), as stock DeepSpeed forbids them too; disjoint nesting claims different parameters.

def _split(ctx):
    """(z3ext state, its params) when the block's parameters all belong to one z3ext engine."""
    if not ctx.enabled:
        return None, None
    states = {id(s): s for s in map(of_param, ctx.params)}
    if len(states) != 1 or None in states.values():
        if any(s is not None for s in states.values()):
            raise RuntimeError("z3ext: a GatheredParameters block mixes parameters of different engines (or of "
                               "z3ext and stock ZeRO-3); gather them in separate blocks")
        return None, None
    return next(iter(states.values())), ctx.params


def enter(stock_enter):
    """`GatheredParameters.__enter__` (seams.py): a Gathered claim for z3ext parameters."""

    def __enter__(self):
        state, params = _split(self)
        if state is None:
            return stock_enter(self)
        _enter(self, state, params)

    return __enter__


def exit(stock_exit):
    """`GatheredParameters.__exit__` (seams.py): write back (modifier_rank) and drop the claim."""

    def __exit__(self, *exc):
        if getattr(self, "_z3ext_state", None) is None:
            return stock_exit(self, *exc)
        _exit(self)

    return __exit__


def _enter(self, state, params):
    unit = state.unit_of(params)
    problem = state.engine.conflict(unit, GATHERED, SHARED_OWNER, to_claim=True)
    if problem:
        raise ClaimError(problem + " (nested GatheredParameters blocks overlap on it)")
    self._z3ext_unit, self._z3ext_state = unit, state
    state.engine.unshard(unit, GATHERED, SHARED_OWNER)


def _exit(self):
    state = self._z3ext_state
    try:
        if self.src_rank is not None:
            handles = [
                dist.broadcast(p.data, self.src_rank_by_group[id(p.ds_process_group)], group=p.ds_process_group,
                               async_op=True) for p in self.params
            ]
            for h in handles:
                h.wait()
            state.engine.write_back(self._z3ext_unit)
    finally:
        self._z3ext_state = None
        problem = state.engine.conflict(self._z3ext_unit, GATHERED, SHARED_OWNER, to_claim=False)
        if problem:
            raise ClaimError(problem)
        state.engine.reshard(self._z3ext_unit, GATHERED, SHARED_OWNER)
