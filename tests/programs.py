"""Drawn training programs, run on stock ZeRO-3 and on z3ext and compared bitwise (the differential test).

A program is drawn from one seed (`draw(seed)`, plain `random.Random`: a failure is reproduced from its
seed alone): a small model composed of layers that save the parameter itself (addmm, bmm, conv1d) or a view
of it (`nn.Linear`, whose autograd saves `weight.t()`), an embedding whose weight is tied to the output head
or not, a LoRA-style layer whose base is frozen from the start, a layer applied twice, a checkpointed segment
(reentrant or not); a config (gradient accumulation, clipping that triggers or never does, bucket size,
hold on/off, live budget, prefetch window, persistence threshold, DeepSpeed's memory-efficient linear, bf16);
non-uniform parts from a third stream (`nonuniform_rng(seed)`): a mixture-of-experts block with one module per
expert (top-1 routing: the experts run differ by rank and step; stock runs it as a z3 leaf marked by hand),
and a layer that only some micro-steps run, on every rank alike or on some ranks only (z3ext names it in
`conditional_modules`; stock runs it with weight 0 where it is skipped, a dummy pass); from streams of their own, an
aux head whose output only some ranks or micro-steps put in the loss, and a frozen teacher that only some ranks or
micro-steps run under `no_grad` (stock runs it everywhere and drops the output);
and a schedule of optimizer steps with events between them: freeze parameters, unfreeze them, a `no_grad`
evaluation forward, a grad-enabled forward whose graph is dropped, and a backward that raises part-way
and is retried.

Events with per-rank lifetimes (DESIGN "Invariants": what a rank keeps alive, or when its collector runs,
never changes the collectives it issues) are drawn from a second stream (`lifetimes_rng(seed)`), so the
events above, the model and the config are what they were for every seed: `kept0`, a grad-enabled forward
whose output only rank 0 keeps (the other ranks drop it at once) for `arg` micro-steps; `evalkept0`, the
same forward in eval mode (`engine.eval()`, without `no_grad`); `cycle1`, a grad-enabled forward whose
output is put in a reference cycle on every rank, collected at once (`gc.collect()`) on the ranks other
than 0, and on rank 0 only after `arg` micro-steps. A drop or collection "after k micro-steps" comes right
after the k-th following micro-step's `engine.step()` (mid-accumulation when ga > 1); one past the last
micro-step comes after the final parameters are read. The collector is disabled while a program runs, so
collections happen where the program says. Stock runs the same program (nothing changes in its numbers);
the forwards' values are compared too.

A trainable parameter that gets no gradient in a window (frozen mid-training, a skipped layer, an expert no
token reached) steps on a zero gradient on z3ext (ZeRO stage 1/2's numbers); stock steps on the partition an
earlier window left, so stock's gradient partitions are zeroed after each optimizer step: the reference.

`run(program)` trains it on the current process group and returns its losses and final parameters.
A backward that raises is z3ext's alone: stock ZeRO-3 cannot retry one (its bucket would hold the
parameters twice and trip its duplicate assertion), so the raising pass's loss is scaled by 0 (its
partial gradients are exact zeros, and `g + 0 == g`) and stock runs the program without that pass: a z3ext
that survives the raise and the retry gives stock's bits.

    python -m tests.programs --programs 300 [--first-seed 0]   # a longer run (2 gloo ranks)

prints one line per program and, at the end, the seeds that differed and those skipped; tests/test_differential.py runs a
fixed budget of seeds in CI, and every seed that ever failed is a named regression case there.
"""
import argparse
import gc
import random
import time
from typing import NamedTuple, Optional, Tuple

VOCAB, SEQ, HIDDEN, BATCH = 24, 6, 8, 2
LAYER_KINDS = ("linear", "addmm", "bmm", "conv", "lora", "repeat")
LIFETIME_KINDS = ("kept0", "evalkept0", "cycle1")  # per-rank lifetimes: see the module docstring


def lifetimes_rng(seed):
    """The stream the per-rank lifetime events are drawn from: apart from `draw(seed)`'s own, so adding
    them left every seed's other draws as they were (a str seed is hashed deterministically)."""
    return random.Random(f"lifetimes {seed}")


