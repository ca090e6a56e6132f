"""`z3ext.leak_check`: at each optimizer step, parameters gathered without a claim, or released but still
referenced outside z3ext, raise `LeakError` on every rank.

[Note: a leak named on every rank] The check is decided on every rank together ([Note: arguments that must
agree] in schedule.py): a rank that raised alone would leave the others in their next collective. The ranks
all-gather their counts (one tiny all-gather, every step); where any is not zero, a second all-gather carries
the ds_ids of each rank's first `NAMED` leaks, so that every rank's error names the leaking rank and its
parameters in its first line, not only the rank that leaked. A parameter's ds_id is the same on every rank, and
so is its name.
"""
from typing import List

from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.errors import LeakError

NAMED = 8  # parameters named per rank and kind at most
KIND = 7   # the leak check's exchanges, to the pre-agreement and the watchdog (schedule.KINDS)


def check(state, when: str) -> None:
    """Raises `LeakError` on every rank where any rank leaked ([Note: a leak named on every rank])."""
    gathered = ops().ParamState.GATHERED
    handles = state.engine.handles
    ids = {h.name: h.ds_id for h in handles}
    unclaimed = [h.ds_id for h in handles if h.state == gathered and not h.claims]
    referenced = sorted({ids.get(n, -1) for n in state.engine.stale_references()})
    agreement = state.agreement
    mine = [len(unclaimed), len(referenced)]
    counts = agreement.all_gather(mine, kind=KIND) if agreement.world > 1 else [mine]
    if not any(sum(c) for c in counts):
        return
    named = _padded(unclaimed) + _padded(referenced)
    rows = agreement.all_gather(named, kind=KIND) if agreement.world > 1 else [named]
    names = {h.ds_id: h.name for h in handles}
    per_rank = []
    for r, (row, (n_unclaimed, n_referenced)) in enumerate(zip(rows, counts)):
        parts = [_named(names, row[:NAMED], n_unclaimed, "gathered without a claim"),
                 _named(names, row[NAMED:], n_referenced, "released but still referenced")]
        if any(parts):
            per_rank.append(f"rank {r}: " + "; ".join(p for p in parts if p))
    raise LeakError(
        f"z3ext leak check ({when}): " + "; ".join(per_rank) + "\n"
        "A parameter gathered without a claim stays gathered into the next step; one released but still "
        "referenced elsewhere (a view kept from a forward or a GatheredParameters block) holds no memory, and "
        f"reading it raises ([Note: true release] in csrc/engine.h). Raised on every rank (rank {agreement.rank} "
        "here): [Note: a leak named on every rank] in deepspeed_z3ext/leaks.py")


def _padded(ds_ids: List[int]) -> List[int]:
    return (ds_ids[:NAMED] + [-1] * NAMED)[:NAMED]


def _named(names, ds_ids, count, what) -> str:
    if not count:
        return ""
    shown = [f"'{names.get(i, f'<ds_id {i}>')}'" for i in ds_ids if i >= 0]
    more = f" and {count - len(shown)} more" if count > len(shown) else ""
    return f"{count} {what}: parameter{'s' if count > 1 else ''} {', '.join(shown)}{more}"
