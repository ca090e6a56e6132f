"""Watchdog: a rank that keeps an engine's z3ext collective waiting is named in a warning every `z3ext.hang_timeout`
seconds, and in an error on every rank before the process group's own timeout fires.

[Note: hang watchdog] A rank whose z3ext collective waits for a rank that never issues it (a program that
diverged, a rank stuck in user code, a rank that caught an error and went on) waits forever on NCCL and until
the group's timeout on gloo; a rank busy alone for a while (a rank-0-only checkpoint write or evaluation) is
legitimate skew. Every z3ext collective leaves a record ([Note: collective progress] in csrc/progress.h); one
thread per process reads each engine's every `min(1, hang_timeout / 4)` seconds:
- a collective of this rank pending for longer than `hang_timeout` (the host waiting in it on gloo, its fence
  not reached on an accelerator: nothing on the training thread waits for the device) opens an inquiry
  ([Note: inquiry in O(world)] in inquiry.py): a key in the process group's store, which a stuck collective
  does not block;
- every rank's thread that sees the key (the late rank's too: the thread runs while the training thread is in
  user code) reports: its collectives' count, the last `Progress.kCapacity` records, how long its oldest
  pending one has waited, how long since it left its last one, where its training thread is (the innermost
  frames); and reads the others';
- from the same reports every rank comes to the same verdict. A certain divergence raises at once: the first
  collective whose records differ (kind, elements, tensors, module: `ScheduleMismatchError` naming each rank's
  module), or every rank waiting, in different collectives. Otherwise a rank is late (it has not arrived, or
  did not answer) or every rank waits in one collective (slow, once the last to arrive has waited an interval
  too: before that, the late rank has just arrived and nothing is said): each rank logs a warning naming the
  late rank, what it last did and where it is, and training goes on; the next inquiry comes one `hang_timeout` later,
  until the collective has been pending for the deadline, the process group's timeout less a margin ([Note:
  the deadline is the group's] in deadline.py): then every rank raises `RankTimeoutError`, the same message.
Then the engine is not usable: a host wait on a gloo group wakes within 0.1 s and raises the error, every
later z3ext collective raises it, a training thread in Python code gets it raised asynchronously (a thread
blocked in a C call, `time.sleep` included, gets it when the call returns), and on NCCL every group z3ext
issues on (the world, DeepSpeed's data-parallel clone, hpZ's) is aborted (torch's `ProcessGroup.abort`, in one
NCCL group call as torch aborts its own) so that a host blocked on the device returns. DeepSpeed's own
collectives (its step's, the checkpoint's) are not z3ext's and not watched.
"""
import ctypes
import sys
import threading
import weakref
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from deepspeed_z3ext.deadline import Deadline, deadline_of
from deepspeed_z3ext.errors import Z3extError
from deepspeed_z3ext.inquiry import Inquiry
from deepspeed_z3ext.schedule import ScheduleMismatchError, describe, off_plan_hint


class RankTimeoutError(Z3extError, RuntimeError):
    """A z3ext collective stayed pending until the deadline (the process group's timeout less a margin): a rank
    has not arrived at it; the first line names the late rank and the collective."""


# A record's state (csrc/progress.h snapshot)
_COMPLETE, _WAITING, _ON_DEVICE = 0, 1, 2
_SERIALS: Dict[tuple, int] = {}  # engines made per group of ranks: the same on every rank of it


def _bound(cls, message):
    """`cls` whose instances carry `message`: an asynchronous exception is raised as a class."""
    return type(cls.__name__, (cls,), {"__init__": lambda self, *args: cls.__init__(self, message),
                                       "__module__": cls.__module__})


