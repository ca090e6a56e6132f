"""Programs that do not run every module on every rank and every step (DESIGN "Invariants").

- Stale gradients: a trainable parameter that gets no gradient in an accumulation window steps on a zero
  gradient (ZeRO stage 1/2's numbers), never on an earlier window's ([Note: gradient partitions between
  steps] in grads.py). Reference: stock ZeRO-3 where the skipped modules get a zero gradient explicitly (a
  mixture-of-experts block marked a z3 leaf, whose backward hook gives unrouted experts zeros; or a branch
  touched with weight 0), so stock's stale partitions are never read.
- One module per expert, routing that differs by rank and by step, no leaf marked by hand: z3ext finds the
  block ([Note: conditional blocks] in conditional.py) and trains bitwise equal to stock ZeRO-3 with the
  block marked by hand (`deepspeed.utils.set_z3_leaf_modules`), fp32 and bf16, 2 and 4 ranks; greedy
  decoding afterwards gives the same tokens. Without the block (stock, or z3ext with the detection off) the
  ranks gather different experts: a size mismatch fails gloo, experts of one shape exchange wrong data.
- DeepSpeed's own MoE layer (`deepspeed.moe.layer.MoE`): DeepSpeed 0.19.8 refuses it under ZeRO-3, and so
  does z3ext, with the same error.
Every case runs on real gloo ranks under a hard timeout.
"""
import pytest

from tests.harness import run_on_ranks
from tests.training import train

HIDDEN, VOCAB, EXPERTS, SEQ = 16, 32, 4, 8
TIMEOUT = 300