def unused_rng(seed):
    """The stream the unused head is drawn from (a head whose output only some ranks or micro-steps put in the
    loss), apart from the others so every seed's other draws stay as they were."""
    return random.Random(f"unused {seed}")


def teacher_rng(seed):
    """The stream the frozen teacher is drawn from (a module run under `torch.no_grad()` inside the training forward,
    only at some micro-steps or on some ranks), apart from the others so every seed's other draws stay as they were."""
    return random.Random(f"teacher {seed}")


def nonuniform_rng(seed):
    """The stream the non-uniform parts are drawn from (an MoE block whose routing differs by rank and step,
    a layer some micro-steps skip), apart from the others so every seed's other draws stay as they were."""
    return random.Random(f"nonuniform {seed}")


class Event(NamedTuple):
    before_step: int   # runs before this optimizer step's first micro-step
    kind: str          # freeze | unfreeze | eval | dropped | fail | kept0 | evalkept0 | cycle1
    arg: int           # a parameter index (freeze/unfreeze), a layer index (fail), micro-steps until rank 0
                       # drops (kept0, evalkept0) or collects (cycle1) the output; else 0


class Program(NamedTuple):
    seed: int
    layers: Tuple[str, ...]
    tied: bool
    checkpoint: Optional[Tuple[int, int, bool]]  # (first layer, last layer exclusive, reentrant)
    ga: int
    steps: int
    clip: float        # gradient_clipping: 0 (off), tiny (triggers at every step), huge (never)
    bucket: Optional[int]  # reduce_bucket_size (None: DeepSpeed's default)
    hold: bool
    live: Optional[int]    # stage3_max_live_parameters (None: DeepSpeed's default)
    prefetch: Optional[int]  # stage3_prefetch_bucket_size
    persistence: int
    mel: bool
    bf16: bool
    events: Tuple[Event, ...]
    moe: Optional[int] = None  # a mixture-of-experts block (one module per expert, top-1) after this layer
    sometimes: Optional[Tuple[int, int, bool]] = None  # (layer, period, per rank): that layer runs only when
    # (micro-step + (rank if per rank else 0)) % period == 0
    undeclared: bool = False  # a per-rank "sometimes" layer not in conditional_modules: agreed forwards train it
    unused: Optional[Tuple[int, bool]] = None  # (period, per rank): an aux head runs on every rank; its output is
    # in the loss only when (micro-step + (rank if per rank else 0)) % period == 0 (nothing declared in z3ext; stock
    # adds it times 0.0 elsewhere): the parameters that get a gradient differ by rank and micro-step
    teacher: Optional[Tuple[int, int, bool]] = None  # (layer position, period, per rank): a frozen module run under
    # no_grad after that position's layer in training forwards when (micro-step + (rank if per rank else 0)) %
    # period == 0, its output added (stock runs it on every rank and drops the output elsewhere: the same bits)

    def describe(self):
        return (f"seed {self.seed}: layers={','.join(self.layers)} tied={self.tied} checkpoint={self.checkpoint} "
                f"ga={self.ga} steps={self.steps} clip={self.clip} bucket={self.bucket} hold={self.hold} "
                f"live={self.live} prefetch={self.prefetch} persistence={self.persistence} mel={self.mel} "
                f"bf16={self.bf16} events={[tuple(e) for e in self.events]} moe={self.moe} sometimes={self.sometimes} undeclared={self.undeclared} "
                f"unused={self.unused} teacher={self.teacher}")


