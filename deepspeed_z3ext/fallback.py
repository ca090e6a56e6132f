"""Z3extEagerFallback: parameters read by frames that Dynamo skipped, under DeepCompile, held by claims.

With `"compile": {"deepcompile": true}` and `engine.compile()`, DeepCompile's graphs gather and release
parameters with their own ops and DeepSpeed's module hooks are removed. A frame that Dynamo skips (a
`torch.compiler.disable`d submodule, a graph break) runs eagerly with nothing gathering for it.
DeepSpeed's seam for that case is its eager fallback: inside `engine.forward` the `ZeROOrderedDict`
getter asks the engine's fallback object what to do with each parameter it hands out. For a z3ext
engine that object is this one (dispatched at its construction, `new_fallback`), and it answers with
claims on the engine's GatherEngine.

[Note: eager fallback claims]
- Every outermost `engine.forward` is a *forward graph* with its own id. A parameter the skipped frame
  reads is claimed `(FALLBACK, graph id)`: gathered if it was partitioned (the getter's `all_gather()`
  takes a Direct claim, which is turned into the fallback claim at once), only claimed if something
  else had it gathered (a `GatheredParameters` block, persistence): autograd saves leaf parameters
  by reference and reads `.data` in backward, so whatever gathered it, the graph needs it until its
  backward is done.
- Lookups made by Dynamo's guard evaluation never gather: DeepSpeed's getter detects them (a frame of
  `torch._dynamo.guards` on the stack; `torch.compiler.is_compiling()` is false there) and reports
  them here. Should that detection stop matching on a future torch, the lookup is taken for an eager
  access: an extra gather, released like any other, never a missing one.
- The claims of a graph are dropped when its backward completes (DeepCompile's post-backward hook),
  after the gradients the eager frame left on those parameters were reduce-scattered into the
  stage-3 optimizer's gradient partitions (see [Note: eager fallback gradients]).
- If backward never runs (eval, an abandoned loss) the graph's claims are dropped at the next
  outermost forward, before anything runs, so compiled graphs see partitioned parameters again. A
  graph whose output needs grad is remembered (its parameters, not its claims): if its backward
  does start later (two forwards, one loss), the parameters are claimed and gathered again at that
  moment, before any eager backward node reads them. Remembered graphs are forgotten once the
  optimizer has stepped.
- Only the fallback's own claims are ever dropped: a parameter that a `GatheredParameters` block,
  persistence, a direct `all_gather()` or DeepCompile's selective gather (its own buffers, never
  `.data`) keeps gathered stays gathered. Nothing is released by looking at `ds_status`.

[Note: eager fallback gradients] DeepCompile removes the stage-3 optimizer's gradient hooks; its
compiled backward reduce-scatters the gradients of the parameters in its graphs into the optimizer's
partitions. A parameter used only by a skipped frame gets a full gradient on `.grad` that nobody
reduces, and the optimizer would step on a stale partition. The fallback reduce-scatters those
gradients (averaged over the parameter's process group, DeepSpeed's `reduce_scatter_coalesced`, in
ds_id order so every rank issues the same collectives) into the partitions when the backward
completes: copied on the first backward after an optimizer step, accumulated after that, as stock
ZeRO-3 does, and `.grad` is freed.

[Note: per-engine compiler state] The fallback lives on its engine (`engine._deepcompile_z3_eager_fallback`,
where DeepSpeed keeps it) and holds its engine and z3ext state weakly; graph ids, claims and the
accumulation record are its own. DeepSpeed calls every engine's post-backward hook on any engine's
backward: a fallback only completes graphs whose backward it saw start. DeepSpeed's module-global
active fallback is set for the dynamic extent of this engine's forward and restored after it.
`engine.destroy()` drops every claim and takes the engine's entries out of DeepCompile's
process-global backward hook lists (its post-backward hook, and the pre-backward hook init_z3 adds for
its optimizer, which otherwise keep a destroyed engine alive and run on every later backward).
Settings DeepCompile changes for the whole process and never restores (`torch._inductor.config.
size_asserts`) are owned by the compiled z3ext engines together: the value from before the first
one is restored when the last one is destroyed, not before. (DeepSpeed already reference-counts its
Dynamo parameter-shape settings the same way.) The seams installed at import are process-wide and
fall through for everything that is not z3ext's.
"""
import contextlib
import enum
import weakref
from typing import Dict, List, NamedTuple, Optional

