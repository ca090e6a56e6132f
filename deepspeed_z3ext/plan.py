"""ForwardPlan: the order in which modules fetched their units, recorded once and replayed to
gather upcoming units ahead of their modules.

[Note: forward plan] The first outermost forward of each grad mode (training forwards, and no_grad
forwards such as eval or generation, have different orders) is recorded: every module whose fetch
unit is non-empty, in fetch order, up to the next outermost forward; that includes the forwards
re-run by activation-checkpoint recomputation inside backward. A unit includes the module's external
parameters ([Note: external discovery]), so the plan also carries external dependencies. Later
forwards replay it with a cursor, and the coordinator gathers the units of the next modules ahead
of them ([Note: prefetch window]). A module the plan did not expect moves the cursor to its next
occurrence, or past the end (no more prefetch this forward); nothing raises. A forward that left
the plan becomes the plan for the next one of its grad mode (resynchronisation). Every rank runs the
same modules in the same order, so every rank builds the same batches.
"""
import enum
from typing import NamedTuple, Optional

from torch import is_grad_enabled


class PlanState(enum.Enum):
    RECORDING = 1
    REPLAYING = 2


class Divergence(NamedTuple):
    position: int      # where in the plan the cursor was
    expected: str      # the module the plan expected there ("<end>" past the end)
    got: str           # the module that fetched instead


class ForwardPlan:

    def __init__(self):
        self.state = PlanState.RECORDING
        self.order = []
        self.cursor = 0
        self.observed = []        # this forward's actual order
        self.skipped = []         # positions of `observed` this rank gathered for a module it did not run
        self.no_grad = []         # positions of `observed` fetched with grad mode off (a reentrant checkpoint's forward)
        self.grad_modes = {}      # id(module) -> the grad mode the plan's forward ran it in, where it ran in one only
        #                           ([Note: skipped with the runner's grad mode] in coordinator.py)
        self.members_without_grad = []  # group members that ran with grad mode off (their owner fetched them)
        self.conditional_ran = {}  # id of a declared conditional module that ran -> with grad mode on (coordinator.py)
        self.divergence: Optional[Divergence] = None  # this forward's first divergence
        self.diverged_forwards = 0
        self.resyncs = 0
        self.recording = True
        # id(module) -> [module, len(observed) at its first forward's start, at its end]: where each
        # module's first forward sits in the recorded order ([Note: fetch groups] in groups.py)
        self.spans = {}
        self.forward_len = None   # positions of the outermost forward itself (the rest: recomputation in backward)
        self.observed_forward_len = None  # this forward's
        self.agreed = False       # recorded by the ranks together ([Note: forwards that differ by rank])
        self.diverged_recording = False  # ... and the ranks ran different modules then
        self._scan = None  # [order, positions scanned, first position `follows` looks for, id -> last position]

    def start_forward(self):
        """An outermost forward starts: the previous one's order becomes the plan if it was the
        first or if it diverged."""
        if self.observed and (self.state is PlanState.RECORDING or self.divergence is not None):
            if self.state is PlanState.REPLAYING:
                self.resyncs += 1
            self.order = self.observed
            self.forward_len = self.observed_forward_len
            self.grad_modes = _grad_modes(self.observed[:self.forward_len], self.no_grad)
            self.state = PlanState.REPLAYING
            self.recording = False
        self.observed = []
        self.skipped = []
        self.no_grad = []
        self.members_without_grad = []
        self.conditional_ran = {}
        self.cursor = 0
        self.divergence = None
        self._scan = None  # (what `follows` looks for may change between forwards: a parameter frozen)

    def follows(self, module, first) -> bool:
        """Whether `module`'s last position in the plan (while recording: in the order recorded so far) is at or
        after the first position of a module for which `first(module)` holds. Scanned once per forward: while
        recording the order only grows, and the scan goes on from where it stopped."""
        order = self.observed if self.recording else self.order
        scan = self._scan
        if scan is None or scan[0] is not order:
            scan = self._scan = [order, 0, None, {}]
        _, done, found, last = scan
        for i in range(done, len(order)):
            m = order[i]
            last[id(m)] = i
            if found is None and first(m):
                found = i
        scan[1], scan[2] = len(order), found
        p = last.get(id(module))
        return found is not None and p is not None and p >= found

    def ahead(self, module) -> Optional[int]:
        """While replaying: the next position of `module` at or after the cursor, or None."""
        order = self.order
        return next((i for i in range(self.cursor, len(order)) if order[i] is module), None)

    def end_forward(self):
        """The outermost forward returned: what its own forward fetched (not a recomputation in backward)."""
        self.observed_forward_len = len(self.observed)

    def skip_last(self):
        """The module observed last was gathered for a forward this rank skips ([Note: forwards that differ by rank]
        in coordinator.py)."""
        self.skipped.append(len(self.observed) - 1)

    def ran_without_grad(self):
        """The modules this rank ran with grad mode off in this forward ([Note: presence behind a reentrant
        checkpoint] in grads.py)."""
        skipped = set(self.skipped)
        return [self.observed[i] for i in self.no_grad if i not in skipped] + self.members_without_grad

    def enter(self, module):
        """While recording: a module's forward starts."""
        self.spans.setdefault(id(module), [module, len(self.observed), None])

    def leave(self, module):
        """While recording: a module's forward ends."""
        span = self.spans.get(id(module))
        if span is not None and span[2] is None:
            span[2] = len(self.observed)

    def observe(self, module, grad_enabled=None) -> Optional[int]:
        """Called at each forward fetch of a non-empty unit (`grad_enabled`: the grad mode it ran in, where not the
        current one); returns the plan position after this module while replaying (None while recording)."""
        self.observed.append(module)
        if not (is_grad_enabled() if grad_enabled is None else grad_enabled):
            self.no_grad.append(len(self.observed) - 1)
        if self.state is PlanState.RECORDING:
            return None
        order, c = self.order, self.cursor
        if c < len(order) and order[c] is module:
            self.cursor = c + 1
            return self.cursor
        if self.divergence is None:
            self.divergence = Divergence(c, _name(order[c]) if c < len(order) else "<end>", _name(module))
            self.diverged_forwards += 1
        # By identity, never `list.index`: its miss formats repr(module), whose extra_repr can read
        # parameters through the external-parameter getter (registering spurious externals).
        self.cursor = next((i + 1 for i in range(c, len(order)) if order[i] is module), len(order))
        return self.cursor