def draw(seed) -> Program:
    r = random.Random(seed)
    n = r.randint(2, 5)
    layers = tuple(r.choice(LAYER_KINDS) for _ in range(n))
    checkpoint = None
    if r.random() < 0.35:
        a = r.randrange(n)
        checkpoint = (a, r.randint(a + 1, n), r.random() < 0.5)
    steps = r.randint(3, 6)
    events = []
    for s in range(1, steps):
        if r.random() < 0.35:
            events.append(Event(s, "freeze", r.randrange(1000)))
        if r.random() < 0.2:
            events.append(Event(s, "unfreeze", r.randrange(1000)))
        if r.random() < 0.2:
            events.append(Event(s, "eval", 0))
        if r.random() < 0.15:
            events.append(Event(s, "dropped", 0))
        if r.random() < 0.2:
            events.append(Event(s, "fail", r.randrange(n)))
    lifetimes = lifetimes_rng(seed)
    for s in range(steps):
        for kind, p in zip(LIFETIME_KINDS, (0.04, 0.04, 0.04)):
            if lifetimes.random() < p:
                events.append(Event(s, kind, lifetimes.randrange(1, 2 * steps + 2)))
    events.sort(key=lambda e: e.before_step)  # stable: within a step, the old kinds run first
    nonuniform = nonuniform_rng(seed)
    moe = nonuniform.randrange(n) if nonuniform.random() < 0.3 else None
    sometimes = None
    if nonuniform.random() < 0.25:
        # per rank: ranks skip it at different micro-steps (z3ext declares it a conditional module; stock gives
        # it a dummy pass that counts 0 times), never with a fail event (a fault on some ranks only)
        layer, period = nonuniform.randrange(n), nonuniform.choice((2, 3))
        distinct = _order(layers)[layer]  # fail events index the distinct layers
        per_rank = nonuniform.random() < 0.6 and not any(e.kind == "fail" and e.arg % (max(_order(layers)) + 1) == distinct
                                                          for e in events)
        sometimes = (layer, period, per_rank)
    extra = unused_rng(seed)
    unused = (extra.choice((2, 3)), extra.random() < 0.7) if extra.random() < 0.3 else None
    t = teacher_rng(seed)
    teacher = (t.randrange(n), t.choice((2, 3)), t.random() < 0.7) if t.random() < 0.25 else None
    if teacher is not None and teacher[2] and sometimes is not None and sometimes[2]:
        teacher = None  # beside a layer some ranks skip, stock itself may abort (gloo: seeds 1093, 1338): no reference
    if teacher is not None and teacher[2] and checkpoint is not None and checkpoint[0] <= teacher[0] < checkpoint[1]:
        # Run per rank with grad mode off inside a checkpointed segment: the ranks that ran it gather it again for
        # the recomputation, the others do not (recomputations are not walked; seed 1236 raises a named error).
        teacher = None
    program = Program(moe=moe, sometimes=sometimes, unused=unused, teacher=teacher,
        seed=seed, layers=layers, tied=r.random() < 0.5, checkpoint=checkpoint, ga=r.choice((1, 1, 2, 3)),
        steps=steps, clip=r.choice((0.0, 0.0, 1e-3, 1e6)), bucket=r.choice((None, None, 40, 100, 300)),
        hold=r.random() < 0.7, live=r.choice((None, None, 100, 400)), prefetch=r.choice((None, 0, 200)),
        persistence=r.choice((0, 0, 10)), mel=r.random() < 0.5, bf16=r.random() < 0.2, events=tuple(events))
    if unused is not None and unused[1] and not program.hold and checkpoint is not None and checkpoint[2]:
        # Gathered again by a backward that holds a reentrant checkpoint: the ranks' reduce-scatters still sit
        # between different gathers in some such programs (seed 1151 without this; z3ext raises a named error,
        # [Note: presence behind a reentrant checkpoint] in grads.py).
        program = program._replace(unused=(unused[0], False))
    if sometimes is not None and sometimes[2] and not (checkpoint is not None and checkpoint[2]) and \
            random.Random(f"undeclared {seed}").random() < 0.5:
        # Nothing declared: the ranks record the first forward together ([Note: forwards that differ by rank]); not
        # with a reentrant checkpoint, whose recomputation is not walked (seeds 1245, 1557 without the condition
        # raise a named error).
        program = program._replace(undeclared=True)
    return program