import torch

from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

from deepspeed_z3ext import claims, master
from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext.state import STATE_ATTR, of_engine, offload_of


class _SharedSettings:
    """Process-wide settings DeepCompile's init_z3 changes without restoring, owned jointly by the open
    z3ext fallbacks ([Note: per-engine compiler state])."""
    owners = set()  # ids of open fallbacks
    saved = {}  # setting name -> value before the first owner

    @classmethod
    def acquire(cls, owner):
        if not cls.owners:
            cls.saved = {}
            try:
                import torch._inductor.config as inductor_config
                cls.saved["size_asserts"] = inductor_config.size_asserts
            except Exception:  # no inductor in this torch build: nothing to restore
                pass
        cls.owners.add(id(owner))

    @classmethod
    def release(cls, owner):
        cls.owners.discard(id(owner))
        if cls.owners or not cls.saved:
            return
        import torch._inductor.config as inductor_config
        inductor_config.size_asserts = cls.saved.pop("size_asserts")


def _holds(fn, obj):
    """Whether a hook closure captured `obj` (how init_z3's per-engine backward hook is recognised)."""
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            if cell.cell_contents is obj:
                return True
        except ValueError:  # empty cell
            pass
    return False


def _in_autograd():
    """Whether the autograd engine is executing a backward on this thread (unknown: False)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class GraphPhase(enum.Enum):
    FORWARD = 1  # its outermost forward ran; outputs not known to need grad (yet)
    AWAITING_BACKWARD = 2  # an output needs grad: backward may still start
    IN_BACKWARD = 3  # backward reached its outputs: claims held until the backward completes


class FallbackStats(NamedTuple):
    enabled: bool
    gathered_params: int  # parameters the fallback gathered (partitioned when a skipped frame read them)
    claimed_params: int  # reads of parameters already gathered by something else (claimed, not gathered)
    guard_lookups: int  # lookups by Dynamo guard evaluation, left partitioned
    regathered_params: int  # parameters gathered again when a remembered graph's backward started
    reduced_grads: int  # gradients reduce-scattered into the optimizer's partitions
    released_params: int  # parameters released when the fallback dropped its claims
    graphs: Dict[int, str]  # live forward graphs: id -> phase name
    claimed: Dict[int, List[str]]  # graph id -> names of the parameters it holds a claim on now


class _Graph:
    __slots__ = ("gid", "phase", "params", "claimed", "step")

    def __init__(self, gid, step):
        self.gid = gid
        self.phase = GraphPhase.FORWARD
        self.params = {}  # ds_id -> parameter read by a skipped frame
        self.claimed = True  # holds its FALLBACK claims (False once a later forward dropped them)
        self.step = step  # engine.global_steps when it ran


class Z3extEagerFallback:
    """DeepSpeed's eager-fallback interface (forward_context, record_*, complete_backward, stats) on
    z3ext claims. See [Note: eager fallback claims]."""

    def __init__(self, engine, state, enabled: bool):
        self.enabled = enabled
        self._engine = weakref.ref(engine)
        self._state = weakref.ref(state)
        self._kind, self._direct = claims.FALLBACK, claims.DIRECT
        self._depth = 0
        self._next_gid = 0
        self._current: Optional[_Graph] = None  # the graph of the running (or last) outermost forward
        self._graphs: Dict[int, _Graph] = {}
        self._units = {}  # ds_id -> FetchUnit of that one parameter
        self._acc_step = None  # engine.global_steps of the accumulated gradient partitions
        self._acc_ids = set()  # ds_ids whose partition already holds this step's gradient
        self._closed = False
        _SharedSettings.acquire(self)
        self._n = dict(gathered=0, claimed=0, guard=0, regathered=0, reduced=0, released=0)

    # -- forward ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self):
        if not self.enabled or self._closed or self._state() is None:
            yield
            return
        previous = private.active_fallback()
        self._depth += 1
        outermost = self._depth == 1
        try:
            if outermost:
                self._begin_forward()
            private.set_active_fallback(self)
            yield
        finally:
            private.set_active_fallback(previous)
            self._depth -= 1
            if outermost:
                self._set_in_forward(False)

    def _begin_forward(self):
        """Drops the claims of earlier graphs whose backward has not started ([Note: eager fallback
        claims]), then opens a new graph and lets the getter see this forward."""
        engine = self._engine()
        step = engine.global_steps if engine is not None else 0
        in_autograd = _in_autograd()
        for gid in sorted(self._graphs):
            g = self._graphs[gid]
            if g.phase is GraphPhase.IN_BACKWARD:
                if in_autograd:
                    continue  # a forward inside a running backward (e.g. recomputation)
                g.phase = GraphPhase.FORWARD  # its backward raised before completing: forget it
            self._drop_claims(g)
            if g.phase is GraphPhase.FORWARD or not g.params or g.step != step:
                del self._graphs[gid]
        g = _Graph(self._next_gid, step)
        self._next_gid += 1
        self._graphs[g.gid] = g
        self._current = g
        self._set_in_forward(True)

    def _set_in_forward(self, on):
        engine = self._engine()
        if engine is None:
            return
        for module in engine.module.modules():
            if on:
                ensure_zero_ordered_dict(module)
            if isinstance(module._parameters, ZeROOrderedDict):
                module._parameters._in_forward = on

    def _unit(self, state, param):
        unit = self._units.get(param.ds_id)
        if unit is None:
            unit = self._units[param.ds_id] = state.unit_of([param])
        return unit

    def _mine(self, param):
        state = self._state()
        if state is None or self._current is None or getattr(param, STATE_ATTR, None) is not state:
            return None
        return state

    def record_gathered_param(self, param):
        """The getter just gathered `param` with its `all_gather()` (a Direct claim, just taken: the
        parameter was partitioned, so no one else held one); the claim becomes this graph's."""
        state = self._mine(param)
        if state is None:
            return  # another engine's parameter: its Direct claim ends at that engine's next step
        g, unit = self._current, self._unit(state, param)
        state.engine.unshard(unit, self._kind, g.gid)
        state.engine.reshard(unit, self._direct, claims.SHARED_OWNER)
        g.params[param.ds_id] = param
        self._n["gathered"] += 1

    def record_param_access(self, param):
        """A skipped frame read a parameter that is already gathered: claim it for this graph."""
        state = self._mine(param)
        if state is None:
            return
        g = self._current
        if param.ds_id in g.params and g.claimed:
            return
        state.engine.unshard(self._unit(state, param), self._kind, g.gid)
        g.params[param.ds_id] = param
        self._n["claimed"] += 1

    def record_guard_suppressed_param(self, param):
        self._n["guard"] += 1

    def record_forward_graph(self):
        """Called by `engine.forward` when an output needs grad: the graph awaits its backward."""
        g = self._current
        if not self.enabled or g is None or g.gid not in self._graphs:
            return None
        g.phase = GraphPhase.AWAITING_BACKWARD
        return g.gid

    # -- backward --------------------------------------------------------------------------------
    def record_backward_start(self, gid):
        """Backward reached an output of graph `gid`: its parameters are needed from here on."""
        g = self._graphs.get(gid)
        state = self._state()
        if g is None or state is None or g.phase is not GraphPhase.AWAITING_BACKWARD:
            return
        if g.params:
            # Claimed again whether or not a later forward dropped the claims: unshard only claims what
            # is held already, and gathers (in ds_id order, the same on every rank) what is not,
            # e.g. after an optimizer step swept every claim.
            params = [g.params[i] for i in sorted(g.params)]
            self._n["regathered"] += state.engine.unshard(state.unit_of(params), self._kind, gid)
        g.claimed = True
        g.phase = GraphPhase.IN_BACKWARD

    def complete_backward(self):
        """DeepCompile's post-backward hook: reduce the skipped frames' gradients, drop the claims of
        every graph whose backward ran ([Note: eager fallback gradients])."""
        done = [self._graphs[gid] for gid in sorted(self._graphs) if self._graphs[gid].phase is GraphPhase.IN_BACKWARD]
        if not done:
            return
        params = {}
        for g in done:
            params.update(g.params)
        self._reduce_grads([params[i] for i in sorted(params)])
        for g in done:
            self._drop_claims(g)
            del self._graphs[g.gid]

    def release_gathered_params(self):
        """Drops every claim of this fallback and forgets every graph (pending backward abandoned)."""
        for gid in sorted(self._graphs):
            self._drop_claims(self._graphs[gid])
        self._graphs.clear()

    def _drop_claims(self, g):
        state = self._state()
        if not g.claimed or state is None:
            return
        g.claimed = False
        if g.params:
            params = [g.params[i] for i in sorted(g.params)]
            self._n["released"] += state.engine.reshard(state.unit_of(params), self._kind, g.gid)

    @torch.no_grad()
    def _reduce_grads(self, params):
        engine = self._engine()
        optimizer = getattr(engine, "optimizer", None) if engine is not None else None
        partitions = private.grad_partitions(optimizer)
        # Full gradients only: a parameter that a compiled graph also used gets its (empty) gradient
        # from DeepCompile, which reduces that part itself.
        params = [p for p in params if p.requires_grad and p.grad is not None and p.grad.numel() == p.ds_numel]
        if partitions is None or not params:
            return
        from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
        if self._acc_step != engine.global_steps:  # the optimizer stepped: partitions start over
            self._acc_step, self._acc_ids = engine.global_steps, set()
        comm_dtype = getattr(optimizer, "communication_data_type", None)
        groups = {}
        for p in params:
            groups.setdefault(id(p.ds_process_group), (p.ds_process_group, []))[1].append(p)
        for group, ps in groups.values():
            grads = [(p.grad if comm_dtype in (None, p.grad.dtype) else p.grad.to(comm_dtype)).contiguous() for p in ps]
            for p, part in zip(ps, reduce_scatter_coalesced(grads, group)):
                dest = partitions[p.ds_id]
                if part.numel() and dest.numel():
                    dest = dest.narrow(0, 0, part.numel())
                    if p.ds_id in self._acc_ids:
                        dest.add_(part.to(dest.dtype))
                    else:
                        dest.copy_(part)
                self._acc_ids.add(p.ds_id)
                p.grad = None
                self._n["reduced"] += 1

    # -- lifetime and introspection --------------------------------------------------------------
    def close(self):
        """Engine destroyed: drop every claim, leave DeepSpeed's post-backward hooks."""
        if self._closed:
            return
        self.release_gathered_params()
        self._closed = True
        pre_hooks, post_hooks = private.backward_hook_lists()
        post_hooks[:] = [h for h in post_hooks if getattr(h, "__self__", None) is not self]
        engine = self._engine()
        optimizer = getattr(engine, "optimizer", None) if engine is not None else None
        if optimizer is not None:
            pre_hooks[:] = [h for h in pre_hooks if not _holds(h, optimizer)]
        if private.active_fallback() is self:
            private.set_active_fallback(None)
        _SharedSettings.release(self)

    def stats(self) -> FallbackStats:
        state = self._state()
        claimed = {}
        if state is not None:
            for h in state.engine.handles:
                for kind, owner in h.claims:
                    if kind == self._kind:
                        claimed.setdefault(owner, []).append(h.name)
        n = self._n
        return FallbackStats(enabled=self.enabled, gathered_params=n["gathered"], claimed_params=n["claimed"],
                             guard_lookups=n["guard"], regathered_params=n["regathered"],
                             reduced_grads=n["reduced"], released_params=n["released"],
                             graphs={gid: g.phase.name for gid, g in sorted(self._graphs.items())},
                             claimed={k: sorted(v) for k, v in sorted(claimed.items())})


def fallback_of(engine) -> Optional[Z3extEagerFallback]:
    """The z3ext eager fallback of a DeepCompile'd z3ext engine, or None (not compiled yet)."""
    fb = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    return fb if isinstance(fb, Z3extEagerFallback) else None


def new_fallback(engine) -> Optional[Z3extEagerFallback]:
    """What `DeepCompileZ3EagerFallback(engine)` (DeepCompile's init_z3) builds for a z3ext engine (the
    seams.py dispatch); None for any other engine, which gets DeepSpeed's own class."""
    state = of_engine(engine)
    if state is None:
        return None
    fb = Z3extEagerFallback(engine, state, enabled=state.config.compile_fallback)
    offload_of(engine).z3ext_fallback = fb  # closed by Z3extZeRoOffload.destroy
    state.compiled = True  # module hooks are gone: the getter is DeepSpeed's ([Note: external discovery])
    master.unalias(engine.optimizer)  # before DeepCompile registers the partitions ([Note: partition is the master])
    return fb
