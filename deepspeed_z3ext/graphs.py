"""BackwardClaims: Backward claims owned by what needs them, the autograd graph of one forward call
and one backward pass, not by a module.

[Note: graph claims] Holding a module's parameters from its forward to its backward is what makes
z3ext's forward cheap (no per-module backward hooks for held modules). The hold belongs to the
autograd graph that saved those parameters, and ends only when that graph cannot use them again:
- A grad-enabled outermost forward opens a *graph* (a token) at its first hold; every module held
  during it takes one Backward claim owned by that token (a module applied twice shares it). When
  the outermost forward returns, the graph is *sealed*: a pre-hook is put on the grad_fn of each
  output that needs grad (outputs walked at any depth). A graph with no such output can never run
  backward: its claims are dropped at once (an evaluation forward without `no_grad`).
- A backward that executes any of the graph's output nodes ends the graph: its claims are dropped
  when that backward pass completes (an autograd engine callback). Which outputs a rank's loss
  reaches may differ by rank (BART's encoder output, which a decoder that dropped every layer never
  reads); that a backward ran through the forward's outputs does not, so the graph ends on every
  rank at the same pass and the set of sealed graphs, which the votes below walk, stays the same on
  every rank. A later backward through an output the first one did not reach would find the held
  parameters released: it raises, naming the output ([Note: one backward per graph]).
- A graph whose output nodes were all freed without such a backward (the loss abandoned) is
  dropped at the next outermost forward or backward end once it is dead on every rank, or at the step: the
  pre-hooks share a sentinel whose finaliser queues the token (no engine call from a finaliser: it may
  run anywhere), and the ranks vote on the queued deaths ([Note: one schedule on every rank] in
  schedule.py). When a rank drops an output is its own business; what is gathered next is not.
- Another forward, with or without grad, of the same or other modules, never drops a graph's
  claims (the DPO reference forward, a teacher forward). The optimizer step drops all of them: the
  step rewrites partitions, so a full parameter held across it would be stale.
Claims taken inside a backward pass (a not-held module re-gathered for its backward, a module held
through activation-checkpoint recomputation) are owned by per-call tokens registered with that
pass: dropped by the module's own input hooks, and at the latest when the pass completes, or when
the next outermost forward starts outside any backward (a pass that raised never completes).
Early: never for the backward that ends a graph (a claim ends only after the graph or the call that owns it
is done); a later backward through outputs it did not reach raises ([Note: one backward per graph]); late: a
graph whose outputs no backward reaches keeps its claims until it is freed on every rank or the step.
A backward with `retain_graph=True` followed by a second backward through the same held modules is
not supported (the first pass ends the graph's claims).

[Note: one backward per graph] A graph ends with the first backward pass that reaches one of its
outputs. An output that pass did not reach keeps its pre-hook; if a later backward reaches it, the
modules it runs through may have been released, so the hook raises a Z3extError naming the output and
what to do (one backward through all of a forward's losses, or the loss of each output from its own
forward) rather than let autograd fail on an empty parameter or, for DeepSpeed's linear, gather it
alone in backward. Ending the graph only once every output was reached would keep it claimed on a
rank whose loss skipped an output and not on the others: their next gathers would differ.
"""
import collections
import dataclasses
import enum
import weakref
from typing import Dict, List, Optional

import torch
from deepspeed.utils import z3_leaf_module

from deepspeed_z3ext import claims


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class Phase(enum.Enum):
    """Where a module forward runs."""
    FORWARD = 1    # outside any backward pass: a grad-enabled one may hold for its graph
    RECOMPUTE = 2  # inside a backward pass: activation-checkpoint recomputation


def forward_phase() -> Phase:
    return Phase.RECOMPUTE if in_backward() else Phase.FORWARD


class GraphState(enum.Enum):
    OPEN = 1    # its outermost forward is running: holds join it
    SEALED = 2  # the forward returned: waiting for a backward through its outputs (or its death)


class _Graph:
    __slots__ = ("token", "state", "held", "held_numel", "sentinel", "reached")

    def __init__(self, token):
        self.token = token
        self.state = GraphState.OPEN
        self.held = set()  # ids of modules holding a claim of this graph
        self.held_numel = 0  # their units' elements
        self.sentinel = None  # a weak reference to its outputs' _Sentinel (a strong one would keep it alive)
        self.reached = []  # outputs the ending backward executed


