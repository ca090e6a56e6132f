"""Ranks whose backward reaches different parameters: DDP's numbers with nothing declared (DESIGN "Invariants";
[Note: fixed gradient layout] in grads.py).

Every head runs on every rank (the same gathers), but which heads a rank's loss uses differs by rank and by
micro-step, so the parameters that get a gradient differ. DDP's update is each rank's local gradient, a missing
one as zeros, averaged. The reference is stock ZeRO-3 with the workaround stock users apply (every unused head
added to the loss times 0.0: each rank then has every gradient, zeros where unused), which gives DDP's numbers
with stock's arithmetic: z3ext without the workaround must equal it bitwise. Stock without the workaround
reduces the gradients in arrival order into buckets without identity, mixing one rank's head `a` with
another's head `b`: its parameters differ (checked, so the comparison can fail). Every case runs on real gloo
ranks under a hard timeout.
"""
import pytest

from tests.harness import run_on_ranks
from tests.training import train

HIDDEN, VOCAB, SEQ = 16, 32, 8
DECODER_LAYERDROP = 0.5
TIMEOUT = 300


def _model(heads):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Heads(nn.Module):
        """Both heads' weights in one module (its unit gathers both)."""

        def __init__(self):
            super().__init__()
            self.weight_a = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.2)
            self.weight_b = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.2)

        def forward(self, h):
            return {"a": F.linear(h, self.weight_a), "b": F.linear(h, self.weight_b)}

    class MultiTask(nn.Module):
        """A shared body and two same-shaped heads, each a module (`heads` "modules": stock's backward then visits
        different modules on different ranks, and its trace check raises) or both in one ("one-module");
        `tasks` names the heads the loss uses."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.body = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
            if heads == "modules":
                self.head_a = nn.Linear(HIDDEN, VOCAB)
                self.head_b = nn.Linear(HIDDEN, VOCAB)
            else:
                self.heads = Heads()
            self.tasks = ("a", )
            self.touch = False  # stock's workaround: an unused head's output joins the loss times 0.0

        def forward(self, tokens):
            h = self.embed(tokens)
            for layer in self.body:
                h = h + torch.tanh(layer(h))
            target = tokens.roll(-1, 1).flatten()
            loss = h.float().pow(2).mean() * 1e-3
            both = self.heads(h) if heads == "one-module" else None
            for name in ("a", "b"):
                logits = both[name] if both is not None else getattr(self, "head_" + name)(h)
                if name in self.tasks:
                    loss = loss + F.cross_entropy(logits.flatten(0, 1).float(), target)
                elif self.touch:
                    loss = loss + 0.0 * logits.float().sum()
            return loss

    return MultiTask()


def _engine(z3ext, ga, heads, bucket=None, hold=None):
    import torch
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if bucket:
        zero["reduce_bucket_size"] = bucket
    if hold is not None:  # modules gathered again in backward, ahead in a window of a few units
        zero["stage3_prefetch_bucket_size"] = 1200
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "torch_adam": True}}, "zero_optimization": zero}
    if z3ext:
        cfg["z3ext"] = True if hold is None else {"enabled": True, **HOLDS[hold]}
    torch.manual_seed(7)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _model(heads)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _mismatched(ref, other):
    """The names of the parameters whose values are not bitwise equal."""
    import torch
    return [n for n in ref if not torch.equal(ref[n], other[n])]


PATTERNS = {
    # rank -> heads of each micro-step i
    "a-or-b": lambda rank, i: ("a", ) if rank % 2 == 0 else ("b", ),
    "no-head-on-one": lambda rank, i: () if rank == 1 else ("a", "b"),
    "alternating": lambda rank, i: ("a", ) if (i + rank) % 2 == 0 else ("b", ),
    "one-rank-one-step": lambda rank, i: ("b", ) if (rank == 0 and i == 1) else ("a", ),
}


HOLDS = {"off": {"hold_for_backward": False}, "part": {"hold_max_numel": 700}}


def heads_by_rank(pattern, ga, heads, bucket=None, systems=("reference", "z3ext"), hold=None):
    import torch
    import torch.distributed as dist
    from tests.models import full_params
    rank, out = dist.get_rank(), {}
    choose = PATTERNS[pattern]
    for name in systems:
        engine = _engine(name == "z3ext", ga, heads, bucket=bucket, hold=hold)
        engine.module.touch = name == "reference"

        def forward(engine, i):
            engine.module.tasks = choose(rank, i)
            g = torch.Generator().manual_seed(100 * i + rank)
            return engine(torch.randint(0, VOCAB, (2, SEQ), generator=g))

        losses = train(engine, 3, forward=forward, ga=ga)
        params = full_params(engine)
        out[name] = dict(losses=losses, params=params)
        if name == "z3ext":
            from deepspeed_z3ext import grad_stats
            out[name]["unreached"] = grad_stats(engine).unreached
            out[name]["regathered"] = len(engine.optimizer.parameter_offload.param_coordinator.backward_window.order)
        engine.destroy()
    ref = out["reference"]
    return {name: dict(losses=r["losses"] == ref["losses"], unreached=r.get("unreached"),
                       regathered=r.get("regathered"),
                       mismatched=_mismatched(ref["params"], r["params"]))
            for name, r in out.items() if name != "reference"}


CASES = [(heads, pattern, ga, 2) for heads in ("one-module", "modules")
         for pattern, ga in (("a-or-b", 1), ("no-head-on-one", 1), ("alternating", 2), ("one-rank-one-step", 2))]
CASES += [("modules", "a-or-b", 1, 4), ("one-module", "alternating", 2, 4), ("modules", "no-head-on-one", 1, 4)]


@pytest.mark.parametrize("heads,pattern,ga,world", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_heads_used_by_some_ranks_train_to_ddps_numbers(heads, pattern, ga, world):
    # Stock without the workaround, where it trains at all (one module of heads, a head per rank): silently wrong.
    stock = heads == "one-module" and pattern == "a-or-b"
    systems = ("reference", "z3ext", "stock") if stock else ("reference", "z3ext")
    results = run_on_ranks(heads_by_rank, world_size=world, timeout=TIMEOUT, pattern=pattern, ga=ga, heads=heads,
                           systems=systems)
    for rank, r in enumerate(results):
        z3 = r["z3ext"]
        assert z3["losses"] and not z3["mismatched"], f"rank {rank}: z3ext differs from DDP's numbers: {r}"
    assert any(r["z3ext"]["unreached"] for r in results), f"no gradient was reduced as a zero: {results}"
    if stock:  # a missing gradient is no zero in stock's buckets
        assert any(r["stock"]["mismatched"] or not r["stock"]["losses"] for r in results), \
            "stock ZeRO-3 without the workaround matched it: the comparison shows nothing"


HOLD_CASES = [("modules", "a-or-b", 1, 2, "off"), ("modules", "no-head-on-one", 1, 2, "off"),
              ("one-module", "alternating", 2, 2, "off"), ("modules", "one-rank-one-step", 2, 2, "part"),
              ("modules", "alternating", 2, 4, "off"), ("modules", "no-head-on-one", 1, 4, "part")]


@pytest.mark.parametrize("heads,pattern,ga,world,hold", HOLD_CASES, ids=["-".join(map(str, c)) for c in HOLD_CASES])
def test_heads_gathered_again_in_backward_train_to_ddps_numbers(heads, pattern, ga, world, hold):
    """The same programs with the heads (and more) released after forward and gathered again for backward
    (`hold_for_backward` off, or a hold budget that keeps only the first modules): each rank's backward fetches
    other modules, yet every rank issues the same gathers ([Note: backward walk] in window.py) and reduces the
    buckets some rank cannot complete after them ([Note: presence agreed] in grads.py). Before either, the ranks'
    next collectives differed (`ScheduleMismatchError` on gloo)."""
    results = run_on_ranks(heads_by_rank, world_size=world, timeout=TIMEOUT, pattern=pattern, ga=ga, heads=heads,
                           hold=hold)
    for rank, r in enumerate(results):
        z3 = r["z3ext"]
        assert z3["losses"] and not z3["mismatched"], f"rank {rank}: z3ext differs from DDP's numbers: {r}"
        assert z3["regathered"] >= (1 if hold == "part" else 4), f"rank {rank}: nothing was gathered again: {r}"
    assert any(r["z3ext"]["unreached"] for r in results), f"no gradient was reduced as a zero: {results}"


def test_buckets_of_one_or_two_parameters():
    """`reduce_bucket_size` small enough for one or two parameters per bucket: every bucket is its own
    reduce-scatter, reduced in the layout's order whatever arrived, 2 ranks."""
    for rank, r in enumerate(run_on_ranks(heads_by_rank, timeout=TIMEOUT, pattern="alternating", ga=2,
                                          heads="modules", bucket=600)):
        assert r["z3ext"]["losses"] and not r["z3ext"]["mismatched"], f"rank {rank}: {r}"


