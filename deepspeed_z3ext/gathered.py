"""GatheredParameters on z3ext parameters: a Gathered claim owned by the context.

[Note: gathered claims] The block claims its parameters strictly (an overlapping nested block is a
duplicate claim, an error naming the parameter) and drops the claim on exit, even when the body or the exit raises. A
parameter that a module or autograd also claims stays gathered after the block; one that only the
block claimed is released. With `modifier_rank`, that rank's values are broadcast and written back
into every rank's partition before the claim is dropped. Parameters of no z3ext engine take
DeepSpeed's own path.

[Note: blocks over several engines] One block may hold parameters of several engines and of stock
ZeRO-3 (TRL's reference-model sync gathers the policy's and the reference's parameters together, with
`modifier_rank=0`). The block's parameters are stock's list, sorted by ds_id (unique and increasing across
engines): they split into parts, one per z3ext engine in the order of its first parameter there, then the
stock parameters, which stock's own enter and exit handle. Every rank sees the same list, so every rank
gathers, writes back and releases the parts in the same order. Entering, a part that raises releases the
parts gathered before it; exiting, every part is written back and released, the first error raised after.
"""
from typing import List, NamedTuple, Optional

import deepspeed.comm as dist

from deepspeed_z3ext import claims
from deepspeed_z3ext.claims import ClaimError
from deepspeed_z3ext.state import of_param


# All blocks claim as one owner (SHARED_OWNER): overlapping blocks are then a duplicate claim (an error
# naming the parameter), as stock DeepSpeed forbids them too; disjoint nesting claims different parameters.

class _Part(NamedTuple):
    state: object  # the z3ext state of one engine
    params: list   # its parameters in the block, in ds_id order
    unit: object   # their FetchUnit


class _Split(NamedTuple):
    parts: List[_Part]   # z3ext engines' parameters ([Note: blocks over several engines])
    stock: list          # parameters of no z3ext engine


def _split(ctx) -> Optional[_Split]:
    """The block's parameters by owner; None when no z3ext engine owns any of them (stock's block)."""
    if not ctx.enabled:
        return None
    by_state, stock = {}, []
    for p in ctx.params:
        state = of_param(p)
        if state is None:
            stock.append(p)
        else:
            by_state.setdefault(id(state), (state, []))[1].append(p)
    if not by_state:
        return None
    return _Split([_Part(s, ps, s.unit_of(ps)) for s, ps in by_state.values()], stock)


def enter(stock_enter):
    """`GatheredParameters.__enter__` (seams.py): a Gathered claim for z3ext parameters."""

    def __enter__(self):
        split = _split(self)
        if split is None:
            return stock_enter(self)
        _enter(self, split, stock_enter)

    return __enter__


def exit(stock_exit):
    """`GatheredParameters.__exit__` (seams.py): write back (modifier_rank) and drop the claim."""

    def __exit__(self, *exc):
        split = getattr(self, "_z3ext_split", None)
        if split is None:
            return stock_exit(self, *exc)
        _exit(self, split, stock_exit, exc)

    return __exit__


def _with_params(ctx, params, call):
    """Runs stock's enter or exit on a subset of the block's parameters."""
    whole = ctx.params
    ctx.params = params
    try:
        return call()
    finally:
        ctx.params = whole


def _enter(self, split, stock_enter):
    for part in split.parts:
        problem = part.state.engine.conflict(part.unit, claims.GATHERED, claims.SHARED_OWNER, to_claim=True)
        if problem:
            raise ClaimError(problem + " (nested GatheredParameters blocks overlap on it)")
    done = []
    try:
        for part in split.parts:
            part.state.engine.unshard(part.unit, claims.GATHERED, claims.SHARED_OWNER)
            done.append(part)
        if split.stock:
            _with_params(self, split.stock, lambda: stock_enter(self))
    except BaseException:
        for part in done:
            part.state.engine.reshard(part.unit, claims.GATHERED, claims.SHARED_OWNER)
        raise
    self._z3ext_split = split


def _exit(self, split, stock_exit, exc):
    self._z3ext_split = None
    error = None
    for part in split.parts:
        try:
            if self.src_rank is not None:
                handles = [
                    dist.broadcast(p.data, self.src_rank_by_group[id(p.ds_process_group)], group=p.ds_process_group,
                                   async_op=True) for p in part.params
                ]
                for h in handles:
                    h.wait()
                part.state.engine.write_back(part.unit)
        except BaseException as e:
            error = error or e
        finally:
            problem = part.state.engine.conflict(part.unit, claims.GATHERED, claims.SHARED_OWNER, to_claim=False)
            if problem:
                error = error or ClaimError(problem)
            else:
                part.state.engine.reshard(part.unit, claims.GATHERED, claims.SHARED_OWNER)
    if split.stock:
        try:
            _with_params(self, split.stock, lambda: stock_exit(self, *exc))
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