class Watchdog:
    """One engine's: reads its Progress on the process's watchdog thread ([Note: hang watchdog]). `groups`: every
    process group the engine issues on (its deadline's timeouts, the groups aborted on NCCL); `store`: where the
    inquiries go (default: the process group's store)."""

    def __init__(self, progress, group, hang_timeout: float, names, groups: Optional[Callable[[], Iterable]] = None,
                 store=None):
        self.progress = progress
        self.group = group
        self._groups = groups if groups is not None else (lambda: [group])
        self.deadline: Deadline = deadline_of(self._groups(), hang_timeout)
        self.period = min(1.0, self.deadline.first / 4)
        margin = self.deadline.timeout - self.deadline.deadline
        self.answer = min(10.0, hang_timeout, margin / 2)  # the reports' window: within the margin
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._names = names  # () -> {ds_id: parameter name}
        self.unplanned = None  # ds_id -> the module off the recorded plans ([Note: a module off the plan])
        ranks = tuple(dist.get_process_group_ranks(group))
        serial = _SERIALS[ranks] = _SERIALS.get(ranks, 0) + 1
        store = dist.distributed_c10d._get_default_store() if store is None else store
        self._inquiries = Inquiry(dist.PrefixStore(f"z3ext-watchdog/{hash(ranks) & 0xffffffff:x}/{serial}/", store),
                                  self.rank, self.world)
        self._thread = threading.get_ident()  # the training thread: the one that built the engine
        self._inquiry = 0              # the next inquiry's number: alike on every rank
        self._next = self.deadline.first  # the stall's age at which this rank opens the next inquiry
        self._last = 0.0               # the stall's age at the last poll: a younger one is a new stall
        self.warnings = 0              # warnings logged (a rank late, or every rank slow)
        self.aborted_groups = 0        # NCCL groups aborted with the verdict
        self.polls = 0
        self.verdict: Optional[str] = None
        _RUNNER.add(self)

    def close(self):
        _RUNNER.discard(self)

    # -- on the watchdog thread ------------------------------------------------------------------------
    def poll(self):
        self.polls += 1
        if self.verdict is not None or self.progress.aborted:
            return
        stalled = self.progress.stalled_seconds()
        if stalled < self._last:  # the stall ended (or another began): its warnings start over
            self._next = self.deadline.first
        self._last = stalled
        n = self._inquiry
        if stalled > self._next:
            self._inquiries.open(n)  # the first rank to see its stall this old opens it
        elif not self._inquiries.is_open(n):
            return
        reports = self._inquiries.exchange(n, self._report(), self.answer)
        self._inquiry += 1
        cls, message = verdict(reports, self.world, self.deadline, self._names(), self.unplanned)
        if cls is None:  # late or slow, before the deadline: a warning, and training goes on
            if message is not None:
                from deepspeed.utils import logger
                logger.warning(message)
                self.warnings += 1
            self._next = min(self.progress.stalled_seconds() + self.deadline.interval, self.deadline.deadline)
            return
        self._deliver(cls, message, n)

    def _report(self) -> dict:
        issued, since, records = self.progress.snapshot()
        stalled = max((r[6] for r in records if r[7] != _COMPLETE), default=0.0)
        return dict(issued=issued, since=since, stalled=stalled, records=[list(r) for r in records],
                    where=self._where())

    def _where(self) -> str:
        frame = sys._current_frames().get(self._thread)
        out = []
        while frame is not None and len(out) < 2:
            code = frame.f_code
            if "deepspeed" not in code.co_filename and "torch" not in code.co_filename:
                out.append(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}")
            frame = frame.f_back
        return ", called from ".join(out) or "outside Python code"

    def _deliver(self, cls, message, n):
        from deepspeed.utils import logger
        self.verdict = message
        logger.error(message)
        error = _bound(cls, message)
        waiting = any(r[7] == _WAITING for r in self.progress.snapshot()[2])
        self.progress.abort(error, message)  # a host wait raises it, so does every later collective
        self._inquiries.delivered(n)
        if not waiting:  # the training thread is outside z3ext's collectives: raised at its next bytecode
            # [Note: verdict before exit] once every rank holds the verdict: raised here first, this rank's
            # process may end at once, and a rank still waiting in a collective with it would see its connection
            # close (gloo's error) before its own watchdog delivered the named one.
            self._inquiries.wait_delivered(n, self.answer)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread), ctypes.py_object(error))
        self._abort_nccl()

    def _abort_nccl(self):
        """Every NCCL group the engine issues on, and the world's, aborted in one NCCL group call (as torch's
        `_abort_process_group` aborts all of its own): a host blocked on the device returns. Not the ones of
        another backend: a gloo host wait wakes through the Progress."""
        groups: List = []
        for g in list(self._groups()) + [dist.group.WORLD]:
            if g is not None and all(g is not h for h in groups) and dist.get_backend(g) == "nccl":
                groups.append(g)
        if not groups:
            return
        from deepspeed.utils import logger
        try:
            backend = groups[0]._get_backend(torch.device("cuda"))
        except Exception:  # noqa: BLE001 (no NCCL backend object: abort one by one)
            backend = None
        grouped = backend is not None and hasattr(backend, "_group_start")
        if grouped:
            backend._group_start()
        try:
            for g in groups:
                try:
                    g.abort()
                except Exception as e:  # noqa: BLE001 (the verdict stands; the abort is a courtesy)
                    logger.warning(f"z3ext watchdog: aborting process group {dist.get_process_group_ranks(g)} "
                                   f"failed: {e}")
        finally:
            if grouped:
                backend._group_end()
        self.aborted_groups = len(groups)