class _Sentinel:
    """Shared by a graph's output pre-hooks; dies with the last of its output nodes."""
    __slots__ = ("token", "dead", "reached", "__weakref__")

    def __init__(self, token, dead):
        self.token, self.dead = token, dead
        self.reached = None  # once the graph ended: the outputs its backward reached ([Note: one backward per graph])

    def __del__(self):
        self.dead.append(self.token)  # deque.append is atomic: safe from any thread


class _RootHook:
    """Pre-hook on one output node of a sealed graph."""
    __slots__ = ("claims", "token", "index", "sentinel")

    def __init__(self, claims, token, index, sentinel):
        self.claims, self.token, self.index, self.sentinel = claims, token, index, sentinel

    def __call__(self, grad_outputs):
        ended = self.sentinel.reached
        if ended is not None and self.index not in ended:
            from deepspeed_z3ext.errors import Z3extError
            raise Z3extError(
                f"z3ext: a backward reached output {self.index} of a forward whose graph an earlier backward "
                f"already ended (it reached output(s) {ended} of that forward, not this one): the parameters "
                "the forward held for backward were released when that pass completed ([Note: one backward per "
                "graph] in deepspeed_z3ext/graphs.py). Backward once through a loss that sums every output's "
                "loss, or compute each output from its own forward")
        self.claims._reached(self.token, self.index)
        return None


class BackwardClaims:
    """Tokens for Backward claims and when they end, for one coordinator."""

    def __init__(self, engine, agreement):
        self._engine = engine      # the C++ GatherEngine
        self._agree = agreement    # schedule.RankAgreement: the vote on graph deaths
        self._kind = claims.BACKWARD
        self._next = claims.TOKEN_BASE  # tokens never collide with module ds_ids ([Note: claim owners])
        self.open: Optional[_Graph] = None
        self._sealed: Dict[int, _Graph] = {}
        self._dead = collections.deque()  # tokens whose sentinel died (appended by finalisers)
        self._dead_here = set()  # sealed graphs dead on this rank, not yet on every rank
        self._ending: Dict[int, _Graph] = {}  # sealed graphs a running backward reached: they end with its pass
        self._passes: Dict[int, List[int]] = {}  # graph task id -> tokens to drop when it completes

    def new_token(self) -> int:
        self._next += 1
        return self._next

    # -- graphs of forward calls -----------------------------------------------------------------
    def graph(self) -> _Graph:
        """The graph of the running outermost forward, opened at its first hold."""
        if self.open is None:
            self.open = _Graph(self.new_token())
        return self.open

    def seal(self, output_nodes) -> None:
        """The outermost forward returned with these grad_fn nodes as outputs that need grad."""
        g, self.open = self.open, None
        if g is None:
            return
        if not output_nodes or not g.held:
            self._drop([g.token])
            return
        g.state = GraphState.SEALED
        self._sealed[g.token] = g
        sentinel = _Sentinel(g.token, self._dead)
        g.sentinel = weakref.ref(sentinel)
        for i, node in enumerate(output_nodes):
            node.register_prehook(_RootHook(self, g.token, i, sentinel))

    def _reached(self, token, index):
        """A backward executes an output node of graph `token`: the graph ends when that pass completes, the
        first pass to reach any of its outputs ([Note: one backward per graph])."""
        g = self._sealed.pop(token, None)
        if g is not None:
            self._dead_here.discard(token)
            self.on_pass_end(token)
            self._ending[token] = g
        else:
            g = self._ending.get(token)
        if g is not None:
            g.reached.append(index)

    def _ended(self, token):
        """The pass that reached graph `token` completed: outputs it did not reach refuse a later backward."""
        g = self._ending.pop(token)
        sentinel = g.sentinel()
        if sentinel is not None:
            sentinel.reached = sorted(set(g.reached))

    # -- tokens of one backward pass -------------------------------------------------------------
    def on_pass_end(self, token) -> None:
        """`token`'s claims end when the running backward pass completes (outside a pass: at the next outermost
        forward, `start_forward`)."""
        task = torch._C._current_graph_task_id()
        tokens = self._passes.get(task)
        if tokens is None:
            tokens = self._passes[task] = []
            if task >= 0:
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_pass(task))
        tokens.append(token)

    def _end_pass(self, task):
        tokens = self._passes.pop(task, ())
        for t in tokens:
            if t in self._ending:
                self._ended(t)
        self._drop(tokens)

    def drop(self, token) -> None:
        self._drop([token])

    def _drop(self, tokens):
        if tokens:
            self._engine.drop_owners(self._kind, list(tokens))

    # -- between forwards --------------------------------------------------------------------------
    def collect(self) -> None:
        """Drops the graphs whose outputs were freed without a backward through any of them, on every
        rank: a vote while any graph is sealed ([Note: one schedule on every rank] in schedule.py)."""
        dead, here, sealed = self._dead, self._dead_here, self._sealed
        while dead:
            t = dead.popleft()
            if t in sealed:
                here.add(t)
        if not sealed:
            return
        tokens = sorted(sealed)
        agreed = self._agree.all_true([t in here for t in tokens])
        gone = [t for t, d in zip(tokens, agreed) if d]
        for t in gone:
            del sealed[t]
            here.discard(t)
        self._drop(gone)

    def start_forward(self) -> None:
        """An outermost forward starts: a forward that raised left its graph open (no outputs), and
        outside any backward no pass is running, so tokens of passes that raised end here too."""
        if self.open is not None:
            g, self.open = self.open, None
            self._drop([g.token])
        if not in_backward() and self._passes:
            tokens = [t for ts in self._passes.values() for t in ts]
            self._passes.clear()
            self._ending.clear()
            self._drop(tokens)
        if not in_backward():  # (a recomputation inside a backward decides nothing)
            self.collect()

    def forget_all(self) -> None:
        """The optimizer step swept every Backward claim: no graph or pass holds anything now."""
        self.open = None
        self._sealed.clear()
        self._passes.clear()
        self._ending.clear()
        self._dead.clear()
        self._dead_here.clear()

    def held_by_graph(self, module) -> bool:
        key = id(module)
        return (self.open is not None and key in self.open.held) or any(key in g.held for g in self._sealed.values())

    def live_graphs(self) -> int:
        return len(self._sealed) + (self.open is not None)


