"""ResidentSet: the units no_grad forwards keep gathered for the next one (generation).

[Note: generation residency] Generation runs one no_grad forward per new token over the same modules in
the same order ([Note: forward plan]); releasing each unit after its module and gathering it again in the
next forward moves the whole model per token. A generation step is known by its call: HF `generate` passes
the model its KV cache (`past_key_values`, `cache` since transformers 5.25; hooks.py reads the root
module's keyword arguments), prompt included; inside a `deepspeed_z3ext.resident(engine, numel)` block every no_grad forward counts as one.
In such a forward, at the end of a module's forward its unit takes a Resident claim while the resident
elements stay within `z3ext.resident_numel` (default: stage3_max_live_parameters less
stage3_prefetch_bucket_size, which stays free for the window; more when memory allows, [Note: resident
budget]); units past the budget are released as
before and gathered ahead along the plan ([Note: prefetch window], which passes over resident units).
Resident parameters, what is ahead and the running module's unit bound what the forward holds. No other
forward keeps anything: evaluation, a reference model's forward (TRL's DPO and GRPO), a forward whose
graph awaits its backward hold what they held before. Resident claims end all together ([Note: one
release routine]): at the next outermost forward that is not a generation step (grad-enabled or not),
at `engine.backward` and `engine.train()`, at the optimizer step and DeepSpeed's other releases of
everything (claims.STEP_KINDS), at `deepspeed_z3ext.release_resident(engine)` and at the exit of a
`resident` block. Which units are resident follows from the calls made and the modules' sizes alone, so
every rank keeps the same ones ([Note: one schedule on every rank] in schedule.py).

[Note: resident fast path] When one no_grad forward ended with every unit it fetched resident, the next
no_grad forward over the same tree ([Note: tree epoch]) needs no claim: nothing that can run inside a
no_grad forward ends a Resident claim (a GatheredParameters exit drops its own kind, a direct
`partition()` drops Direct claims). Its module hooks then keep DeepSpeed's module stack and nothing else
(hooks.py), and the modules the set covers lose their hooks while it lasts ([Note: lifted hooks] in lifted.py):
the host cost per module of a generated token approaches the unsharded model's. A module the forward that made
the set did not run takes the full path, and the next forward takes it everywhere and makes the set again.

[Note: resident budget] The live budget's default (1e9 elements) keeps a 0.94B model resident but only a
seventh of a 6.7B one, whose every token then gathers the rest again, although an H200 at world 8 has
room for all of it. So where neither `z3ext.resident_numel` nor stage3_max_live_parameters was set, each
generation round (from its first step to the release of its Resident claims) starts by sizing the budget
from memory: the model's elements, or as many as half of the device's free memory holds (the CUDA
allocator's cached blocks count as free; on the CPU, the host's available memory), at least the live
budget's default. The other half stays for what generation allocates (its KV cache, activations). Each
rank measures its own memory, and the ranks take the smallest (one tiny all-gather at the round's first
step: every rank starts a round at the same call), so they keep the same units. A budget set by hand is
used as it is.
"""
from deepspeed_z3ext import claims
from deepspeed_z3ext.epoch import TREE


class ResidentSet:

    def __init__(self, engine, budget_numel: int, size_from_memory=None):
        self.engine = engine
        self.budget = budget_numel
        self._base = budget_numel
        self._size_from_memory = size_from_memory  # () -> elements, agreed by the ranks ([Note: resident budget])
        self._round = False     # a generation round is under way (its budget decided)
        self.units = set()   # keys (ids of the modules whose release kept their unit)
        self._params = set()  # ds_ids of the parameters resident (units overlap: a block's and its members')
        self.numel = 0
        self.forwards = 0      # no_grad forwards that ran the fast path ([Note: resident fast path])
        # Making the fast path: the modules this no_grad forward ran, whether every unit stayed.
        self._seen = []
        self._all_kept = True
        self.fast = False       # this forward runs the fast path
        self.fast_ids = None    # frozenset of the module ids it covers; None: no complete forward yet
        self._epoch = -1
        self.keeping = False    # this outermost forward keeps what it releases, within the budget
        self.explicit = False   # inside a `deepspeed_z3ext.resident` block
        self.generating = False  # the coming outermost call passes a KV cache (set by hooks.py, read once)
        self.lifted = None       # LiftedHooks of the engine's modules ([Note: lifted hooks] in lifted.py)

    def default_budget(self) -> int:
        """The budget when none is given: the configured one, or sized from memory ([Note: resident budget])."""
        if self._size_from_memory is None:
            return self._base
        return max(self._base, self._size_from_memory())

    @property
    def enabled(self) -> bool:
        return self.budget > 0 or self._size_from_memory is not None

    def keep(self, key, unit) -> bool:
        """A no_grad forward released `unit` (of module `key`): it stays gathered if it fits the budget."""
        if key in self.units:
            return True
        held = self._params
        new = [h for h in unit.handles if h.ds_id not in held]
        n = sum(h.numel for h in new)
        if self.numel + n > self.budget:
            self._all_kept = False
            return False
        self.engine.unshard(unit, claims.RESIDENT, claims.SHARED_OWNER, False)  # gathered: the claim only
        self.units.add(key)
        held.update(h.ds_id for h in new)
        self.numel += n
        return True

    def seen(self, module):
        self._seen.append(module)

    def start_forward(self, grad_enabled: bool, graph_pending: bool):
        """An outermost forward starts: one that is not a generation step ends residency; a generation step
        keeps units unless a graph awaits its backward, and runs the fast path when the last one kept
        everything it ran and the tree has not changed since."""
        generating, self.generating = self.generating, False
        self._seen = []
        self._all_kept = True
        self.keeping = self.enabled and not grad_enabled and (self.explicit or (generating and not graph_pending))
        if not self.keeping:
            self.release()
            return
        if not self._round:
            self._round = True
            if not self.explicit:  # (a `resident` block decided its own)
                self.budget = self.default_budget()
        self.fast = self.fast_ids is not None and self._epoch == TREE.value
        if self.fast:
            self.forwards += 1
            if self.lifted is not None:
                self.lifted.lift(self.fast_ids)  # [Note: lifted hooks] in lifted.py
        else:
            self._unlift()

    def end_forward(self):
        """The outermost no_grad forward (not the fast path) ended: its modules form the fast path's set
        when every unit it released stayed resident."""
        if self._all_kept and self._seen and self.units:
            self.fast_ids = frozenset(map(id, self._seen))
            self._epoch = TREE.value
        else:
            self.fast_ids = None
        self._seen = []

    def leave_fast_path(self):
        """A module the set does not cover ran: the rest of this forward, and the next, take the full path."""
        self.fast = False
        self.fast_ids = None
        self._all_kept = False
        self._unlift()

    def _unlift(self):
        if self.lifted is not None and self.lifted.active:
            self.lifted.restore()

    def release(self):
        """Every Resident claim ends; units nothing else claims are released."""
        had = bool(self.units)
        self.forget()
        if had:
            self.engine.sweep([claims.RESIDENT])

    def forget(self):
        """Resident claims were dropped by a sweep of everything (the step, a checkpoint)."""
        self.fast = False
        self.fast_ids = None
        self._unlift()
        self.units.clear()
        self._params.clear()
        self.numel = 0
        self._round = False
