"""The watchdog's inquiries through the process group's store: a constant number of store operations per rank.

[Note: inquiry in O(world)] An inquiry (numbered alike on every rank) is opened by the first rank whose
collective has been pending long enough (`compare_set` of its key); every rank's watchdog thread polls for the
key (one `check` a poll). Each rank then, once:
- appends its report, one JSON line, to the inquiry's one report key (`append`),
- counts itself in (`add`); the rank that makes the count the world sets the key "all answered" (`set`),
- waits for that key, at most the answer window (`wait`: one blocking call, no polling),
- reads every report in one `get`.
So an inquiry costs a rank at most 6 store operations whatever the world (the whole world's: O(world)); reading
each rank's report under its own key costs each rank O(world), the world O(world^2), and polling for them
more. Where a rank does not answer within the window (dead, stopped, or in C++ holding the GIL), the others
read the reports there are. The delivery of a verdict is counted the same way (`delivered`, `wait_delivered`).
The store's keys are the watchdog's own: it takes the store as a parameter (the process group's, by default).
"""
import json
from datetime import timedelta
from typing import Dict


class Inquiry:
    """One engine's inquiries: `store` (its keys the engine's own), this rank and the world."""

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    def is_open(self, n: int) -> bool:
        return self.store.check([f"inquiry/{n}"])

    def open(self, n: int) -> None:
        self.store.compare_set(f"inquiry/{n}", "", str(self.rank))  # the first to open it is its opener

    def exchange(self, n: int, report: dict, answer: float) -> Dict[int, dict]:
        """Every rank's report to inquiry `n` that came within `answer` seconds, by rank."""
        key = f"inquiry/{n}"
        self.store.append(f"{key}/reports", json.dumps([self.rank, report]) + "\n")
        self._count(f"{key}/answered", f"{key}/all-answered", answer)
        reports: Dict[int, dict] = {}
        for line in self.store.get(f"{key}/reports").decode().splitlines():
            rank, rep = json.loads(line)
            reports.setdefault(int(rank), rep)
        return reports

    def delivered(self, n: int) -> None:
        """This rank holds inquiry `n`'s verdict ([Note: verdict before exit] in watchdog.py)."""
        if self.store.add(f"inquiry/{n}/delivered", 1) == self.world:
            self.store.set(f"inquiry/{n}/all-delivered", "1")

    def wait_delivered(self, n: int, timeout: float) -> None:
        self._wait(f"inquiry/{n}/all-delivered", timeout)

    def _count(self, counter, done, timeout):
        if self.store.add(counter, 1) == self.world:
            self.store.set(done, "1")
        else:
            self._wait(done, timeout)

    def _wait(self, key, timeout):
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except RuntimeError:  # not every rank within the window (torch's DistStoreError is a RuntimeError)
            pass