def outputs_by_rank(steps=3):
    """A model that returns both heads' logits; each rank's loss reads its own head (rank 0 `a`, rank 1 `b`, ...) and
    the loop keeps the outputs until the next forward has run, so an output the loss never read is alive when the
    backward ends, on some ranks only. The reference: stock with the unread head's logits in the loss times 0.0.
    Then a second backward through the unread output: every rank raises naming it ([Note: one backward per
    graph] in graphs.py)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config, full_params

    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.body = nn.Linear(HIDDEN, HIDDEN)
            self.head_a = nn.Linear(HIDDEN, VOCAB)
            self.head_b = nn.Linear(HIDDEN, VOCAB)

        def forward(self, tokens):
            h = torch.tanh(self.body(self.embed(tokens)))
            return {"a": self.head_a(h), "b": self.head_b(h)}

    rank, out = dist.get_rank(), {}
    mine, other = ("a", "b") if rank % 2 == 0 else ("b", "a")
    for name in ("reference", "z3ext"):
        engine = build_engine(ds_config(z3ext=name == "z3ext", persistence=0, ga=1), model_fn=TwoOutputs, seed=7)
        losses, kept = [], None
        for i in range(steps):
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 * i + rank))
            outputs = engine(tokens)
            kept = outputs  # the previous step's outputs die only now, after this forward
            loss = F.cross_entropy(outputs[mine].flatten(0, 1), tokens.roll(-1, 1).flatten())
            if name == "reference":
                loss = loss + 0.0 * outputs[other].sum()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = dict(losses=losses, params=full_params(engine))
        if name == "z3ext":
            try:
                engine.backward(kept[other].pow(2).mean())
                out["second"] = None
            except deepspeed_z3ext.Z3extError as e:
                out["second"] = str(e)
        engine.destroy()
    ref = out["reference"]
    return dict(losses=out["z3ext"]["losses"] == ref["losses"], second=out["second"],
                mismatched=_mismatched(ref["params"], out["z3ext"]["params"]))


@pytest.mark.parametrize("world", [2, 4])
def test_outputs_read_by_some_ranks_train_to_ddps_numbers_and_a_later_backward_raises(world):
    for rank, r in enumerate(run_on_ranks(outputs_by_rank, world_size=world, timeout=TIMEOUT)):
        assert r["losses"] and not r["mismatched"], (rank, r)
        unread = "output 1" if rank % 2 == 0 else "output 0"  # the dict's tensors in order: a, b
        assert r["second"] and unread in r["second"] and "one backward per graph" in r["second"], (rank, r["second"])


def no_grad_forwards_by_rank(steps=4, world=2, resident_block=True):
    """Training forwards that every rank runs alike, each followed by no_grad forwards in which each rank runs its own
    modules: a head per rank (two modules, not a list) and a body layer skipped per rank (in the first no_grad
    forward the same layer on every rank: a member of a list no rank ran while recording), then the same inside a
    `deepspeed_z3ext.resident` block (a generation step's residency). The reference: stock ZeRO-3 running every
    module on every rank, a skipped layer's output times 0.0 and the rank's own head picked (the same bits as not
    running them). The outputs of every forward and the parameters must be equal."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config, full_params

    class Tasks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.body = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
            self.head_a = nn.Linear(HIDDEN, VOCAB)
            self.head_b = nn.Linear(HIDDEN, VOCAB)
            self.task, self.skip, self.run_all = "a", (), False

        def forward(self, tokens):
            h = self.embed(tokens)
            for i, layer in enumerate(self.body):
                if i in self.skip and not self.run_all:
                    continue
                h = h + torch.tanh(layer(h)) * (0.0 if i in self.skip else 1.0)
            if self.run_all:
                heads = {"a": self.head_a(h), "b": self.head_b(h)}
                return heads[self.task].float().pow(2).mean()
            return getattr(self, "head_" + self.task)(h).float().pow(2).mean()

    rank, out = dist.get_rank(), {}
    for name in ("reference", "z3ext"):
        engine = build_engine(ds_config(z3ext=name == "z3ext", persistence=0, ga=1), model_fn=Tasks, seed=7)
        model, values = engine.module, []
        model.run_all = name == "reference"

        def no_grad_forward(i, tokens):
            model.task = "ab"[rank % 2] if i == 0 else "ab"[(i + rank) % 2]
            model.skip = (1, ) if i == 0 else ((i + rank) % 3, )
            with torch.no_grad():
                values.append(engine(tokens).item())
            model.task, model.skip = "a", ()

        for i in range(steps):
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 * i + rank))
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            values.append(loss.item())
            no_grad_forward(i, tokens)
        with deepspeed_z3ext.resident(engine) if name == "z3ext" and resident_block else torch.no_grad():
            for i in range(1, 4):
                no_grad_forward(i, tokens)
        out[name] = dict(values=values, params=full_params(engine))
        if name == "z3ext":  # generation steps that needed no claim: every rank kept what any ran
            out["fast"] = engine.optimizer.parameter_offload.param_coordinator.resident.forwards
        engine.destroy()
    ref = out["reference"]
    return dict(values=out["z3ext"]["values"] == ref["values"], fast=out["fast"],
                mismatched=_mismatched(ref["params"], out["z3ext"]["params"]))


