"""FetchGroup: the modules of one repeated block (a transformer layer) fetched as one unit.

[Note: fetch groups] Each module's parameters form a fetch unit, and a unit costs the forward a
dozen Python and C++ crossings whatever its size (claim, gather or wait, prefetch window, hold or
release: bench/NOTES.md v16); the 0.94B GPT's forward has 99 of them. Once the first forward has
been recorded ([Note: forward plan]), a module M becomes the owner of one unit, the union of the
units its forward fetched, when
- it is one of a repeated structure, not the root: its parent has another child of its type (the
  layers of a ModuleList), and it has no parameters of its own;
- its forward fetched a contiguous run of the plan, of its descendants only, each once, two or
  more, none with external parameters, of at most `max_numel` elements (stage3_max_live_parameters / 2
  by default: a group and the group gathered ahead of it fit the live budget);
- no module around it qualifies (the outermost wins).
From then on M's forward claims, gathers, holds or releases the group as any module's unit, and
the prefetch window sees it as one position. The members' own hooks keep DeepSpeed's module stack,
the input boundary ([Note: input boundary]) and, for a large group not held whole, each member's
own hold or backward claim ([Note: group claims]); without those claims the hooks are lifted while
the group is open, the boundary kept ([Note: member hooks] in lifted.py). In an activation-checkpoint recomputation each
member takes its own claim, as without groups: non-reentrant checkpointing stops a recomputation
inside the last module it needs, whose owner's release (an exception) must not release the members
that ran before it, whose saved parameters backward still checks. A member that runs outside its owner's forward fetches
its own unit; one whose parameters changed (late parameters) rebuilds the group at the owner's next
fetch, and an external parameter discovered inside the group is claimed for the owner and joins it.

[Note: group claims] A group that is not held whole ([Note: hold for backward]: the hold is off or
past its budget) is gathered again for backward, by the owner's one claim or member by member. The
owner's claim (graphs.claim_per_call on the block's inputs and outputs) costs one claim, one gather
and one release per block instead of one per member, in forward and in backward, but backward then
keeps the whole block gathered, and the block gathered ahead of it ([Note: backward prefetch]). So
a group of at most twice stage3_prefetch_bucket_size elements (`fetch_group_claim_numel`) is
claimed whole: the two blocks of backward stay within four buckets (the 0.94B GPT's 50M-element
block at the 5e7 default; its peak fell 87 MiB, as members held in part are no longer re-gathered
beside the window). A larger group (GPT 6.7B: 201M; claimed whole, its peak rose 480 MiB) is
re-gathered member by member, where each member is held while the hold budget allows or takes its
own claim, as without groups (bench/NOTES.md v18).
"""
import enum
from typing import Dict

from deepspeed.utils import z3_leaf_module


class MemberClaims(enum.Enum):
    """Who keeps a group's members gathered past the owner's forward, decided when it opens."""
    NONE = 1       # the group as a whole: released, held ([Note: hold for backward]) or recomputed
    FORWARD = 2    # a grad-enabled forward of a large group not held whole: each member is held or claims its backward
    RECOMPUTE = 3  # a recomputation inside backward: each member stays claimed until its own backward


class FetchGroup:
    __slots__ = ("owner", "members", "member_ids", "unit", "member_units", "open", "member_claims", "dirty", "epoch",
                 "liftable", "lifted", "lifted_dicts", "ds_ids", "kept")

    def __init__(self, owner, members):
        self.owner = owner              # the module whose forward fetches the group
        self.members = members          # the modules whose units form it, in plan order
        self.member_ids = frozenset(map(id, members))
        self.unit = None                # the union FetchUnit (Z3extState.unit_for)
        self.member_units = ()          # the member units it was built from
        self.ds_ids = frozenset()       # the ds_ids of `unit`'s parameters
        self.open = False               # the owner's forward is running
        self.member_claims = MemberClaims.NONE
        self.dirty = False              # an external parameter joined inside the group
        self.epoch = -1                 # the tree epoch `unit` was checked at ([Note: tree epoch])
        self.liftable = None            # (version, the modules whose hooks an open forward may lift, leaf dicts) (lifted.py)
        self.lifted = ()                # what the open forward lifted (lifted.py)
        self.lifted_dicts = ()          # the z3 leaf members' descendants' parameter dicts it made plain (lifted.py)
        self.kept = False               # `lifted` stays while the group is closed ([Note: kept lift] in lifted.py)


def form(order: list, spans: Dict[int, list], root, max_numel: int, numel_of) -> Dict[int, FetchGroup]:
    """The groups of a recorded plan ([Note: fetch groups]). `spans`: id(module) -> [module, first
    plan position fetched inside its first forward, position after it]; `numel_of(module)`: the
    elements of its unit."""
    if max_numel <= 0:
        return {}
    parents = {id(c): m for m in root.modules() for c in m.children()}
    groups: Dict[int, FetchGroup] = {}
    taken = set()
    for module, start, end in sorted((s for s in spans.values() if s[2] is not None), key=lambda s: (s[1], -s[2])):
        if end - start < 2 or module is root or id(module) in taken or not _repeated(module, parents):
            continue
        if any(p is not None for p in module._parameters.values()) or z3_leaf_module(module):
            continue
        members = order[start:end]
        ids = [id(m) for m in members]
        if len(set(ids)) != len(ids) or any(i in taken for i in ids) or _has_externals(module):
            continue
        inside = {id(m) for m in module.modules()}
        if any(i not in inside for i in ids) or any(_has_externals(m) for m in members):
            continue
        if sum(numel_of(m) for m in members) > max_numel:
            continue
        groups[id(module)] = FetchGroup(module, members)
        taken.update(ids)
        taken.update(inside)
    return groups


def collapse(order: list, groups: Dict[int, FetchGroup]) -> list:
    """`order` with each run of a group's members replaced by its owner."""
    if not groups:
        return order
    first = {id(g.members[0]): g for g in groups.values()}
    out, i = [], 0
    while i < len(order):
        g = first.get(id(order[i]))
        k = len(g.members) if g is not None else 0
        if g is not None and all(a is b for a, b in zip(order[i:i + k], g.members)) and i + k <= len(order):
            out.append(g.owner)
            i += k
        else:
            out.append(order[i])
            i += 1
    return out


def _repeated(module, parents) -> bool:
    parent = parents.get(id(module))
    if parent is None:
        return False
    kind = type(module)
    return sum(type(c) is kind for c in parent.children()) >= 2


def _has_externals(module) -> bool:
    return bool(getattr(module, "_external_params", None))
