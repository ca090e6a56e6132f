"""ForwardPlan: the order in which modules fetched their units in a recorded forward, replayed to
gather several upcoming units with one collective.

[Note: forward plan] The first outermost forward of an engine is recorded (modules whose unit is
non-empty, in fetch order); every later forward replays it with a cursor. When a module's unit must
be gathered, the units of the next modules in the plan are gathered in the same collective, up to
`stage3_prefetch_bucket_size` elements, and claimed for those modules' forwards (released as usual
at their post-forward hooks, or swept before the next outermost forward if they never run). A
module the plan did not expect moves the cursor to its next occurrence, or past the end (no more
prefetch this forward); nothing raises. Every rank runs the same modules in the same order, so
every rank builds the same batches.
"""
import enum


class PlanState(enum.Enum):
    RECORDING = 1
    REPLAYING = 2


class ForwardPlan:

    def __init__(self, bucket_numel):
        self.bucket_numel = bucket_numel
        self.state = PlanState.RECORDING
        self.order = []
        self.cursor = 0
        self.diverged = 0  # forwards that left the plan (for stats/debugging)

    def start_forward(self):
        if self.state is PlanState.RECORDING and self.order:
            self.state = PlanState.REPLAYING
        self.cursor = 0

    def observe(self, module):
        """Called at each forward fetch; returns the modules expected next (replay only)."""
        if self.state is PlanState.RECORDING:
            self.order.append(module)
            return []
        order, c = self.order, self.cursor
        if c < len(order) and order[c] is module:
            self.cursor = c + 1
        else:
            self.diverged += 1
            try:
                self.cursor = order.index(module, c) + 1
            except ValueError:
                self.cursor = len(order)
        return order[self.cursor:]
