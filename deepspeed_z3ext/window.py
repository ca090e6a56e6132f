"""PrefetchWindow: the units of upcoming plan positions gathered ahead of their modules.

[Note: prefetch window] Units of the next modules in the plan ([Note: forward plan]) are gathered
ahead, in one collective per batch, claimed for those modules' forwards, without making the compute
stream wait ([Note: deferred wait]); the elements gathered ahead and not yet reached stay within
stage3_prefetch_bucket_size (and the engine's live elements plus those ahead within
stage3_max_live_parameters). A unit larger than the window is fetched by its module. The window
refills only once half of it has been reached: a full batch per collective (host time per
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
        self._ahead = deque()  # (plan position, numel) gathered ahead, not yet reached
        self.ahead_numel = 0
        self.frontier = 0      # plan positions before this one are gathered or passed

    @property
    def enabled(self) -> bool:
        return self.bucket_numel > 0

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

    def next_batch(self, order, unit_for: Callable, live_room: int) -> Optional[Batch]:
        """The units to gather now from the frontier on ([Note: batch size]), or None."""
        room = min(self.bucket_numel - self.ahead_numel, live_room)
        units, owners, taken, numel, i = [], [], [], 0, self.frontier
        while i < len(order):
            unit = unit_for(order[i])
            n = unit.numel  # a C++ loop over the unit's handles: read once
            if numel + n > room:
                break
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
