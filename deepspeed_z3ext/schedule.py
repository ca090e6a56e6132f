"""Ranks in step: the tiny collectives by which an engine's ranks agree (a graph's death) and check (their
gather schedules).

[Note: one schedule on every rank] Every rank must issue the same collectives in the same order, and the
schedule may depend only on the calls the program makes (DESIGN.md). Whether a unit is gathered depends on
whether it is still claimed; claims end at events every rank sees alike (a module's forward returning, a
backward pass through a graph's outputs, the optimizer step), with one exception: a graph whose outputs
died without a backward. When a rank drops its last reference to a loss, and when its garbage collector
breaks a cycle, is its own business (a logger on rank 0 keeps the loss; rank 1 drops it). So a graph's
death is only *noticed* locally ([Note: graph claims]); it is *decided* by a vote at the start of an
outermost forward and at the end of an engine's backward: an all-reduce (MIN) of one flag per live
graph, in token order. A graph dies on every
rank when it is dead on every rank; until then a rank that dropped it holds its parameters a little
longer (late, never early). The vote runs only while a sealed graph is live (the set of live graphs is
itself rank-symmetric: graphs open and seal in forwards, end in backwards, the step and votes): ordinary
training (forward, backward, step) and no_grad forwards never pay for it.

[Note: one-rank faults] An out of memory in a gather (or an error in backward) on one rank only leaves the
engine usable on that rank ([Note: gather rollback] in csrc/engine.h) but the other ranks inside a collective
it never issued. If the error ends that rank's process, the others' collective fails when its connection
closes (gloo: "Connection closed by peer"), or at the collective timeout (NCCL's watchdog): every rank ends
in an error. If the rank catches the error and goes on (a retry loop), its next collectives pair with the
others' pending ones: a size mismatch raises (gloo), a hang ends at the timeout (NCCL), and where the
schedules realign (a whole micro-batch skipped) the ranks train a batch apart: the schedule check counts
each rank's rolled-back ops and raises on every rank at the next step. When every rank raises in the same
op (the same allocation failing everywhere), the counts agree and training goes on.

[Note: arguments that must agree] A per-call value that shapes the schedule (the elements
`deepspeed_z3ext.resident(engine, numel)` keeps gathered, `full_weights`' bucket bytes and names) decides
which units stay gathered or which tensors one all-gather carries: sized from each GPU's free memory, it
would differ between ranks and so would their collectives. Where such a call takes effect the ranks
exchange it (one tiny all-gather, `RankAgreement.agreed`): a budget becomes the smallest on every rank
(logged), anything else that differs raises on every rank naming each rank's value, before any collective
depends on it. `leak_check` decides on every rank together: a leak found on one rank raises on all of them.

[Note: schedule check] NCCL does not notice two ranks gathering different things: a hang, or garbage
where sizes happen to match. The gather engine keeps a fingerprint of its all-gathers and of the gradient
reduce-scatters ([Note: schedule fingerprint] in csrc/schedule.h); the ranks compare it with one tiny
all-gather at every optimizer step (`schedule_check: "step"`, the default), or at every outermost forward
too (`"forward"`, for debugging), and reset it. The all-gather is read at the next check, not waited for:
on an accelerator its result is copied to pinned host memory behind the step's work and an event marks it,
so the host never waits for the device (a wait at the step's start would stall the launch of the step). On a mismatch every rank
raises `ScheduleMismatchError` at that next check, naming the first collective where they differ and the
module each rank gathered there (a second, rare all-gather of the logged collectives).
"""
import time
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from deepspeed_z3ext import comms
from deepspeed_z3ext.errors import Z3extError

_CPU = torch.device("cpu")
_HOST_WORLD = None  # the gloo group of the world's ranks votes go over on NCCL ([Note: votes on the host])


class ScheduleMismatchError(Z3extError, RuntimeError):
    """The ranks of one engine issued different collectives."""