def verdict(reports: Dict[int, dict], world: int, deadline: Deadline, names, unplanned=None):
    """(error class, message) from every answering rank's report, or (None, the warning) where the ranks wait for
    a late rank, or are slow, and the deadline has not come, or (None, None) where the late rank has just arrived
    ([Note: hang watchdog])."""
    tail = ". The engine is not usable any more: every rank raises this error"
    silent = [r for r in range(world) if r not in reports]
    by_index = {r: {rec[0]: rec for rec in rep["records"]} for r, rep in reports.items()}
    common = sorted(set.intersection(*(set(d) for d in by_index.values()))) if by_index else []
    for i in common:  # the first collective the answering ranks recorded differently
        if len({tuple(by_index[r][i][1:6]) for r in by_index}) > 1:
            what = "; ".join(f"rank {r}: {describe(names, by_index[r][i][1:6])}" for r in sorted(by_index))
            hint = off_plan_hint([by_index[r][i][1:6] for r in sorted(by_index)], unplanned)
            return ScheduleMismatchError, (f"z3ext: the ranks' collective #{i} differs ({what}). A rank ran a "
                                           "forward, a backward or a call the others did not ([Note: one schedule "
                                           "on every rank] in deepspeed_z3ext/schedule.py; found by the hang "
                                           f"watchdog, [Note: hang watchdog] in deepspeed_z3ext/watchdog.py). {hint}"
                                           f"{tail[2:]}")
    pending = {r: [rec for rec in rep["records"] if rec[7] != _COMPLETE] for r, rep in reports.items()}
    host_waits = {r: next((rec for rec in p if rec[7] == _WAITING), None) for r, p in pending.items()}
    # Every rank waiting, in different collectives: none can arrive at the others'. Certain only where every
    # wait is older than an interval: reports are taken a poll or so apart, and a late rank that arrived just
    # then may have left the collective the others' reports still wait in.
    if not silent and world > 1 and all(w is not None and w[6] >= deadline.interval for w in host_waits.values()) \
            and len({w[0] for w in host_waits.values()}) > 1:
        what = "; ".join(f"rank {r}: #{w[0]} ({describe(names, w[1:6])})" for r, w in sorted(host_waits.items()))
        hint = off_plan_hint([w[1:6] for _, w in sorted(host_waits.items())], unplanned)
        return ScheduleMismatchError, (f"z3ext: the ranks wait in different collectives ({what}): none can arrive "
                                       "at the others'. A rank ran a forward, a backward or a call the others did "
                                       "not ([Note: one schedule on every rank] in deepspeed_z3ext/schedule.py; "
                                       f"found by the hang watchdog, [Note: hang watchdog] in "
                                       f"deepspeed_z3ext/watchdog.py). {hint}{tail[2:]}")
    arrived = max((rep["issued"] for rep in reports.values()), default=0)
    lines, late = [], list(silent)
    for r in sorted(reports):
        rep = reports[r]
        if pending[r]:
            rec = pending[r][0]
            lines.append(f"rank {r}: waiting in collective #{rec[0]} ({describe(names, rec[1:6])}) for {rec[6]:.1f}s")
        else:
            last = by_index[r].get(rep["issued"] - 1)
            did = f"its last, #{last[0]} ({describe(names, last[1:6])}), ended {rep['since']:.1f}s ago" if last else \
                "it has issued none"
            lines.append(f"rank {r}: has not arrived at collective #{rep['issued']}: {did}; it is at {rep['where']}")
        if rep["issued"] < arrived or not pending[r]:
            late.append(r)
    lines += [f"rank {r}: did not answer within the inquiry's window (dead, stopped, or blocked in C++ holding "
              "the GIL)" for r in silent]
    oldest = min((p[0] for p in pending.values() if p), key=lambda rec: rec[0], default=None)
    waited_for = f"collective #{oldest[0]} ({describe(names, oldest[1:6])})" if oldest else f"collective #{arrived}"
    age = max((rep.get("stalled", 0.0) for rep in reports.values()), default=0.0)
    if not late and oldest is not None:
        # Every rank in one collective, one of them for less than an interval where another waited an interval
        # longer: the late rank has just arrived (the reports met its arrival), and the collective has not been
        # slow yet. Nothing to say; the next inquiry, an interval on, tells slow from done.
        waits = [by_index[r][oldest[0]][6] for r in reports if oldest[0] in by_index[r]]
        if min(waits) < deadline.interval <= max(waits) - min(waits) and age < deadline.deadline:
            return None, None
    late = sorted(set(late))
    who = (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))}" if late else "")
    detail = "; ".join(lines)
    if age < deadline.deadline:
        if late:
            head = f"z3ext: {who} late: {waited_for} has waited {age:.1f}s for {'them' if len(late) > 1 else 'it'}"
        else:
            head = f"z3ext: every rank has waited in {waited_for} for {age:.1f}s: slow, not diverged"
        return None, (f"{head} ({detail}). Training goes on: a warning every hang_timeout={deadline.interval:g}s; "
                      f"every rank raises RankTimeoutError if it is still pending at {deadline.deadline:g}s, "
                      f"{deadline.describe()}")
    if late:
        head = f"z3ext: {who} kept {waited_for} waiting for {age:.1f}s"
    else:
        head = f"z3ext: {waited_for} did not complete on any rank in {age:.1f}s (every rank waits in it)"
    return RankTimeoutError, (f"{head}, past the deadline of {deadline.deadline:g}s (the process group's timeout "
                              f"of {deadline.timeout:g}s less a margin to deliver)\n{detail}{tail} ([Note: hang "
                              "watchdog] in deepspeed_z3ext/watchdog.py, [Note: the deadline is the group's] in "
                              "deepspeed_z3ext/deadline.py)")