@pytest.mark.parametrize("world", [2, 4])
def test_no_grad_forwards_that_run_different_modules_by_rank_give_stocks_values(world):
    """No_grad forwards (evaluation, a reference's logits, generation) are recorded by the ranks together and walked
    like training forwards ([Note: forwards that differ by rank] in coordinator.py): a rank gathers the modules
    another runs. Before, the ranks' next all-gathers differed (`ScheduleMismatchError` naming each rank's head)."""
    for rank, r in enumerate(run_on_ranks(no_grad_forwards_by_rank, world_size=world, timeout=TIMEOUT)):
        assert r["values"] and not r["mismatched"] and r["fast"] == 2, (rank, r)


def _against_the_reference(model_fn, per_step, steps=4, options=None):
    """Trains `model_fn` on the reference (stock ZeRO-3) and on z3ext with `hold_for_backward` off (every unit
    gathered again in backward: the walk's positions must be the same on every rank) and `options`, `per_step(model,
    reference, i, rank)` setting what the step's forward runs; whether the losses and the final parameters are bitwise
    equal, or z3ext's error."""
    import deepspeed_z3ext
    import torch
    import torch.distributed as dist
    from tests.models import build_engine, ds_config, full_params
    rank, out = dist.get_rank(), {}
    for name in ("reference", "z3ext"):
        cfg = ds_config(z3ext=name == "z3ext", persistence=0, ga=1)
        if name == "z3ext":
            cfg["z3ext"] = {"enabled": True, "hold_for_backward": False, **(options or {})}
        engine = build_engine(cfg, model_fn=model_fn, seed=7)
        losses = []
        try:
            for i in range(steps):
                per_step(engine.module, name == "reference", i, rank)
                g = torch.Generator().manual_seed(100 * i + rank)
                loss = engine(torch.randint(0, VOCAB, (2, SEQ), generator=g))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        except deepspeed_z3ext.Z3extError as e:
            return dict(error=str(e))
        out[name] = dict(losses=losses, params=full_params(engine))
        engine.destroy()
    ref = out["reference"]
    return dict(losses=out["z3ext"]["losses"] == ref["losses"],
                mismatched=_mismatched(ref["params"], out["z3ext"]["params"]))


