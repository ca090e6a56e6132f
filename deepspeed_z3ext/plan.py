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
        self.divergence: Optional[Divergence] = None  # this forward's first divergence
        self.diverged_forwards = 0
        self.resyncs = 0
        self.recording = True
        # id(module) -> [module, len(observed) at its first forward's start, at its end]: where each
        # module's first forward sits in the recorded order ([Note: fetch groups] in groups.py)
        self.spans = {}

    def start_forward(self):
        """An outermost forward starts: the previous one's order becomes the plan if it was the
        first or if it diverged."""
        if self.observed and (self.state is PlanState.RECORDING or self.divergence is not None):
            if self.state is PlanState.REPLAYING:
                self.resyncs += 1
            self.order = self.observed
            self.state = PlanState.REPLAYING
            self.recording = False
        self.observed = []
        self.cursor = 0
        self.divergence = None

    def enter(self, module):
        """While recording: a module's forward starts."""
        self.spans.setdefault(id(module), [module, len(self.observed), None])

    def leave(self, module):
        """While recording: a module's forward ends."""
        span = self.spans.get(id(module))
        if span is not None and span[2] is None:
            span[2] = len(self.observed)

    def observe(self, module) -> Optional[int]:
        """Called at each forward fetch of a non-empty unit; returns the plan position after this
        module while replaying (None while recording)."""
        self.observed.append(module)
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


def _name(module):
    return f"{type(module).__name__}(ds_id {getattr(module, 'ds_id', '?')})"
