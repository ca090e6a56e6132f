"""PrefetchWindow and BackwardWindow: the units of upcoming modules gathered ahead of their forward,
and of modules released after their forward gathered ahead of their backward.

[Note: prefetch window] Units of the next modules in the plan ([Note: forward plan]) are gathered
ahead, in one collective per batch, claimed for those modules' forwards, without making the compute
stream wait ([Note: deferred wait]); the elements gathered ahead and not yet reached stay within
stage3_prefetch_bucket_size (and the engine's live elements plus those ahead within
stage3_max_live_parameters). A unit larger than the window (a fetch group, [Note: fetch groups],
or a large embedding) is gathered ahead alone, when nothing else is ahead, within the live budget.
The window refills only once half of it has been reached: a full batch per collective (host time per
collective is what a host-bound forward pays), while the rest still overlaps compute.
[Note: batch size] A batch under half the window, cut short by the window while two or more units
are still ahead, waits for a later module: the next module's unit is gathered and the one after it
still covers this batch's gather, so waiting costs no stall and saves a collective (the GPT's
blocks, 4 units of 4-17 M elements against a 5e7 window: 49 -> 34 per forward). With fewer units
ahead, or at the plan's end, the batch goes now.
"""
from collections import deque
from typing import Callable, List, NamedTuple, Optional, Tuple


class Batch(NamedTuple):
    units: list                        # FetchUnits, in plan order
    owners: List[int]                  # the ds_id of the module each unit is gathered for
    positions: List[Tuple[int, int]]   # (plan position, numel) of each unit
    numel: int
    end: int                           # the plan position after the batch


class PrefetchWindow:

    def __init__(self, bucket_numel: int):
        self.bucket_numel = bucket_numel
        self.enabled = bucket_numel > 0
        self._ahead = deque()  # (plan position, numel) gathered ahead, not yet reached
        self.ahead_numel = 0
        self.frontier = 0      # plan positions before this one are gathered or passed

    def reset(self):
        """A new outermost forward: nothing is ahead."""
        self._ahead.clear()
        self.ahead_numel = 0
        self.frontier = 0

    def empty(self) -> bool:
        return not self._ahead

    def reach(self, pos: int) -> bool:
        """The forward reached plan position `pos`; whether the window should refill now."""
        ahead = self._ahead
        while ahead and ahead[0][0] < pos:
            self.ahead_numel -= ahead.popleft()[1]
        if pos > self.frontier:
            self.frontier = pos
        return self.ahead_numel * 2 <= self.bucket_numel

    def next_batch(self, order, unit_for: Callable, live_room: int, skip_gathered=False) -> Optional[Batch]:
        """The units to gather now from the frontier on ([Note: batch size]), or None. `skip_gathered`:
        units gathered already (resident: [Note: generation residency]) are passed over."""
        room = min(self.bucket_numel - self.ahead_numel, live_room)
        units, owners, taken, numel, i = [], [], [], 0, self.frontier
        while i < len(order):
            unit = unit_for(order[i])
            if skip_gathered and not unit.partitioned:
                i += 1
                continue
            n = unit.numel  # a C++ loop over the unit's handles: read once
            if numel + n > room and (units or self._ahead or n > live_room):
                break  # else a unit larger than the window, gathered ahead alone
            units.append(unit)
            owners.append(order[i].ds_id)
            taken.append((i, n))
            numel += n
            i += 1
        if not units:
            return None
        if numel * 2 < self.bucket_numel and len(self._ahead) >= 2 and i < len(order):
            return None
        return Batch(units, owners, taken, numel, i)

    def commit(self, batch: Batch):
        """`batch` is being gathered: its positions are ahead until the forward reaches them."""
        self._ahead.extend(batch.positions)
        self.ahead_numel += batch.numel
        self.frontier = batch.end


class Ahead(NamedTuple):
    unit: object   # the FetchUnit gathered ahead
    token: int     # owner of its Backward claim until its module's own backward claim takes over
    position: int  # its module's position in the forward's release order
    numel: int