def tensors_in(value, depth=0):
    """The tensors in a module's inputs or outputs, at any nesting."""
    if torch.is_tensor(value):
        return [value]
    out = []
    if depth > 32:  # a cyclic structure: no module returns one deliberately
        return out
    if isinstance(value, (tuple, list)):
        items = value
    elif isinstance(value, dict):  # HF ModelOutput is an OrderedDict (and a dataclass)
        items = value.values()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        return out
    for v in items:
        if torch.is_tensor(v):
            out.append(v)
        elif v is not None and not isinstance(v, (int, float, str, bool)):
            out.extend(tensors_in(v, depth + 1))
    return out


def grad_nodes(tensors) -> list:
    """The distinct grad_fn nodes of the tensors that need grad (leaves have none)."""
    nodes, seen = [], set()
    for t in tensors:
        node = t.grad_fn if t.requires_grad else None
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
    return nodes


def claim_per_call(coord, module, token, args, outputs, gathered):
    """Backward claim `token` of one call of `module`: gathered when the first of its outputs'
    gradients arrives (unless `gathered`: held since its forward), dropped once every input's
    gradient is complete (after this call's backward; later than stock when an input has other
    consumers, never earlier). A call whose inputs need no grad keeps it to the end of the pass.
    `args`: the call's inputs as passed (walked here: only calls that are not held pay for it)."""
    ins = [t for t in tensors_in(args) if t.requires_grad]
    state = [gathered, len(ins)]  # [claimed, inputs still waiting for their gradient]
    if not gathered:
        def before(grad):
            if not state[0]:
                state[0] = True
                coord.fetch_for_backward(module, token)

        for t in outputs:
            if t.requires_grad:
                t.register_hook(before)

    def after(grad):
        state[1] -= 1
        if state[1] == 0 and state[0]:
            coord.release_for_backward(module, token)

    if z3_leaf_module(module):
        # DeepSpeed reduces a z3 leaf's gradients in a full backward hook that runs after its inputs'
        # gradients (zeros for the parameters a routed forward skipped, shaped like the parameter):
        # the claim ends with the pass.
        return
    for t in ins:
        t.register_hook(after)