def frozen_teacher_by_rank():
    """A frozen module run under `torch.no_grad()` inside a training forward by some ranks only (a teacher's
    logits on some ranks' batches), between trainable layers; which ranks run it alternates by step, so the first
    forward (recorded together) and the walked ones both skip it. The reference: stock with every rank running
    it, the output unused where z3ext's rank skips it (the same bits)."""
    import torch
    import torch.nn as nn

    class Distilled(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.first = nn.Linear(HIDDEN, HIDDEN)
            self.teacher = nn.Linear(HIDDEN, HIDDEN)
            self.last = nn.Linear(HIDDEN, HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB)
            self.teacher.requires_grad_(False)
            self.run_teacher, self.use_teacher = True, True

        def forward(self, tokens):
            h = torch.tanh(self.first(self.embed(tokens)))
            if self.run_teacher:
                with torch.no_grad():
                    t = self.teacher(h)
                if self.use_teacher:
                    h = h + 0.1 * t
            return self.head(torch.tanh(self.last(h))).float().pow(2).mean()

    def per_step(model, reference, i, rank):
        skip = (i + rank) % 2 == 1
        model.use_teacher = not skip
        model.run_teacher = not skip or reference

    return _against_the_reference(Distilled, per_step)


@pytest.mark.parametrize("world", [2, 4])
def test_a_module_run_without_grad_by_some_ranks_trains_to_stocks_numbers(world):
    """[Note: skipped with the runner's grad mode] in coordinator.py: a rank that skips the frozen module learns of
    it at its next fetch, after the no_grad block; released there as a call with a backward, it became a position
    of the backward walk on that rank only, and the ranks' votes at the backward's start differed in size
    (`ScheduleMismatchError`; with the units held, it passed before)."""
    for rank, r in enumerate(run_on_ranks(frozen_teacher_by_rank, world_size=world, timeout=TIMEOUT)):
        assert r["losses"] and not r["mismatched"], (rank, r)


def root_parameter_and_last_module_by_rank():
    """A root with a parameter of its own (a position table: the root's unit is not empty) and a last module, an aux
    head, that only some ranks run (alternating by step). The reference: stock with the aux head run on every rank,
    its loss times 0.0 where z3ext's rank skips it (DDP's numbers)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class WithAux(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.1)
            self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
            self.head = nn.Linear(HIDDEN, VOCAB)
            self.aux = nn.Linear(HIDDEN, 1)
            self.skip, self.dummy = False, False

        def forward(self, tokens):
            h = self.embed(tokens) + self.pos
            for layer in self.layers:
                h = h + torch.tanh(layer(h))
            loss = F.cross_entropy(self.head(h).flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
            if not self.skip or self.dummy:
                loss = loss + self.aux(h).float().pow(2).mean() * (0.0 if self.skip else 1.0)
            return loss

    def per_step(model, reference, i, rank):
        model.skip, model.dummy = (i + rank) % 2 == 1, reference

    return _against_the_reference(WithAux, per_step)


@pytest.mark.parametrize("world", [2, 4])
def test_a_root_with_parameters_and_a_last_module_some_ranks_run_trains_to_ddps_numbers(world):
    """The ranks that skip the last module pass its position at the outermost forward's end: after the root's own
    release, the root's unit was a walk position before the skipped one on those ranks and after it on the others,
    and the backward's gathers differed (`ScheduleMismatchError` naming the root's parameter)."""
    for rank, r in enumerate(run_on_ranks(root_parameter_and_last_module_by_rank, world_size=world, timeout=TIMEOUT)):
        assert r["losses"] and not r["mismatched"], (rank, r)


def head_first_chosen_later(declared, container="dict"):
    """A head per task, only the batch's own head run: every rank runs head `a` in the first forward (the one the
    ranks record together), and from the second step on rank 0 runs head `b` at every other step. The heads are an
    `nn.ModuleDict` of linears (`container` "dict") or of blocks ("towers"), or two attributes of the model
    ("attributes": no like sibling). The reference: stock with both heads run on every rank, the other head's loss
    times 0.0 (DDP's numbers). `declared`: the heads listed in `conditional_modules`."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class PerTask(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.body = nn.Linear(HIDDEN, HIDDEN)
            if container == "dict":
                self.heads = nn.ModuleDict({"a": nn.Linear(HIDDEN, VOCAB), "b": nn.Linear(HIDDEN, VOCAB)})
            elif container == "towers":  # each head a block of its own (the one that ran: a fetch group)
                self.heads = nn.ModuleDict({k: nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                                                             nn.Linear(HIDDEN, VOCAB)) for k in "ab"})
            else:
                self.head_a, self.head_b = nn.Linear(HIDDEN, VOCAB), nn.Linear(HIDDEN, VOCAB)
            self.task, self.touch = "a", False

        def forward(self, tokens):
            h = torch.tanh(self.body(self.embed(tokens)))
            target = tokens.roll(-1, 1).flatten()
            heads = self.heads.items() if container != "attributes" else (("a", self.head_a), ("b", self.head_b))
            loss = 0.0
            for name, head in heads:
                if name == self.task or self.touch:
                    part = F.cross_entropy(head(h).flatten(0, 1).float(), target)
                    loss = loss + part * (1.0 if name == self.task else 0.0)
            return loss

    def per_step(model, reference, i, rank):
        model.task = "b" if rank == 0 and i % 2 == 1 else "a"
        model.touch = reference

    names = ["heads.a", "heads.b"] if container != "attributes" else ["head_a", "head_b"]
    options = {"conditional_modules": names} if declared else None
    return _against_the_reference(PerTask, per_step, options=options)