class Fingerprint(NamedTuple):
    count: int   # collectives since the last check
    digest: int  # their running hash
    faults: int  # z3ext ops that raised on this rank since, rolled back ([Note: one-rank faults])
    logged: int  # of the collectives, those kept one by one


def _device(group):
    """Where the group's collectives take tensors: the host for gloo, else the accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


KINDS = {1: "an all-gather", 2: "a gradient reduce-scatter", 3: "a vote on graph deaths", 4: "the schedule check",
         5: "an exchange of call arguments", 6: "the gradient norm's all-reduce",
         7: "the leak check's exchange", 8: "an exchange of gradient arrival order",
         9: "a collective of full_weights (its arguments' exchange or a bucket's all-gather)",
         10: "a vote on which gradients a backward can reach",
         11: "an exchange of the module each rank fetches next (a forward recorded together)"}


class Preagreement:
    """[Note: agree before the collective] in csrc/agreement.h: on gloo, the descriptor of each z3ext collective
    is exchanged before it, and a difference raises `ScheduleMismatchError` on every rank, naming what each rank
    was about to do (the module of an all-gather)."""

    def __init__(self, engine):
        self._engine = engine  # the C++ GatherEngine: its handles name the parameters
        self.exchanges = 0
        self.unplanned = None  # ds_id -> the module off the recorded plans ([Note: a module off the plan])

    def exchange(self, group, descriptor, progress=None):
        """The Python side's exchange before its own collective over `group` (a gloo group); its wait wakes
        for the watchdog through `progress` ([Note: collective progress] in csrc/progress.h)."""
        self.exchanges += 1
        mine = torch.tensor(descriptor, dtype=torch.int64)
        world = dist.get_world_size(group)
        out = mine.repeat(world)
        work = dist.all_gather_into_tensor(out, mine, group=group, async_op=progress is not None)
        if progress is not None:
            progress.wait(work)
        rows = out.view(world, len(descriptor)).tolist()
        if any(r != rows[0] for r in rows):
            self.disagree(rows)

    def disagree(self, rows):
        names = {h.ds_id: h.name for h in self._engine.handles}
        what = "; ".join(f"rank {r}: {describe(names, row)}" for r, row in enumerate(rows))
        raise ScheduleMismatchError(
            f"z3ext: the ranks' next collectives differ ({what}). A rank ran a forward, a backward or a call the "
            "others did not (or in another order); every rank must make the same calls ([Note: one schedule on every "
            "rank] in deepspeed_z3ext/schedule.py). " + _presence_hint(rows) + off_plan_hint(rows, self.unplanned) +
            "Raised before the collective on "
            "every rank: the engine's state is not to be trusted after this")


def _presence_hint(rows) -> str:
    """[Note: presence in a reentrant checkpoint] Inside a backward, one rank's gradient reduce-scatter met another's
    all-gather: the ranks' gradients differ in presence where the backward's graph could not show it at the pass's
    start (a reentrant checkpoint's segment is one opaque node until its own backward runs) and z3ext's prediction
    missed it ([Note: presence behind a reentrant checkpoint] in grads.py: a module run inside the segment whose
    parameters get a gradient on some ranks only). Non-reentrant checkpointing keeps the segment's nodes in the
    graph: such programs train to DDP's numbers (tests/test_differential.py)."""
    kinds = {row[0] for row in rows}
    if not {1, 2} <= kinds or torch._C._current_graph_task_id() == -1:
        return ""
    return ("If every rank is in this backward: one reduces gradients where another gathers parameters, so the "
            "ranks' gradients differ in presence where the backward's graph hides them, behind a reentrant activation "
            "checkpoint (torch.utils.checkpoint with use_reentrant=True, DeepSpeed's activation checkpointing): a "
            "module run inside the segment whose parameters get a gradient on some ranks only; with "
            "use_reentrant=False (the default of HF's activation_checkpointing_enable) z3ext sees them ahead and "
            "trains such programs to DDP's numbers. ")


def off_plan_hint(rows, unplanned) -> str:
    """[Note: a module off the plan] in coordinator.py: where a rank's next collective gathers a module that no rank
    ran in the forward the ranks recorded together, why the others did not gather it, and what trains it.
    `unplanned(ds_id)`: the module of parameter `ds_id` where it is off the plan, else None."""
    if unplanned is None:
        return ""
    off = {}
    for r, row in enumerate(rows):
        name = unplanned(row[2]) if row[0] == 1 else None
        if name is not None:
            off.setdefault(name, []).append(r)
    if not off:
        return ""
    what = ", ".join(f"'{n}' (rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))})" for n, rs in off.items())
    return (f"The module gathered where the others differ, {what}, ran on no rank in the forward the ranks recorded "
            "together (the first training forward, or the first no_grad one): the ranks that do not run it now "
            "cannot know that another does. List it in z3ext.conditional_modules (gathered with its parent on "
            "every rank, zero gradients where it did not run), or run it on every rank in that first forward. ")


def describe(names, descriptor) -> str:
    """A collective's descriptor (kind, hpZ, first ds_id, elements, tensors) in words; `names`: ds_id -> name."""
    kind, secondary, first, numel, tensors = descriptor
    text = KINDS.get(kind, f"collective kind {kind}")
    if kind == 1:
        text += f" of {tensors} parameter(s), {numel} elements, from {_module(names, first)}"
        text += " over the node (hpZ)" if secondary else ""
    elif numel >= 0:
        text += f" of {numel} elements"
    return text


class RankAgreement:
    """The engine's ranks: the largest group its parameters are partitioned over (the data-parallel one)."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = _device(group)
        self.votes = 0
        self.preagreement: Optional[Preagreement] = None  # set on gloo ([Note: agree before the collective])
        self.progress = None  # the C++ Progress the hang watchdog reads ([Note: hang watchdog] in watchdog.py)
        self._gloo = {}       # id(group) -> whether its backend is gloo

    def collective(self, descriptor, issue, group=None):
        """Runs `issue(async_op)`, a collective over `group` (default: the engine's) described by `descriptor`
        (kind, hpZ, first ds_id, elements, tensors), recorded for the watchdog, after the ranks agree on it on gloo
        ([Note: agree before the collective]); a gloo host wait wakes for the watchdog ([Note: collective
        progress] in csrc/progress.h)."""
        group = self.group if group is None else group
        gloo = self._gloo.get(id(group))
        if gloo is None:
            gloo = self._gloo[id(group)] = dist.get_backend(group) == "gloo"
        progress = self.progress
        if progress is None:
            if self.preagreement is not None and gloo:
                self.preagreement.exchange(group, descriptor)
            return issue(False)
        index = progress.begin(descriptor)
        try:
            if self.preagreement is not None and gloo:
                self.preagreement.exchange(group, descriptor, progress)
            if gloo and not comms.enabled():  # the comms logger times a synchronous call, as stock's
                work = issue(True)
                if work is not None:
                    progress.wait(work)
                out = None
            else:
                out = issue(False)
        except BaseException:
            progress.end(index, _CPU)  # not pending: it raised
            raise
        progress.end(index, _CPU if gloo else self.device)
        return out

    def all_true(self, flags: List[bool], kind: int = 3) -> List[bool]:
        """Each flag ANDed over the ranks ([Note: one schedule on every rank]), over the host ([Note: votes on
        the host])."""
        if self.world == 1:
            return list(flags)
        self.votes += 1
        group = self._host_group()
        t = torch.tensor(flags, dtype=torch.int32, device=_CPU if group is not self.group else self.device)
        self.collective([kind, 0, -1, len(flags), 1],
                        lambda async_op: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=async_op), group)
        return [bool(v) for v in t.tolist()]

    def _host_group(self):
        """[Note: votes on the host] A vote's flags are read by the host at once: on an accelerator that is two
        host-device synchronisations (the flags' copy in, the result's out) on the path z3ext keeps free of
        them. On NCCL over the whole world the vote goes over a gloo group of the same ranks instead, made at
        the first vote (votes are rank-symmetric, so every rank makes it at the same point, as new_group
        requires; ordinary training never votes and never makes it). A smaller NCCL group votes on the device
        (its ranks alone cannot make a group of the world's)."""
        if self.device.type == "cpu" or dist.get_backend(self.group) != "nccl" or \
                self.world != dist.get_world_size():
            return self.group
        global _HOST_WORLD
        if _HOST_WORLD is None:
            try:
                _HOST_WORLD = dist.new_group(backend="gloo")
            except Exception as e:  # noqa: BLE001 (no gloo here: the device vote, as before)
                from deepspeed.utils import logger
                logger.warning(f"z3ext: no gloo group for the graph-death votes ({e}); they go over the device")
                _HOST_WORLD = False
        return _HOST_WORLD or self.group

    def agreed(self, what: str, values: List[int], minimum: Optional[int] = None, kind: int = 5) -> List[List[int]]:
        """Every rank's `values` (one tiny all-gather) for a call whose arguments shape the schedule
        ([Note: arguments that must agree]). Where they differ: with `minimum` (an index into `values`) the
        caller takes the smallest at that index (logged once per call site on rank 0), and any other
        difference raises `ScheduleMismatchError` on every rank, naming each rank's values."""
        rows = self.all_gather(values, kind=kind) if self.world > 1 else [list(values)]
        if all(r == rows[0] for r in rows):
            return rows
        rest = [[v for i, v in enumerate(r) if i != minimum] for r in rows]
        if any(r != rest[0] for r in rest):
            raise ScheduleMismatchError(f"z3ext: {what}: the ranks passed different values ("
                                        + "; ".join(f"rank {k}: {r}" for k, r in enumerate(rows))
                                        + "); every rank must make the same call ([Note: arguments that must agree] "
                                        "in deepspeed_z3ext/schedule.py)")
        if self.rank == 0:
            from deepspeed.utils import logger
            logger.warning(f"z3ext: {what}: the ranks passed different values ("
                           + ", ".join(f"rank {k}: {r[minimum]}" for k, r in enumerate(rows))
                           + f"); every rank uses the smallest, {min(r[minimum] for r in rows)}, so that they keep "
                           "the same units and issue the same collectives")
        return rows

    def all_gather(self, values: List[int], kind: int = 4) -> List[List[int]]:
        """`values` (the same length on every rank) of every rank, in rank order; `kind` names it to a
        preagreement (KINDS)."""
        return self.start_all_gather(values, kind).result()

    def start_all_gather(self, values: List[int], kind: int = 4) -> "Gathered":
        """The all-gather of `values` started: on an accelerator, issued and copied to pinned host memory
        behind the work already queued, so that neither this call nor a later `result()` waits for that
        work (the host would stall the step it is launching)."""
        n = len(values)
        src = torch.tensor(values, dtype=torch.int64)
        # The output starts as this rank's values in every row: a collective that does nothing (a simulated
        # world, bench/simworld) then reads as agreement, not as garbage.
        if self.device.type == "cpu":
            out = src.repeat(self.world)
            self.collective([kind, 0, -1, n, 1],
                            lambda async_op: dist.all_gather_into_tensor(out, src, group=self.group, async_op=async_op))
            return Gathered(out.view(self.world, n), None)
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        t = acc.pin_memory(src).to(self.device, non_blocking=True)
        out = t.repeat(self.world)
        self.collective([kind, 0, -1, n, 1],
                        lambda async_op: dist.all_gather_into_tensor(out, t, group=self.group, async_op=async_op))
        host = acc.pin_memory(torch.empty(self.world * n, dtype=torch.int64))
        host.copy_(out, non_blocking=True)
        ready = acc.Event()
        ready.record()
        return Gathered(host.view(self.world, n), ready)


class Gathered(NamedTuple):
    rows: torch.Tensor  # (world, n) on the host, complete once `ready` is
    ready: object       # an accelerator event, or None (already complete)

    def result(self) -> List[List[int]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.rows.tolist()


class _Pending(NamedTuple):
    where: str
    gathered: Gathered   # every rank's Fingerprint


class ScheduleCheck:
    """Compares the gather engine's fingerprint across the ranks ([Note: schedule check])."""

    def __init__(self, engine, agreement: RankAgreement, every_forward: bool):
        self._engine = engine     # the C++ GatherEngine
        self._agree = agreement
        self.every_forward = every_forward
        self.checks = 0
        self.seconds = 0.0  # host time in check()
        self._pending: Optional[_Pending] = None

    def check(self, where: str) -> None:
        """Compares the span the previous check started, and starts this one's comparison: on an
        accelerator the fingerprints travel while the step runs, and a mismatch raises at the next check."""
        t0 = time.perf_counter()
        try:
            self._check(where)
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self, where):
        pending, self._pending = self._pending, None
        if pending is not None:
            rows = [Fingerprint(*r) for r in pending.gathered.result()]
            if any(r[:3] != rows[0][:3] for r in rows):
                entries = self._engine.taken_schedule()  # the compared span's, set aside by take_schedule
                self._engine.reset_schedule()  # every rank raises from the same state
                self._raise(pending.where, rows, entries)
        count, digest, faults, logged = self._engine.take_schedule()
        if self._agree.world > 1:
            mine = Fingerprint(count, digest, faults, logged)
            self._pending = _Pending(where, self._agree.start_all_gather(list(mine)))
        self.checks += 1

    def _raise(self, where, rows, entries):
        longest = max(r.logged for r in rows)
        pad = [(0, -1)] * (longest - len(entries))
        flat = [v for e in list(entries) + pad for v in e]
        per_rank = [list(zip(r[0::2], r[1::2])) for r in self._agree.all_gather(flat)] if longest else [[]] * len(rows)
        first = next((i for i in range(longest) if len({tuple(p[i]) for p in per_rank}) > 1), None)
        names = {h.ds_id: h.name for h in self._engine.handles}
        counts = ", ".join(f"rank {r}: {row.count}" for r, row in enumerate(rows))
        where = f"up to the check {where}"
        if len({row.faults for row in rows}) > 1:
            raise ScheduleMismatchError(
                "z3ext: the ranks are out of step: an op raised on some ranks only since the last check ("
                + ", ".join(f"rank {r}: {row.faults}" for r, row in enumerate(rows)) + f" errors; {where}): a "
                "rank that caught its error and went on is a collective behind the others ([Note: one-rank "
                "faults] in deepspeed_z3ext/schedule.py). Let the error end the run on every rank, or raise "
                "it on all of them")
        if first is None:
            detail = (f"the first {longest} agree; they differ later" if longest else "")
        else:
            what = "; ".join(f"rank {r}: {_module(names, p[first][1])}" for r, p in enumerate(per_rank))
            detail = f"they first differ at collective {first}: {what}"
        raise ScheduleMismatchError(
            f"z3ext: the ranks issued different collectives (all-gathers, gradient reduce-scatters) since the last "
            f"check ({where}; collectives: {counts}); "
            f"{detail}. Every rank must make the same calls: something that differs between ranks decided "
            f"a gather ([Note: one schedule on every rank] in deepspeed_z3ext/schedule.py)")



def _module(names, ds_id) -> str:
    if ds_id < 0:
        return "nothing"
    name = names.get(ds_id, f"<ds_id {ds_id}>")
    module = name.rpartition(".")[0]
    return f"module '{module or '<root>'}' (parameter '{name}', ds_id {ds_id})"