def _model(deepspeed_moe=False):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tests.models import Expert, TopOneMoe

    class DsMoe(nn.Module):
        """DeepSpeed's MoE layer (top-1, one expert-parallel rank) with a residual."""

        def __init__(self):
            super().__init__()
            from deepspeed.moe.layer import MoE
            self.moe = MoE(HIDDEN, expert=Expert(HIDDEN), num_experts=EXPERTS, ep_size=1, k=1, min_capacity=SEQ * 4,
                           capacity_factor=float(EXPERTS), drop_tokens=False, use_rts=False)
            self.reached = []

        def forward(self, x):
            out, _, _ = self.moe(x)
            return x + out

    class Layer(nn.Module):

        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.mix = nn.Linear(HIDDEN, HIDDEN)
            self.moe = DsMoe() if deepspeed_moe else TopOneMoe(HIDDEN, EXPERTS)

        def forward(self, x):
            x = x + torch.tanh(self.mix(self.ln(x)))
            return self.moe(x)

    class MoeLM(nn.Module):

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(Layer() for _ in range(2))
            self.aux = nn.Linear(HIDDEN, 1)  # a branch some micro-steps skip (self.use_aux)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.use_aux = True
            self.touch_aux = False  # the reference: the skipped branch gets a zero gradient explicitly

        def hidden(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return x

        def forward(self, tokens):
            x = self.hidden(tokens)
            loss = F.cross_entropy(self.head(x).flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
            if self.use_aux:
                loss = loss + self.aux(x).float().pow(2).mean()
            elif self.touch_aux:
                loss = loss + 0.0 * self.aux(x).float().sum()
            return loss

        def logits(self, tokens):
            return self.head(self.hidden(tokens))

    return MoeLM()


def _engine(z3ext, leaf, dtype="fp32", ga=1, options=None, deepspeed_moe=False, zero=None):
    import torch
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **(zero or {})}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if z3ext:
        cfg["z3ext"] = {"enabled": True, **(options or {})}
    torch.manual_seed(5)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _model(deepspeed_moe)
    if leaf:
        kind = type(model.layers[0].moe.moe.deepspeed_moe) if deepspeed_moe else type(model.layers[0].moe)
        deepspeed.utils.set_z3_leaf_modules(model, [kind])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _plain_config(z3ext):
    """Stage 3, nothing persistent, AdamW, one micro-step per step; z3ext on or off."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if z3ext:
        cfg["z3ext"] = {"enabled": True}
    return cfg


def _tokens(i, rank, same_on_every_rank):
    import torch
    g = torch.Generator().manual_seed(100 * i + (0 if same_on_every_rank else rank))
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _blocks(engine):
    return [m for m in engine.module.modules() if getattr(m, "_z3_leaf", False)]


def _result(engine, losses):
    from tests.models import full_params
    return dict(losses=losses, params=full_params(engine),
                reached=[tuple(m.reached) for m in engine.module.modules() if hasattr(m, "reached")],
                leaves=[type(m).__name__ for m in _blocks(engine)])


def _compare(results):
    import torch
    stock, z3 = results["stock"], results["z3ext"]
    return dict(losses=(stock["losses"], z3["losses"]), z3_leaves=z3["leaves"], reached=z3["reached"],
                mismatched=[n for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])],
                tokens=(stock.get("tokens"), z3.get("tokens")))


# -- stale gradients ----------------------------------------------------------------------------------
def stale_experts(conditional_blocks):
    """Identical data on every rank; step 0 lets every expert take tokens, later steps only experts 0 and 1."""
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        engine = _engine(name == "z3ext", leaf=name == "stock", options={"conditional_blocks": conditional_blocks})

        def forward(engine, i):
            for layer in engine.module.layers:
                layer.moe.allowed = None if i == 0 else (0, 1)
            return engine(_tokens(i, rank, True))

        out[name] = _result(engine, train(engine, 4, forward=forward))
        engine.destroy()
    return _compare(out)


@pytest.mark.parametrize("conditional_blocks", [True, False], ids=["block", "per-module"])
def test_experts_without_tokens_step_on_zero_gradients(conditional_blocks):
    for rank, r in enumerate(run_on_ranks(stale_experts, timeout=TIMEOUT, conditional_blocks=conditional_blocks)):
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ from stock with the block as a leaf"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
        assert bool(r["z3_leaves"]) == conditional_blocks, r["z3_leaves"]
        later = [reached for layer in r["reached"] for reached in layer[1:]]
        assert later and all(set(x) <= {0, 1} for x in later), later


def skipped_branch(path):
    """ga 2; the aux branch runs in both micro-steps of step 0, then only in the second micro-step of each
    step: its first micro-step gets no gradient (stock then adds the second to the previous window's).
    `path`: "z3ext" (z3ext reduces gradients), "deepspeed" (`reduce_gradients: false`) or "offload"
    (`offload_optimizer`: DeepSpeed reduces, into the CPU optimizer's gradients)."""
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    options = {"reduce_gradients": False} if path == "deepspeed" else {}
    zero = {"offload_optimizer": {"device": "cpu"}} if path == "offload" else {}
    for name in ("stock", "z3ext"):
        engine = _engine(name == "z3ext", leaf=True, ga=2, options=options, zero=zero)
        engine.module.touch_aux = name == "stock"

        def forward(engine, i):  # micro-step i = 2 * step + micro
            engine.module.use_aux = i < 2 or i % 2 == 1
            return engine(_tokens(i, rank, False))

        out[name] = _result(engine, train(engine, 4, forward=forward, ga=2))
        engine.destroy()
    return _compare(out)


@pytest.mark.parametrize("path", ["z3ext", "deepspeed", "offload"])
def test_a_branch_skipped_in_one_micro_step_gets_no_stale_gradient(path):
    for rank, r in enumerate(run_on_ranks(skipped_branch, timeout=TIMEOUT, path=path)):
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ from stock with a zero gradient"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"


# -- one module per expert, routing by rank ---------------------------------------------------------
def routed_by_rank(dtype, deepspeed_moe=False, steps=3, new_tokens=4):
    import torch
    import torch.distributed as dist
    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        engine = _engine(name == "z3ext", leaf=name == "stock", dtype=dtype, deepspeed_moe=deepspeed_moe)
        losses = []
        for step in range(steps):
            loss = engine(_tokens(step, rank, False))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.eval()
        tokens = _tokens(99, rank, False)[:1, :4]
        with torch.no_grad():
            for _ in range(new_tokens):  # greedy decoding, a no_grad forward per token
                nxt = engine.module.logits(tokens)[:, -1].float().argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, nxt], 1)
        out[name] = _result(engine, losses)
        out[name]["tokens"] = tokens.tolist()
        if name == "z3ext":
            import deepspeed_z3ext
            out[name]["collectives"] = deepspeed_z3ext.stats(engine).collectives
        engine.destroy()
    r = _compare(out)
    r["collectives"] = out["z3ext"]["collectives"]
    return r


def _check_routed(results, deepspeed_moe=False):
    for rank, r in enumerate(results):
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ from stock with the block as a leaf"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
        assert r["tokens"][0] == r["tokens"][1], f"rank {rank}: decoded tokens differ"
        assert r["z3_leaves"], "z3ext did not find the mixture-of-experts blocks"
    assert len({r["collectives"] for r in results}) == 1, [r["collectives"] for r in results]
    if not deepspeed_moe:  # the ranks' tokens reached different experts in some forward
        assert len({str(r["reached"]) for r in results}) > 1, "routing did not differ by rank: the test shows nothing"


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (2, "bf16"), (4, "fp32"), (4, "bf16")])
def test_per_expert_moe_routed_by_rank_equals_stock_with_a_leaf(world, dtype):
    _check_routed(run_on_ranks(routed_by_rank, world_size=world, timeout=TIMEOUT * world // 2, dtype=dtype))


def deepspeed_moe_at_initialize(z3ext):
    from deepspeed_z3ext import conditional
    found = [(b.name, type(b.block).__name__, b.experts) for b in conditional.find(_model(deepspeed_moe=True))]
    try:
        _engine(z3ext, leaf=False, deepspeed_moe=True)
    except AssertionError as e:
        return found, str(e)
    return found, None


def test_deepspeed_moe_layer_is_refused_as_stock_refuses_it():
    """DeepSpeed 0.19.8 refuses its own MoE layer under ZeRO-3 (`_validate_zero3_moe_compatibility`: "Use
    AutoEP"): z3ext raises the same at initialize; its detection finds the layer's block (MOELayer: the gate's
    (experts, d) weight beside `Experts.deepspeed_experts`) for a DeepSpeed that allows it."""
    for z3ext in (False, True):
        for found, message in run_on_ranks(deepspeed_moe_at_initialize, timeout=TIMEOUT, z3ext=z3ext):
            assert message and "not supported with ZeRO Stage 3" in message, (z3ext, message)
            assert found == [(f"layers.{i}.moe.moe.deepspeed_moe", "MOELayer", EXPERTS) for i in range(2)], found


def test_detection_finds_expert_blocks_only():
    import torch.nn as nn
    from deepspeed_z3ext import conditional
    from tests.models import TinyGPT
    model = _model()
    found = conditional.find(model)
    assert [b.name for b in found] == ["layers.0.moe", "layers.1.moe"], found
    assert all(b.experts == EXPERTS for b in found)
    # 16 layers beside a (16, 32) position table look like experts and a router: bounded by a fetch group
    # ([Note: a bounded guess]), never gathered whole when larger
    gpt = TinyGPT(layers=16, seq=16)
    assert conditional.find(gpt, sum(p.numel() for p in gpt.parameters()) // 2) == []
    moe_at_root = nn.Sequential(nn.Linear(4, 2), nn.ModuleList(nn.Linear(4, 4) for _ in range(2)))
    assert [(b.name, b.experts) for b in conditional.find(moe_at_root)] == [("<root>", 2)]

    class RouterDE(nn.Module):  # the router stored (d, experts), applied as x @ router
        def __init__(self):
            super().__init__()
            self.router = nn.Parameter(torch.zeros(8, 3))
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    import torch
    assert [(b.name, b.experts) for b in conditional.find(nn.Sequential(RouterDE()))] == [("0", 3)]


def test_lora_adapters_as_many_rows_as_layers_are_no_router():
    """PEFT's LoRA on a BART of 4 encoder and 4 decoder layers with rank 4: each adapter's (4, d) matrix, inside the
    other stack's layers, looked like a router of the 4 layers, and the whole model became one z3 leaf, whose
    backward hook ran before its parameters' gradients (its inputs need none): every step reduced zeros. A router
    sits beside its experts, inside no list of modules ([Note: conditional blocks] in conditional.py)."""
    from peft import LoraConfig, get_peft_model
    from transformers import BartConfig, BartForConditionalGeneration
    from deepspeed_z3ext import conditional
    config = BartConfig(vocab_size=64, d_model=16, encoder_layers=4, decoder_layers=4, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
    model = get_peft_model(BartForConditionalGeneration(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert conditional.find(model) == []


def leaf_after_frozen_layers():
    """A z3 leaf marked by hand right after a frozen embedding: its full backward hook runs with its output's
    gradient, before its parameters' gradients exist (stock ZeRO-3 releases the block there and its backward
    fails on the partitioned weights; z3ext at d8922c6 reduced zeros for them: the block never trained). z3ext
    reduces the gradients that came ([Note: fixed gradient layout] in grads.py): stock's numbers without the
    leaf mark, DDP's here (every rank gets every gradient)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    from tests.models import Expert, full_params

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.block = Expert(HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, tokens):
            logits = self.head(torch.tanh(self.block(self.embed(tokens))))
            return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten())

    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        cfg = _plain_config(name == "z3ext")
        torch.manual_seed(5)
        model = Net()
        model.embed.weight.requires_grad_(False)
        if name == "z3ext":
            deepspeed.utils.set_z3_leaf_modules(model, [Expert])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train(engine, 3, forward=lambda e, i: e(_tokens(i, rank, False)))
        out[name] = dict(losses=losses, params=full_params(engine))
        engine.destroy()
    ref, z3 = out["stock"], out["z3ext"]
    return dict(losses=z3["losses"] == ref["losses"],
                mismatched=[n for n in ref["params"] if not torch.equal(ref["params"][n], z3["params"][n])])


def test_a_leaf_whose_inputs_need_no_gradient_trains_on_its_gradients():
    for rank, r in enumerate(run_on_ranks(leaf_after_frozen_layers, timeout=TIMEOUT)):
        assert r["losses"] and not r["mismatched"], (rank, r)


@pytest.mark.parametrize("layers", [2, 8, 16, 48])
def test_a_plain_model_of_any_depth_is_never_one_unit(layers):
    """A stack of as many layers as a raw (layers, d) parameter has rows looks like experts beside a router
    ([Note: a bounded guess] in conditional.py): wrapped the way HF wraps a model, no unit larger than a fetch
    group is made of it, so the model is never gathered whole; with the table an nn.Embedding it is no router."""
    import torch.nn as nn
    from deepspeed_z3ext import conditional
    from tests.models import TinyGPT

    class Wrapper(nn.Module):  # e.g. XForCausalLM around XModel
        def __init__(self, inner):
            super().__init__()
            self.model = inner

    model = Wrapper(TinyGPT(layers=layers, seq=layers))
    total = sum(p.numel() for p in model.parameters())
    for bound in (total // 2, total // layers):
        assert all(b.numel <= bound for b in conditional.find(model, bound)), bound
    assert conditional.find(model, total // 2) == []
    embedded = Wrapper(TinyGPT(layers=layers, seq=layers))
    embedded.model.pos = None
    embedded.model.pos_table = nn.Embedding(layers, 32)
    assert conditional.find(embedded) == []


def _router_de_moe(at_root):
    """A mixture of one module per expert whose router is a raw (d, experts) parameter applied as `x @ router`
    (research code's layout, not an nn.Linear's (experts, d)), top-1; `at_root`: the model itself is the block
    (router, experts, embedding and head at its root), else the block sits in each of two layers."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from tests.models import Expert

    def route(x, router, experts, reached, touched):
        flat = x.reshape(-1, x.shape[-1])
        weight, pick = torch.softmax(flat @ router, -1).max(-1)
        out, hit = torch.zeros_like(flat), []
        for e, expert in enumerate(experts):
            rows = (pick == e).nonzero().flatten()
            if rows.numel():
                hit.append(e)
                out = out.index_add(0, rows, weight[rows, None] * expert(flat[rows]))
            elif touched is not None:  # stock's workaround: an expert no token reached runs, its output times 0.0
                touched.append(0.0 * expert(flat).float().sum())
        reached.append(tuple(hit))
        return x + out.view_as(x)

    def loss_of(model, x, tokens):
        loss = F.cross_entropy(model.head(x).flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        return loss + sum(model.touched) if model.touched else loss

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Parameter(torch.randn(HIDDEN, EXPERTS))
            self.experts = nn.ModuleList(Expert(HIDDEN) for _ in range(EXPERTS))
            self.reached, self.touched = [], None

        def forward(self, x):
            return route(x, self.router, self.experts, self.reached, self.touched)

    class Layered(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.layers = nn.ModuleList(nn.ModuleDict(dict(mix=nn.Linear(HIDDEN, HIDDEN), moe=Block()))
                                        for _ in range(2))
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.touched = None

        def forward(self, tokens):
            x = self.embed(tokens)
            if self.touched is not None:
                self.touched.clear()
            for layer in self.layers:
                layer["moe"].touched = self.touched
                x = layer["moe"](x + torch.tanh(layer["mix"](x)))
            return loss_of(self, x, tokens)

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.router = nn.Parameter(torch.randn(HIDDEN, EXPERTS))
            self.experts = nn.ModuleList(Expert(HIDDEN) for _ in range(EXPERTS))
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.reached, self.touched = [], None

        def forward(self, tokens):
            if self.touched is not None:
                self.touched.clear()
            x = route(self.embed(tokens), self.router, self.experts, self.reached, self.touched)
            return loss_of(self, x, tokens)

    return (Root if at_root else Layered)()


def router_de_by_rank(at_root, steps=3):
    """z3ext with nothing declared against stock with its workaround (every expert no token reached runs, its output
    times 0.0 in the loss: each rank gathers every expert, zeros for the unreached ones: DDP's numbers with stock's
    arithmetic), each rank's tokens its own."""
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext
    from tests.models import full_params
    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        cfg = _plain_config(name == "z3ext")
        torch.manual_seed(5)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = _router_de_moe(at_root)
        if name == "stock":
            model.touched = []
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train(engine, steps, forward=lambda e, i: e(_tokens(i, rank, False)))
        out[name] = dict(losses=losses, params=full_params(engine),
                         reached=[tuple(m.reached) for m in engine.module.modules() if hasattr(m, "reached")])
        if name == "z3ext":
            out["collectives"] = deepspeed_z3ext.stats(engine).collectives
        engine.destroy()
    ref, z3 = out["stock"], out["z3ext"]
    return dict(losses=z3["losses"] == ref["losses"], reached=str(z3["reached"]), collectives=out["collectives"],
                mismatched=[n for n in ref["params"] if not torch.equal(ref["params"][n], z3["params"][n])])


@pytest.mark.parametrize("where,world", [("in-layers", 2), ("at-root", 2), ("in-layers", 4), ("at-root", 4)])
def test_per_expert_moe_with_a_d_by_e_router_trains_to_ddps_numbers(where, world):
    """Two layouts a guess from the module tree could miss: a router stored (d, experts), and the block at the
    model's root. Every rank issues the same collectives and steps on the workaround's numbers bitwise."""
    results = run_on_ranks(router_de_by_rank, world_size=world, timeout=TIMEOUT * world // 2,
                           at_root=where == "at-root")
    for rank, r in enumerate(results):
        assert r["losses"] and not r["mismatched"], (rank, r)
    assert len({r["collectives"] for r in results}) == 1, [r["collectives"] for r in results]
    assert len({r["reached"] for r in results}) > 1, "routing did not differ by rank: the test shows nothing"


# -- a module some ranks skip ([Note: conditional modules]) ------------------------------------------
def _multimodal():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from tests.models import Expert

    class Multimodal(nn.Module):
        """A text model with a vision tower that batches without an image skip ("skip"); stock's way is a
        dummy input whose output counts 0 times ("dummy")."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.tower = Expert(HIDDEN)  # the vision tower
            self.mix = nn.Linear(HIDDEN, HIDDEN)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, tokens, image, mode):
            x = self.embed(tokens)
            if mode == "run":
                x = x + self.tower(image).unsqueeze(1)
            elif mode == "dummy":
                x = x + 0.0 * self.tower(image).unsqueeze(1)
            logits = self.head(torch.tanh(self.mix(x)))
            return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())

    return Multimodal()


# (step, micro) -> the ranks that run the tower; the others skip it (z3ext) or feed it a dummy (stock)
TOWER_RUNS = [[{0}, {0, 1}], [{1}, set()], [set(), set()], [{0, 1, 2, 3}, {2}]]


def skipped_by_some_ranks(dtype, declared=True, agree=True):
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext
    from tests.models import full_params
    rank, out = dist.get_rank(), {}
    for name in ("stock", "z3ext"):
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "torch_adam": True}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if name == "z3ext":
            cfg["z3ext"] = {"enabled": True, "conditional_modules": ["tower"] if declared else [],
                            "agree_forwards": agree}
        torch.manual_seed(11)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = _multimodal()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses, counts = [], []
        for step, micros in enumerate(TOWER_RUNS):
            for micro, runs in enumerate(micros):
                i = 2 * step + micro
                g = torch.Generator().manual_seed(1000 * i + rank)
                tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
                image = torch.randn(2, HIDDEN, generator=g)
                if dtype == "bf16":
                    image = image.bfloat16()
                mode = "run" if rank in runs else ("dummy" if name == "stock" else "skip")
                if declared or agree:
                    loss = engine(tokens, image, mode)
                else:
                    try:
                        loss = engine(tokens, image, mode)
                    except deepspeed_z3ext.Z3extError as e:
                        engine.destroy()
                        return dict(error=(type(e).__name__, str(e).splitlines()[0], i))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                if name == "z3ext":
                    counts.append(deepspeed_z3ext.stats(engine).collectives)
        out[name] = dict(losses=losses, params=full_params(engine), counts=counts)
        engine.destroy()
    stock, z3 = out["stock"], out["z3ext"]
    return dict(losses=(stock["losses"], z3["losses"]), counts=z3["counts"],
                mismatched=[n for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])])


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (2, "bf16"), (4, "fp32")])
def test_a_module_some_ranks_skip_trains_as_with_a_dummy_input(world, dtype):
    results = run_on_ranks(skipped_by_some_ranks, world_size=world, timeout=TIMEOUT * world // 2, dtype=dtype)
    for rank, r in enumerate(results):
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ from stock with a dummy input"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
    assert len({str(r["counts"]) for r in results}) == 1, [r["counts"] for r in results]


@pytest.mark.parametrize("world", [2, 4])
def test_an_undeclared_module_some_ranks_skip_trains_as_with_a_dummy_input(world):
    """Nothing declared, the tower skipped by some ranks from the first micro-step on (rank 0 runs it, rank 1 does
    not): the first forward is recorded by the ranks together, later ones gather the tower where they skip it
    ([Note: forwards that differ by rank] in coordinator.py); stock's numbers with a dummy input, bitwise."""
    results = run_on_ranks(skipped_by_some_ranks, world_size=world, timeout=TIMEOUT * world // 2, dtype="fp32",
                           declared=False)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r}"
        assert r["losses"][0] == r["losses"][1], f"rank {rank}: losses differ from stock with a dummy input"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
    assert len({str(r["counts"]) for r in results}) == 1, [r["counts"] for r in results]


def test_an_undeclared_module_some_ranks_skip_raises_without_agreed_forwards():
    """`agree_forwards` off: the ranks' forwards gather different modules at the first micro-step whose ranks
    differ: every rank raises `ScheduleMismatchError` there, before the collective, naming each rank's module
    (gloo; [Note: agree before the collective])."""
    for rank, r in enumerate(run_on_ranks(skipped_by_some_ranks, timeout=TIMEOUT, dtype="fp32", declared=False,
                                          agree=False)):
        assert "error" in r, f"rank {rank}: trained without an error: {r}"
        kind, line, micro_step = r["error"]
        assert kind == "ScheduleMismatchError" and micro_step == 0, (rank, r)
        assert "tower" in line, (rank, line)


def bad_conditional_modules(entry):
    try:
        _engine(True, leaf=False, options={"conditional_modules": [entry]})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_conditional_modules_name_what_is_wrong():
    for entry, want in (("layers.0.mo", "did you mean 'layers.0.moe'"), ("Expertz", "did you mean 'Expert'"),
                        ("", "the model itself")):
        message = run_on_ranks(bad_conditional_modules, timeout=TIMEOUT, entry=entry)[0]
        assert message and message.startswith("Z3extConfigError") and want in message, (entry, message)