@pytest.mark.parametrize("world,container", [(2, "dict"), (4, "dict"), (2, "towers")])
def test_a_head_of_a_dict_first_run_by_some_ranks_after_the_recorded_forward_trains_to_ddps_numbers(world, container):
    """[Note: a dict of like modules] in coordinator.py: a task's head in an `nn.ModuleDict` that no rank ran in the
    forward recorded together, run by some ranks later, is in the plan by analogy with the head that ran (a block:
    its modules, copied from the fetch group the one that ran formed): every rank gathers it, nothing declared
    (before: every rank raised, naming it); declared too (linear heads on 2 ranks)."""
    for declared in (False, True) if (world, container) == (2, "dict") else (False, ):
        for rank, r in enumerate(run_on_ranks(head_first_chosen_later, world_size=world, timeout=TIMEOUT,
                                              declared=declared, container=container)):
            assert r.get("losses") and not r["mismatched"], (declared, rank, r)


def test_a_module_first_run_by_some_ranks_after_the_recorded_forward_raises_naming_it_or_trains_declared():
    """[Note: a module off the plan] in coordinator.py: a module without a like sibling that no rank ran in the
    forward recorded together, run by some ranks later, is gathered by those ranks only; every rank raises before
    the collective, naming it and the declaration that trains it. Declared in `conditional_modules`, the program
    trains to DDP's numbers."""
    for rank, r in enumerate(run_on_ranks(head_first_chosen_later, world_size=2, timeout=TIMEOUT, declared=False,
                                          container="attributes")):
        assert "error" in r and "'head_b' (rank 0)" in r["error"] and "conditional_modules" in r["error"], (rank, r)
    for rank, r in enumerate(run_on_ranks(head_first_chosen_later, world_size=2, timeout=TIMEOUT, declared=True,
                                          container="attributes")):
        assert r.get("losses") and not r["mismatched"], (rank, r)