class BackwardWindow:
    """[Note: backward prefetch] A module released after its forward (not held: the hold is off, or
    past its budget) is gathered again when its backward is about to run (graphs.py `claim_per_call`).
    Gathered only then, its all-gather would sit between two backward kernels. So the forward records,
    in order, the modules whose release was real; backward runs them roughly in reverse, and when one
    is fetched for its backward the units of the modules before it in that order are gathered ahead,
    in one deferred collective ([Note: deferred wait]), within stage3_prefetch_bucket_size elements
    ahead and stage3_max_live_parameters live, refilled once half of the window was reached, as the
    forward's window ([Note: prefetch window]). Each such unit is claimed by a token of this backward
    pass; its module's own fetch takes its per-call claim and drops the token's. A unit larger than the
    window (a fetch group claimed whole, [Note: group claims]) is gathered ahead alone when nothing else
    is ahead and it fits the live budget, as in the forward. This is stock's trace prefetch in backward,
    with units instead of parameters.

    [Note: backward walk] Which modules' backward runs may differ by rank (a head per task, a loss that
    skips a branch): gathered as each backward arrives, the ranks would issue different all-gathers. So
    a pass walks the whole order from the top down, the same on every rank: a module fetched for its
    backward first *passes* every position above it not passed yet, each as if its module had been
    fetched there (its unit claimed, gathered when not ahead, the window refilled), then takes its own.
    A position passed without its module's fetch drops its claim once the window is refilled after it,
    as a fetched module's own claim ends after its backward, before the next position's fetch: the
    claim ends in hooks on the module's input boundary nodes ([Note: input boundary] in hooks.py), whose
    gradients come before those of the tensors they wrap, where the module before it is fetched. So live
    elements, and with them each batch, are the same on every rank, and a module applied twice in a row
    is gathered twice by a rank that ran it and by one that passed it alike; the pass's end passes what
    is left down to the first position ([Note: a walk that raised] in coordinator.py: or the next
    forward, after a pass that raised).
    Positions no rank's backward needs (trainable parameters none of which any rank's backward reaches:
    a branch the loss never used) are agreed at the walk's start ([Note: presence agreed] in grads.py)
    and passed over, neither gathered ahead nor on the way.

    [Note: reductions on the walk] A module held since its forward runs its backward without a fetch, and
    the walk advances only at fetches: a rank that skipped a released module above a held one (LayerDrop on
    that rank, the released module past a hold budget) would get the held module's gradients, and reduce
    their bucket, before passing the skipped position, while a rank that ran it gathers it first. So before a
    walked pass reduces a bucket, the walk passes every position above the bucket's modules: those released
    after the bucket's lowest module in the forward (`Z3extCoordinator.walk_above`, from the marks the
    forward left: how many positions preceded each hold). On a rank whose backward runs in reverse forward
    order these are passed already; the others catch up, and every rank reduces the bucket after the same
    gathers.
    A module fetched after its position was passed (a backward out of the recorded order) gathers its
    unit again on demand, as any module whose unit is not ahead. The gradient reduce-scatters share the
    gathers' group; where they go among these gathers is agreed too ([Note: presence agreed] in grads.py)."""

    def __init__(self, bucket_numel: int):
        self.bucket_numel = bucket_numel
        self.enabled = bucket_numel > 0
        self.order = []      # modules released after their forward, in this forward's order
        self._position = {}  # id(module) -> its positions in `order` (a module applied twice has two)
        self._ahead = {}     # position -> Ahead
        self.ahead_numel = 0
        self.frontier: Optional[int] = None  # the next position down to gather ahead (None: no backward yet)
        self.walked: Optional[int] = None    # positions from here up are passed (None: no backward yet)
        self.passed = []     # (unit, token) of positions passed, claim on until the window refills
        self.gathered_ahead = 0  # units gathered ahead since the engine was created
        self.walk_task = None    # the graph task of the pass walking the order
        self.skip = frozenset()  # positions no rank's backward needs, agreed at the walk's start

    def reset(self):
        """A new outermost forward outside backward: a new order."""
        self.order.clear()
        self._position.clear()
        self._ahead.clear()
        self.passed.clear()
        self.ahead_numel = 0
        self.frontier = self.walked = self.walk_task = None
        self.skip = frozenset()

    def released(self, module):
        """`module`'s forward call was released: its backward will fetch it."""
        ps = self._position.get(id(module))
        if ps is None:
            self._position[id(module)] = [len(self.order)]
        else:
            ps.append(len(self.order))
        self.order.append(module)

    def position(self, module) -> Optional[int]:
        """The position a fetch of `module` for its backward reaches: the highest of its positions the walk has not
        passed (the backward of a module applied twice runs its later call first), else its last."""
        ps = self._position.get(id(module))
        if ps is None:
            return None
        walked = self.walked
        if walked is not None and len(ps) > 1:
            for p in reversed(ps):
                if p < walked:
                    return p
        return ps[-1]

    def start(self) -> bool:
        """A backward pass reaches this forward's modules: whether it is the first ([Note: backward walk])."""
        if self.walked is not None:
            return False
        self.walked = len(self.order)
        self.frontier = self.walked - 1
        return True

    def reach(self, pos: int) -> Optional[Ahead]:
        """Position `pos` is fetched or passed: what was gathered ahead for it (its claim to drop or to keep
        as the passing claim), or None. Units ahead of positions above it were passed."""
        mine = self._ahead.pop(pos, None)
        if mine is not None:
            self.ahead_numel -= mine.numel
        if self._ahead:
            for key in [k for k in self._ahead if k > pos]:
                a = self._ahead.pop(key)
                self.ahead_numel -= a.numel
                self.passed.append((a.unit, a.token))
        if self.frontier is None or self.frontier >= pos:
            self.frontier = pos - 1
        if self.walked is None or pos < self.walked:
            self.walked = pos
        return mine

    def next_batch(self, unit_for: Callable, live_room: int) -> Optional[Tuple[list, list]]:
        """(positions, units) to gather ahead now, from the frontier down, or None."""
        if self.frontier is None or self.frontier < 0 or self.ahead_numel * 2 > self.bucket_numel:
            return None
        room = min(self.bucket_numel - self.ahead_numel, live_room)
        positions, units, numel, i = [], [], 0, self.frontier
        while i >= 0:
            if i in self.skip:
                i -= 1
                continue
            unit = unit_for(self.order[i])
            if unit.partitioned and i not in self._ahead:  # else gathered already, or ahead
                n = unit.numel
                if numel + n > room and (units or self._ahead or n > live_room):
                    break  # else a unit larger than the window, gathered ahead alone
                positions.append(i)
                units.append(unit)
                numel += n
            i -= 1
        self.frontier = i
        return (positions, units) if units else None

    def commit(self, positions, units, token):
        for pos, unit in zip(positions, units):
            n = unit.numel
            self._ahead[pos] = Ahead(unit, token, pos, n)
            self.ahead_numel += n
        self.gathered_ahead += len(units)