class _Runner:
    """The process's watchdog thread: polls every live engine's Watchdog."""

    def __init__(self):
        self._dogs: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def add(self, dog):
        with self._lock:
            self._dogs.add(dog)
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="z3ext-watchdog",
                                                daemon=True)
                self._thread.start()

    def discard(self, dog):
        with self._lock:
            self._dogs.discard(dog)

    def stop(self, timeout: float = 5.0):
        """At interpreter exit, after the engines' teardown: the thread ends and is joined. A daemon thread still
        in a store call when Python finalizes is unwound by `pthread_exit` through C++ frames, which aborts the
        process (SIGABRT after a finished run, seen once under `accelerate launch`)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, stop):
        warned: List[str] = []
        while not stop.is_set():
            with self._lock:
                period = min((d.period for d in self._dogs), default=1.0)
            if stop.wait(period):
                return
            with self._lock:  # the engines live now: one closed during the wait is not polled
                dogs = list(self._dogs)
            for d in dogs:
                try:
                    d.poll()
                except Exception as e:  # noqa: BLE001 (a store gone at exit must not kill the thread)
                    if str(e) not in warned:
                        warned.append(str(e))
                        from deepspeed.utils import logger
                        logger.warning(f"z3ext watchdog: {e}")


_RUNNER = _Runner()


def stop_thread():
    """Ends the process's watchdog thread (at interpreter exit, [Note: hang watchdog])."""
    _RUNNER.stop()