def bart_layerdrop(steps=4, systems=("declared", "undeclared"), options=None, lora=False, no_grad=False):
    """A tiny BART built from its config (transformers' LayerDrop really skips a layer, also under ZeRO-3), each
    rank drawing its own layers, trained with the layers declared in `conditional_modules` (each layer gathered
    with its encoder or decoder on every rank: stock's numbers with a dummy pass) and with nothing declared. Per
    system: losses and parameters, or the z3ext error. `lora`: PEFT's LoRA on the attention's q and v projections
    (rank 4, as many as the layers) and a trained copy of the LM head. `no_grad`: after each step a no_grad forward in
    training mode (LayerDrop drawn per rank again), its loss among the losses."""
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext
    from transformers import BartConfig, BartForConditionalGeneration
    from tests.models import full_params
    config = BartConfig(vocab_size=64, d_model=16, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                        encoder_layerdrop=0.5, decoder_layerdrop=0.5, dropout=0.0, attention_dropout=0.0)
    rank, out = dist.get_rank(), {}
    for name in systems:
        z3 = {"enabled": True, **(options or {})}
        if name == "declared":
            z3["conditional_modules"] = ["BartEncoderLayer", "BartDecoderLayer"]
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "z3ext": z3,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        torch.manual_seed(0)
        model = BartForConditionalGeneration(config)  # partitioned by deepspeed.initialize
        if lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=["lm_head"],
                                                     target_modules=["q_proj", "v_proj"]))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.train()
        losses = []
        try:
            for i in range(steps):
                g = torch.Generator().manual_seed(10 * i + rank)
                ids = torch.randint(4, 64, (2, 8), generator=g)
                torch.manual_seed(1000 * i + 7 * rank)  # each rank its own layers
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if no_grad:
                    torch.manual_seed(5000 + 1000 * i + 7 * rank)
                    with torch.no_grad():
                        losses.append(engine(input_ids=ids, labels=ids).loss.item())
            out[name] = dict(losses=losses, params=full_params(engine))
        except deepspeed_z3ext.Z3extError as e:
            out[name] = dict(error=(type(e).__name__, str(e).splitlines()[0]))
        finally:
            engine.destroy()
    if "declared" not in out or "error" in out["declared"]:
        return out
    ref = out["declared"]
    close = lambda a, b: len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b))  # noqa: E731
    return {name: r if "error" in r else dict(losses=close(r["losses"], ref["losses"]), mismatched=[
        n for n in ref["params"] if not torch.allclose(ref["params"][n], r["params"][n], rtol=1e-5, atol=1e-6)])
        for name, r in out.items()}