def config(program, z3ext):
    zero = {"stage": 3, "stage3_param_persistence_threshold": program.persistence,
            "memory_efficient_linear": program.mel}
    if program.bucket is not None:
        zero["reduce_bucket_size"] = program.bucket
    if program.live is not None:
        zero["stage3_max_live_parameters"] = program.live
    if program.prefetch is not None:
        zero["stage3_prefetch_bucket_size"] = program.prefetch
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": program.ga,
           "steps_per_print": 10**9, "gradient_clipping": program.clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "zero_optimization": zero}
    if program.bf16:
        cfg["bf16"] = {"enabled": True}
    if z3ext:
        cfg["z3ext"] = {"enabled": True, "hold_for_backward": program.hold}
        if program.moe is not None and program.live is not None:
            # A detected block is bounded by a fetch group ([Note: a bounded guess] in conditional.py), half the
            # drawn live budget of a few hundred elements: the program allows the block's size.
            cfg["z3ext"]["fetch_group_numel"] = 10**6
        if program.sometimes is not None and program.sometimes[2] and not program.undeclared:
            cfg["z3ext"]["conditional_modules"] = ["layers." + str(_order(program.layers)[program.sometimes[0]])]
    return cfg


def _order(layers):
    """The index in `layers` (the ModuleList of distinct layers) of each position's layer ("repeat" reuses)."""
    order, distinct = [], -1
    for i, kind in enumerate(layers):
        if kind == "repeat" and i > 0:
            order.append(order[-1])
        else:
            distinct += 1
            order.append(distinct)
    return order


def _model(program):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    from tests.models import TopOneMoe

    class Failing(nn.Module):
        """Raises in backward when armed: after the layers nearer the loss have their gradients."""

        def __init__(self):
            super().__init__()
            self.armed = False

        def arm(self, y):
            if self.armed and y.requires_grad:
                def boom(grad):
                    raise RuntimeError("injected backward failure")
                y.register_hook(boom)
            return y

    class Linear(Failing):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            return self.arm(torch.tanh(self.inner(x)))

    class Addmm(Failing):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.3)
            self.bias = nn.Parameter(torch.randn(HIDDEN) * 0.1)

        def forward(self, x):
            y = torch.addmm(self.bias, x.reshape(-1, HIDDEN), self.weight).view_as(x)
            return self.arm(torch.tanh(y))

    class Bmm(Failing):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(1, HIDDEN, HIDDEN) * 0.3)

        def forward(self, x):
            return self.arm(torch.tanh(torch.bmm(x, self.weight.expand(x.shape[0], HIDDEN, HIDDEN))))

    class Conv(Failing):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1)

        def forward(self, x):
            return self.arm(torch.tanh(self.conv(x.transpose(1, 2)).transpose(1, 2)))

    class Lora(Failing):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(HIDDEN, HIDDEN)
            self.base.requires_grad_(False)  # frozen from the start: DeepSpeed registers no gradient hook
            self.lora_a = nn.Parameter(torch.randn(HIDDEN, 2) * 0.3)
            self.lora_b = nn.Parameter(torch.randn(2, HIDDEN) * 0.3)

        def forward(self, x):
            return self.arm(torch.tanh(self.base(x) + x @ self.lora_a @ self.lora_b))

    kinds = {"linear": Linear, "addmm": Addmm, "bmm": Bmm, "conv": Conv, "lora": Lora}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            built = []
            for kind in program.layers:
                # "repeat": the previous layer of parameters applied again (a module used twice per forward)
                built.append(built[-1] if kind == "repeat" and built else kinds.get(kind, Linear)())
            self.layers = nn.ModuleList(m for i, m in enumerate(built) if all(m is not b for b in built[:i]))
            self.order = [next(j for j, m in enumerate(self.layers) if m is b) for b in built]
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            if program.tied:
                self.head.weight = self.embed.weight
            # top-1 over 3 experts, one module each: the experts run differ by rank and step
            self.moe = TopOneMoe(HIDDEN, 3, torch.tanh) if program.moe is not None else None
            self.micro = 0  # set by the loop: which micro-step runs ("sometimes")
            self.rank = 0
            self.dummy = False  # stock, per rank: a skipped layer runs with weight 0 instead
            self.aux = nn.Linear(HIDDEN, 1) if program.unused is not None else None
            self.dummy_aux = False
            self.sometimes_layer = (self.order[program.sometimes[0] % len(self.order)]
                                    if program.sometimes is not None else None)
            self.teacher = nn.Linear(HIDDEN, HIDDEN) if program.teacher is not None else None
            if self.teacher is not None:
                self.teacher.requires_grad_(False)
            self.dummy_teacher = False  # stock: the teacher runs at every micro-step, its output dropped where skipped

        def layer(self, i, x):
            x = self._layer(i, x)
            if self.teacher is not None and i == program.teacher[0] and torch.is_grad_enabled():
                # (training forwards only: a no_grad plan recorded where no rank ran it would not have it, and a
                # module off the plan on some ranks only raises, named: [Note: forwards that differ by rank])
                _, period, per_rank = program.teacher
                runs = (self.micro + (self.rank if per_rank else 0)) % period == 0
                if runs or self.dummy_teacher:
                    with torch.no_grad():
                        t = self.teacher(x)
                    if runs:
                        x = x + 0.5 * t
            return x

        def _layer(self, i, x):
            # Also in no_grad forwards (eval): undeclared, those are walked too ([Note: forwards that differ by rank])
            if program.sometimes is not None and self.order[i] == self.sometimes_layer:
                layer, period, per_rank = program.sometimes
                if (self.micro + (self.rank if per_rank else 0)) % period != 0:
                    if self.dummy:  # stock's way: the layer runs and counts 0 times
                        return x + 0.0 * self.layers[self.order[i]](x)
                    return x  # skipped at this micro-step
            x = self.layers[self.order[i]](x)
            if self.moe is not None and i == program.moe % len(self.order):
                x = self.moe(x)
            return x

        def forward(self, tokens):
            x = self.embed(tokens)
            seg = program.checkpoint
            i = 0
            while i < len(self.order):
                if seg is not None and i == seg[0]:

                    def segment(h, first=seg[0], last=seg[1]):
                        for j in range(first, last):
                            h = self.layer(j, h)
                        return h
                    x = checkpoint(segment, x, use_reentrant=seg[2])
                    i = seg[1]
                    continue
                x = self.layer(i, x)
                i += 1
            logits = self.head(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.roll(-1, dims=1).flatten())
            if self.aux is not None:
                aux = self.aux(x).float().pow(2).mean()
                period, per_rank = program.unused
                if (self.micro + (self.rank if per_rank else 0)) % period == 0:
                    loss = loss + aux
                elif self.dummy_aux:  # stock's way: the head's output counts 0 times
                    loss = loss + 0.0 * aux
            return loss

    return Net


