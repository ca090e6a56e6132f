"""Small models, configs and data shared by the tests (and the CPU demo in the bench); the training loop
they share is tests/training.py."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):

    def __init__(self, vocab=64, hidden=32, heads=4, layers=2, seq=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.skip = ()  # block indices to skip: changes the module order (plan divergence)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for i, blk in enumerate(self.blocks):
            if i in self.skip:
                continue
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, dims=1).flatten())


class Expert(nn.Module):
    """An MLP: one expert of a mixture (or any small tower)."""

    def __init__(self, hidden, act=F.gelu):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.act = act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class TopOneMoe(nn.Module):
    """Top-1 routing over one module per expert (no leaf marked): which experts run differs by rank and step.
    `allowed` (experts, or None) masks the others out; `reached` records each forward's experts."""

    def __init__(self, hidden, experts, act=F.gelu):
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, act) for _ in range(experts))
        self.allowed = None
        self.reached = []

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        if self.allowed is not None:
            mask = torch.full((len(self.experts), ), float("-inf"), dtype=logits.dtype)
            mask[list(self.allowed)] = 0
            logits = logits + mask
        weight, pick = torch.softmax(logits, -1).max(-1)
        out = torch.zeros_like(flat)
        reached = []
        for e, expert in enumerate(self.experts):
            rows = (pick == e).nonzero().flatten()
            if rows.numel():
                reached.append(e)
                out = out.index_add(0, rows, weight[rows, None] * expert(flat[rows]))
        self.reached.append(tuple(reached))
        return x + out.view_as(x)


def ds_config(z3ext=False, persistence=None, mel=True, ga=2, extra=None, zero_extra=None):
    zero = {"stage": 3, "memory_efficient_linear": mel}
    if persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    zero.update(zero_extra or {})
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if z3ext:
        cfg["z3ext"] = z3ext
    cfg.update(extra or {})
    return cfg


def build_engine(config, model_fn=TinyGPT, seed=1234, inside_init=True, model=None):
    import deepspeed
    import deepspeed_z3ext  # installs the seams; without it DeepSpeed would ignore "z3ext" silently
    torch.manual_seed(seed)
    if model is None:
        if inside_init:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = model_fn()
        else:
            model = model_fn()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    wanted = config.get("z3ext") in (True, ) or (isinstance(config.get("z3ext"), dict) and config["z3ext"].get("enabled"))
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    assert bool(wanted) == hasattr(offload, "z3ext"), "z3ext enabled state differs from the config"
    if not wanted:
        without_stale_gradients(engine)
    return engine


def without_stale_gradients(engine):
    """Stock ZeRO-3 as the reference where it is wrong: a parameter that gets no gradient in a window (a block
    a forward skipped, frozen mid-training) steps on stock's partition from an earlier window; ZeRO stage 1/2
    and z3ext ([Note: gradient partitions between steps]) step on zeros. Stock's partitions are zeroed after
    each optimizer step, which changes nothing where every parameter gets a gradient in each window."""
    step = engine.step

    def step_then_zero(*args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        out = step(*args, **kwargs)
        buffer = getattr(engine.optimizer, "grad_partitions_flat_buffer", None)
        if boundary and buffer is not None:
            buffer.zero_()
        return out

    engine.step = step_then_zero
    return engine


def batch(step, rank, vocab=64, seq=16, bsz=2):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (bsz, seq), generator=g)


def full_params(engine):
    """Every parameter's full value, by name (gathered through GatheredParameters)."""
    import deepspeed
    out = {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            out[n] = p.detach().clone()
    return out