@pytest.mark.parametrize("world", [2, 4])
def test_layerdrop_without_a_declaration_trains_as_with_the_layers_declared(world):
    """BART with `encoder_layerdrop`/`decoder_layerdrop` 0.5 and per-rank draws, nothing declared: the ranks record
    the first forward together and later gather the layers they drop ([Note: forwards that differ by rank] in
    coordinator.py); the numbers are those with every layer declared a conditional module (DDP's: each rank's
    gradient, zeros for a dropped layer, averaged) to the last bits (a declared
    layer runs without its module hooks, whose input boundary changes the order in which autograd sums a
    residual stream's gradient contributions: differences of about 1e-7). A rank whose decoder drops every layer
    never reaches the encoder's output in backward: the forward's graph still ends with that pass, as on the
    other ranks ([Note: one backward per graph] in graphs.py)."""
    for rank, r in enumerate(run_on_ranks(bart_layerdrop, world_size=world, timeout=TIMEOUT * world // 2)):
        u = r["undeclared"]
        assert "error" not in u and u["losses"] and not u["mismatched"], (rank, r)


def test_layerdrop_in_no_grad_forwards_without_a_declaration_gives_the_layers_declared_losses():
    """BART in training mode with a no_grad forward after each step (a reference's logits, a score): LayerDrop drops
    other layers on each rank there too; the no_grad forwards are recorded together and walked as training forwards
    are. Before, `ScheduleMismatchError` at the first no_grad forward whose ranks dropped different layers."""
    for rank, r in enumerate(run_on_ranks(bart_layerdrop, timeout=TIMEOUT, no_grad=True)):
        u = r["undeclared"]
        assert "error" not in u and u["losses"] and not u["mismatched"], (rank, r)


def test_layerdrop_with_peft_lora_without_a_declaration_trains_as_with_the_layers_declared():
    """PEFT's LoRA layer reads `lora_A.weight` before it calls `lora_A`: a parameter gathered outside any module's
    fetch, which the recorded forward's exchange now carries too ([Note: discoveries recorded together] in
    coordinator.py)."""
    for rank, r in enumerate(run_on_ranks(bart_layerdrop, timeout=TIMEOUT, lora=True)):
        u = r["undeclared"]
        assert "error" not in u and u["losses"] and not u["mismatched"], (rank, r)


def test_layerdrop_without_agreed_forwards_raises_naming_the_layer_on_every_rank():
    """`agree_forwards` off: the ranks' forwards gather different layers, and every rank raises
    `ScheduleMismatchError` naming a layer of each rank (gloo) rather than stock's abort on a size mismatch."""
    for rank, r in enumerate(run_on_ranks(bart_layerdrop, timeout=TIMEOUT, systems=("undeclared", ),
                                          options={"agree_forwards": False})):
        err = r["undeclared"].get("error")
        assert err is not None, f"rank {rank}: trained: the draws did not differ"
        assert err[0] == "ScheduleMismatchError" and "layers." in err[1], (rank, r)