def _tokens(i, rank):
    import torch
    g = torch.Generator().manual_seed(7919 * i + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


class Unfired(Exception):
    """A fail event whose hook could not fire: the layer's output needed no gradient."""


def run(program, z3ext):
    """Trains `program` on stock (z3ext False) or z3ext; returns losses, final parameters by name, and
    which events ran."""
    import torch.distributed as dist
    rank = dist.get_rank()
    cfg = config(program, z3ext)
    # Collections happen where the program says (cycle1), never when the collector decides.
    collector_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _run(program, z3ext, rank, cfg)
    finally:
        gc.collect()  # rank 0's cycles not collected yet (the run ended first)
        if collector_was_enabled:
            gc.enable()


def _run(program, z3ext, rank, cfg):
    import torch
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    from tests.models import full_params, without_stale_gradients

    torch.manual_seed(program.seed)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _model(program)()
    model.rank = rank
    model.dummy = not z3ext and program.sometimes is not None and program.sometimes[2]
    model.dummy_aux = not z3ext  # [Note: fixed gradient layout] in grads.py: z3ext needs nothing
    model.dummy_teacher = not z3ext  # [Note: skipped with the runner's grad mode] in coordinator.py
    if model.moe is not None and not z3ext:
        # Stock's way to train it: the block marked by hand (z3ext finds it: [Note: conditional blocks]).
        deepspeed.utils.set_z3_leaf_modules(model, [type(model.moe)])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if z3ext:
        deepspeed_z3ext.stats(engine)  # raises unless z3ext owns this engine
    else:
        without_stale_gradients(engine)  # the reference where a parameter gets no gradient in a window
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    frozen = []
    losses, i, failed = [], 0, 0
    pending = []  # [micro-steps left, what rank 0 keeps (an output) or COLLECT], see _lifetime_event
    try:
        for step in range(program.steps):
            fail_layer = None
            for event in program.events:
                if event.before_step != step:
                    continue
                if event.kind == "freeze" and len(trainable) > 1:
                    p = trainable.pop(event.arg % len(trainable))
                    p.requires_grad_(False)
                    frozen.append(p)
                elif event.kind == "unfreeze" and frozen:
                    p = frozen.pop(event.arg % len(frozen))
                    p.requires_grad_(True)
                    trainable.append(p)
                elif event.kind == "eval":
                    with torch.no_grad():
                        losses.append(("eval", engine(_tokens(10**6 + i, rank)).item()))
                elif event.kind == "dropped":
                    engine(_tokens(2 * 10**6 + i, rank))  # its graph is freed at once
                elif event.kind == "fail":
                    fail_layer = event.arg % len(engine.module.layers)
                elif event.kind in LIFETIME_KINDS:
                    pending.extend(_lifetime_event(engine, event, i, rank, losses))
            for micro in range(program.ga):
                if fail_layer is not None and micro == 0 and z3ext:
                    layer = engine.module.layers[fail_layer]
                    layer.armed = True
                    try:
                        engine.backward(engine(_tokens(i, rank)) * 0.0)
                        # Nothing at or above the layer needed a gradient (all frozen): the program ran one
                        # more backward than stock's, so it is not comparable (compare() skips it).
                        raise Unfired()
                    except RuntimeError as e:
                        if "injected backward failure" not in str(e):
                            raise
                        failed += 1
                    finally:
                        layer.armed = False
                engine.module.micro = i
                loss = engine(_tokens(i, rank))
                engine.backward(loss)
                if z3ext and micro == program.ga - 1:
                    check_gradient_runs(engine.optimizer)
                engine.step()
                losses.append(loss.item())
                i += 1
                for entry in pending:
                    entry[0] -= 1
                if any(left <= 0 for left, _ in pending):
                    due = [what for left, what in pending if left <= 0]
                    pending = [entry for entry in pending if entry[0] > 0]
                    if any(what is COLLECT for what in due):
                        gc.collect()
                    del due  # rank 0 drops the outputs it kept
        params = full_params(engine)
    finally:
        pending.clear()
        engine.destroy()
    return dict(losses=losses, params=params, failed=failed)


COLLECT = "collect"  # a pending entry of rank 0's: gc.collect() when it is due


def _lifetime_event(engine, event, i, rank, losses):
    """A grad-enabled forward (in eval mode for evalkept0) whose output's lifetime differs across ranks; its
    value goes to `losses` as (kind, value). Returns rank 0's pending entries: the output it keeps, or when
    it collects the cycle (the other ranks keep nothing: they drop or collect it at once)."""
    seed = {"kept0": 3, "evalkept0": 4, "cycle1": 5}[event.kind] * 10**6 + i
    if event.kind == "evalkept0":
        engine.eval()
    try:
        out = engine(_tokens(seed, rank))
    finally:
        if event.kind == "evalkept0":
            engine.train()
    losses.append((event.kind, out.item()))
    if event.kind == "cycle1":
        holder = {"out": out}
        holder["self"] = holder  # only the collector frees it
        del holder, out
        if rank != 0:
            gc.collect()
            return []
        return [[event.arg, COLLECT]]
    return [[event.arg, out]] if rank == 0 else []


def check_gradient_runs(optimizer):
    """What the step's view and the norm read as a sub-group's gradient ([Note: step view validity],
    [Note: gradient norm]): a run of the buffer holding exactly the step's partitions, or None where they do
    not lie back to back (a frozen parameter's zeros)."""
    import torch
    from deepspeed_z3ext.state import of_optimizer
    reducer = of_optimizer(optimizer).grad_reducer
    if not reducer:
        return
    buffer = optimizer.grad_partitions_flat_buffer
    for i, grads in optimizer.averaged_gradients.items():
        run = reducer.gradient_run(optimizer, i)
        views = all(g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for g in grads)
        assert (run is not None) == views, f"sub-group {i}: run {run is not None}, partitions all views {views}"
        if run is not None:  # (an fp16 overflow leaves NaN in both)
            cat = torch.cat([g.flatten() for g in grads])
            nan = torch.isnan(cat)
            assert torch.equal(torch.isnan(run), nan) and torch.equal(run.masked_fill(nan, 0), cat.masked_fill(nan, 0)), \
                f"sub-group {i}: the run differs"


def compare(program):
    """Runs `program` on stock and on z3ext; returns None when bitwise equal, else what differed. With a reentrant
    checkpoint, where z3ext differs from stock, the reference is stock with the same segment not reentrant (the same
    arithmetic) when stock's reentrant run differs from that: stock reduces a gradient that a reentrant segment's
    backward delivers a second time (a layer applied outside the segment and inside it) as if it were new, z3ext
    sums it first ([Note: presence behind a reentrant checkpoint] in deepspeed_z3ext/grads.py)."""
    try:
        stock = run(program, z3ext=False)
    except Exception as e:  # outside what stock supports: nothing to compare with
        return f"skipped: stock raised (not a z3ext defect): {type(e).__name__}: {e}"
    try:
        z3 = run(program, z3ext=True)
    except Unfired:
        return "skipped: a fail event's layer needed no gradient (everything at and above it frozen)"
    except Exception as e:
        import traceback
        return f"z3ext raised where stock trained: {traceback.format_exc()}"
    differs = _difference(stock, z3)
    if differs is not None and program.checkpoint is not None and program.checkpoint[2]:
        plain = run(program._replace(checkpoint=program.checkpoint[:2] + (False,)), z3ext=False)
        if _difference(stock, plain) is not None and _difference(plain, z3) is None:
            return None
    return differs


def _difference(stock, z3):
    import torch
    if stock["losses"] != z3["losses"]:
        first = next(k for k, (a, b) in enumerate(zip(stock["losses"], z3["losses"])) if a != b) \
            if len(stock["losses"]) == len(z3["losses"]) else None
        return f"losses differ (first at micro-step {first}):\nstock {stock['losses']}\nz3ext {z3['losses']}"
    bad = [n for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])]
    if bad:
        worst = max((stock["params"][n].float() - z3["params"][n].float()).abs().max().item() for n in bad)
        return f"final parameters differ: {bad} (largest difference {worst:.3g})"
    return None