def _grad_modes(order, no_grad):
    off, modes = set(no_grad), {}
    for i, m in enumerate(order):
        mode = i not in off
        modes[id(m)] = mode if modes.get(id(m), mode) == mode else None
    return {k: v for k, v in modes.items() if v is not None}


def _name(module):
    return f"{type(module).__name__}(ds_id {getattr(module, 'ds_id', '?')})"


def fill_siblings(order, root, end=None, lists=True, expand=None):
    """`order` with the members of a list or dict of like modules (an `nn.ModuleList` of layers, an `nn.ModuleDict`
    of heads) that no rank ran while it was recorded inserted where they belong, by analogy with a member that ran:
    LayerDrop may drop a layer on every rank in the recorded forward and run it later, and a task's head first
    chosen at a later batch may be chosen by some ranks only ([Note: forwards that differ by rank], [Note: a dict of
    like modules] in coordinator.py). `end`: the outermost forward's positions (the rest recomputation; None: not
    known yet). `lists`: ModuleLists too, not only ModuleDicts. `expand(module)`: the modules a position stands for
    (a fetch group's owner: its members), copied one by one. Returns the order and its new end, the modules inserted
    at or before the end counted in it."""
    import torch.nn as nn
    names = {id(m): n for n, m in root.named_modules()}
    by_name = {n: m for n, m in root.named_modules()}
    kinds = (nn.ModuleList, nn.ModuleDict) if lists else (nn.ModuleDict, )
    for container in root.modules():
        if not isinstance(container, kinds) or len(container) < 2:
            continue
        members = list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
        if len({type(m) for m in members}) != 1:
            continue
        inside = [{id(x) for x in m.modules()} for m in members]
        runs = [[i for i, x in enumerate(order) if id(x) in ins] for ins in inside]
        present = [k for k, r in enumerate(runs) if r]
        if not present or len(present) == len(members):
            continue
        t = present[0]
        if runs[t] != list(range(runs[t][0], runs[t][-1] + 1)):
            continue  # its modules are not one run of the plan: no place to copy
        prefix_t = names[id(members[t])]
        template = [names[id(x)][len(prefix_t):] for i in runs[t] for x in (expand(order[i]) if expand else [order[i]])]
        inserts = {}  # plan position -> modules to insert before it
        for k in range(len(members)):
            if runs[k]:
                continue
            copy = [by_name.get(names[id(members[k])] + rest) for rest in template]
            if any(m is None or not hasattr(m, "ds_id") for m in copy):
                continue  # (a member without hooks of its own: a conditional module, gathered with its parent)
            before = next((runs[j][-1] + 1 for j in range(k - 1, -1, -1) if runs[j]), None)
            at = before if before is not None else next(runs[j][0] for j in range(k + 1, len(members)) if runs[j])
            inserts.setdefault(at, []).extend(copy)
        if inserts:
            out = []
            for i in range(len(order) + 1):
                out.extend(inserts.get(i, ()))
                if i < len(order):
                    out.append(order[i])
            if end is not None:
                end += sum(len(ms) for at, ms in inserts.items() if at <= end)
            order = out
    return order, end