def run_programs(seeds):
    """On every rank: compares each seed's program; returns [(seed, outcome)], outcome None when equal."""
    out = []
    for seed in seeds:
        t0 = time.perf_counter()
        outcome = compare(draw(seed))
        out.append((seed, outcome, time.perf_counter() - t0))
    return out


def differing(results):
    """(seed, message) for each program that was not bitwise equal on some rank; skipped programs (stock
    raised, or a fail event could not fire) are not failures and are returned separately."""
    failures, skipped = {}, {}
    for rank_results in results:
        for seed, outcome, _ in rank_results:
            if outcome is None:
                continue
            (skipped if outcome.startswith("skipped") else failures).setdefault(seed, outcome)
    return failures, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=300)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=25, help="programs per spawn of the 2 ranks")
    args = ap.parse_args()
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # The ranks inherit this: DeepSpeed's and torch's deprecation warnings would bury the report.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning")
    from tests.harness import run_on_ranks
    t0 = time.perf_counter()
    all_failures, all_skipped, n = {}, {}, 0
    for start in range(args.first_seed, args.first_seed + args.programs, args.chunk):
        seeds = list(range(start, min(start + args.chunk, args.first_seed + args.programs)))
        results = run_on_ranks(run_programs, seeds=seeds, timeout=60 * len(seeds) + 120)
        failures, skipped = differing(results)
        for seed, outcome, seconds in results[0]:
            n += 1
            mark = "DIFFERS" if seed in failures else "skipped" if seed in skipped else "equal"
            print(f"{seed:6d} {mark:8s} {seconds:5.1f}s  {draw(seed).describe()}", flush=True)
            if seed in failures:
                print("        " + failures[seed].replace("\n", "\n        "), flush=True)
        all_failures.update(failures)
        all_skipped.update(skipped)
    print(f"{n} programs in {time.perf_counter() - t0:.0f} s: {n - len(all_failures) - len(all_skipped)} bitwise "
          f"equal, {len(all_failures)} differ, {len(all_skipped)} skipped")
    if all_failures:
        print("differing seeds:", sorted(all_failures))
    for seed, why in sorted(all_skipped.items()):
        print(f"skipped {seed}: {why.splitlines()[0][:200]}")
    raise SystemExit(1 if all_failures else 0)


if __name__ == "__main__":
    main()
