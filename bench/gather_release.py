"""Headline benchmark: the all-gather limit, unsharded model, stock ZeRO-3, z3ext and FSDP2, side by side.

    python bench/gather_release.py            # GPUs: one rank per visible GPU; no GPU: 2 CPU ranks (gloo)
    torchrun --nproc_per_node N bench/gather_release.py
    python bench/gather_release.py --sim-world 64   # rank 0 of a simulated world of 64 on one device

On a machine with exactly one GPU and neither --world nor --sim-world, the world-1 run (no sharding
at all) is followed by a simulated world of 8 (`--sim-world 0` turns that off). A simulated world
shards, gathers, reduces and steps as rank 0 of N ranks through collectives that do nothing: per-rank memory and host time are real, communication
time is zero and values are wrong. Results go to a new bench/out/<machine>-<commit>-<UTC time>.json
(untracked; the plot beside it) unless --out is given. A legend under the table says what each column
and system name means.

All systems live in the same processes and are measured in interleaved rounds (median over rounds),
so drift hits them alike. On CPU the numbers only show host overhead (gather/release bookkeeping),
not what a GPU run would show: the targets under the table are device targets, shown there without a
verdict.
"""
import argparse
import gc
import json
import os
import warnings

# The bench prints its progress, table and results; library deprecation notices would bury them.
# PYTHONWARNINGS carries the filter into the ranks' processes before they import anything.
_QUIET = "ignore::DeprecationWarning,ignore::FutureWarning"
os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), _QUIET) if w)
for _category in (DeprecationWarning, FutureWarning):
    warnings.filterwarnings("ignore", category=_category)
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostmem  # noqa: E402  (a CPU rank's memory, [Note: CPU peak])
import outname  # noqa: E402  (one results file per run)
import simworld  # noqa: E402  (bench/simworld: the simulated world's backend, [Note: simulated world] in noop_pg.cpp)
OUT_DIR = outname.OUT_DIR  # default for every bench's results: git-ignored, so a run leaves the checkout clean
SYSTEMS = ("unsharded", "stock", "z3ext", "fsdp2", "stock-mel", "z3ext-mel", "fsdp2-mel")
TORCH_LINEAR = F.linear  # before any zero.Init can replace it ([Note: bench linear])
# "<system>-mel": the system under DeepSpeed's process-wide linear replacement ([Note: bench linear]):
# DeepSpeed's defaults for stock and z3ext; for FSDP2 and unsharded, what a process that ran zero.Init
# gets. Optional: "z3ext-nohold" (hold_for_backward off: re-gathers in backward), "z3ext-nopool"
# (pool_budget_mb 0: released buffers go back to torch's allocator), "z3ext-dsgrads" (gradients reduced
# by DeepSpeed's stage-3 path: z3ext.reduce_gradients false), "z3ext-nogroups" (one fetch unit per
# module: z3ext.fetch_group_numel 0), "z3ext-memberclaims" / "z3ext-blockclaims" (a block not held is
# gathered again for backward member by member / as one unit: z3ext.fetch_group_claim_numel 0 / 1e12),
# "z3ext-divide" (stock's divide pass before the reduce-scatter: z3ext.divide_after_reduce false),
# "z3ext@N" (the sweep).
# What each name means in plain words, for the legend under the table (`legend`).
BASES = {
    "unsharded": "the whole model on every rank, plain PyTorch: nothing to fetch (the speed to aim for)",
    "stock": "DeepSpeed ZeRO-3 as shipped: each rank keeps 1/N of the weights and fetches the rest from the "
             "other ranks when a layer runs",
    "z3ext": "the same ZeRO-3 engine with this package fetching and freeing the weights",
    "fsdp2": "PyTorch's own sharding (FSDP2, one unit per block), the same idea as ZeRO-3",
}
VARIANTS = {
    "mel": "with DeepSpeed's memory_efficient_linear on: every Linear layer in the process goes through "
           "DeepSpeed's slower replacement (DeepSpeed's default for stock and z3ext; off in the others)",
    "nohold": "z3ext with hold_for_backward off: weights fetched for the forward are fetched again for the backward",
    "nopool": "z3ext with pool_budget_mb 0: freed weight buffers go back to torch instead of being reused",
    "dsgrads": "z3ext with gradients reduced by DeepSpeed's own code (reduce_gradients false)",
    "freegrads": "z3ext with free_grad_partitions true: gradient shares freed between steps",
    "keepgrads": "z3ext with free_grad_partitions false: gradient shares kept between steps",
    "nogroups": "z3ext fetching layer by layer (fetch_group_numel 0) instead of whole blocks at once",
    "memberclaims": "z3ext re-fetching a block for backward layer by layer (fetch_group_claim_numel 0)",
    "blockclaims": "z3ext re-fetching a block for backward all at once (fetch_group_claim_numel 1e12)",
    "hpz": "ZeRO++ hpZ: a second copy of the weights shared within each node of --hpz ranks",
    "divide": "z3ext dividing gradients before their reduction, as stock does (divide_after_reduce false)",
    "nowatch": "z3ext without the hang watchdog (hang_timeout 0): no collective recorded, no watchdog thread",
}


# ---------------------------------------------------------------------------------------------- models
class GPTBlock(nn.Module):

    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(h, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.ln2(x))

    def mlp(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class GPT(nn.Module):

    def __init__(self, vocab, hidden, layers, heads, block=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList((block or GPTBlock)(hidden, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())


class Expert(nn.Module):

    def __init__(self, h, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-k routing over `experts` expert modules, each its own module in a ModuleList (DeepSpeed's MoE layer,
    Switch, most research code): a Python loop over the experts the tokens reach."""

    def __init__(self, h, experts, ffn, topk, routing="position"):
        super().__init__()
        self.topk, self.routing = topk, routing
        self.router = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, ffn) for _ in range(experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.softmax(self.router(flat).float(), dim=-1)
        if self.routing == "learned":
            weights, chosen = scores.topk(self.topk, dim=-1)
        else:
            # [Note: bench routing] In a simulated world the gathered weights are wrong, so learned routing
            # follows garbage: z3ext's 2 blocks ran 4 expert calls where the unsharded model's ran 63 (2 x 32 experts,
            # top 2, 128 tokens, simulated world 8), and the step compared different work. Token i goes to
            # experts (i*k + j) mod E (balanced, the same on every system and world); the router still weighs them.
            n, e = flat.shape[0], scores.shape[-1]
            chosen = ((torch.arange(n, device=flat.device)[:, None] * self.topk
                       + torch.arange(self.topk, device=flat.device)) % e)
            weights = scores.gather(1, chosen)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot, None].to(flat.dtype))
        return out.view_as(x)


class MoEBlock(GPTBlock):
    """A GPT block whose MLP is a mixture of per-expert modules."""

    def __init__(self, h, heads, experts, ffn, topk, routing="position"):
        nn.Module.__init__(self)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.moe = MoE(h, experts, ffn, topk, routing)

    def mlp(self, x):
        return self.moe(x)


class LinearStack(nn.Module):
    """Many small parameters: the host-bound case (issue target: 200 x Linear(64, 64))."""

    def __init__(self, n, width):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.square().mean()


def make_model(a):
    if a.model == "gpt":
        return GPT(a.vocab, a.hidden, a.layers, a.heads)
    if a.model == "moe":
        ffn = a.expert_ffn or max(1, a.hidden // 2)
        return GPT(a.vocab, a.hidden, a.layers, a.heads,
                   block=lambda h, heads: MoEBlock(h, heads, a.experts, ffn, a.topk, a.moe_routing))
    return LinearStack(a.layers, a.hidden)


def make_input(a, device, tiny=False):
    g = torch.Generator().manual_seed(7)
    if a.model in ("gpt", "moe"):
        shape = (1, 8) if tiny else (a.micro_batch, a.seq)
        return torch.randint(0, a.vocab, shape, generator=g).to(device)
    rows = 1 if tiny else a.micro_batch * a.seq
    return torch.randn(rows, a.hidden, generator=g).to(device)


# ---------------------------------------------------------------------------------------------- systems
def ds_config(a, z3ext, z3ext_options=None, prefetch_bucket=None, mel=False, hpz=False):
    cfg = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": a.persistence,
            "stage3_prefetch_bucket_size": a.prefetch_bucket if prefetch_bucket is None else prefetch_bucket,
            "stage3_max_live_parameters": a.max_live,
            "overlap_comm": True,
            # [Note: bench linear] zero.Init with memory_efficient_linear (DeepSpeed's default) replaces
            # torch.nn.functional.linear for the whole process, for good: every later Linear, the unsharded
            # and FSDP2 models' too, pays an autograd.Function whose apply binds its signature with inspect
            # on every call. Off by default here (a tuned knob, the same for stock and z3ext); each system
            # also runs with the linear it was built with (`System.linear`).
            "memory_efficient_linear": a.memory_efficient_linear or mel,
        },
        "steps_per_print": 10**9,
    }
    if hpz:  # ZeRO++ hpZ: a secondary partition per node of a.hpz ranks ([Note: hpZ secondary partition])
        cfg["zero_optimization"]["zero_hpz_partition_size"] = a.hpz
    if a.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if a.gradient_clipping is not None:
        cfg["gradient_clipping"] = a.gradient_clipping
    if z3ext:
        cfg["z3ext"] = dict(enabled=True, **(z3ext_options or {}))
    return cfg


class System:
    """One way of running the model: `forward(x)`, `backward(loss)`, `step()`."""

    def __init__(self, name, model, forward, backward, step, resident, linear=None):
        self.name, self.model, self.forward, self.backward, self.step = name, model, forward, backward, step
        self.resident = resident
        self.linear = linear or TORCH_LINEAR  # see [Note: bench linear]


def _opt(params, a, device):
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def build_system(name, a, device):
    import deepspeed
    import deepspeed_z3ext  # noqa: F401  (its seams must be installed before deepspeed.initialize)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    host = hostmem.HostMemory() if device.type == "cpu" else None
    if host and host.error:
        host = None
    # An earlier system of this process freed in a collection during this build would count against this one's
    # resident bytes (measured: a z3ext after FSDP2 showed 3.2 GB too little at 6.7B, simulated world 8).
    gc.collect()
    mem0 = torch.cuda.memory_allocated() if device.type == "cuda" else host.in_use() if host else 0
    # name = base[@bucket][-variant...]; variants: mel (any system), nohold, nopool, dsgrads (z3ext:
    # gradients reduced by DeepSpeed's stage-3 path, z3ext.reduce_gradients false) and freegrads
    # (z3ext.free_grad_partitions true, the default), keepgrads (false: stock's partitions kept between steps,
    # the default before conditional.py's change), nogroups (z3ext.fetch_group_numel
    # 0: one fetch unit per module, [Note: fetch groups]), lpkept (z3ext.partition_from_master false: stock's bf16
    # partitions beside the masters), layerrb (reduce_bucket_size: one GPT block's elements)
    # "<system>#K": a second copy of <system>, built and timed later in each round: the position's bias
    base, *variants = name.split("#")[0].split("-")
    unknown = [v for v in variants if v not in ("mel", "nohold", "nopool", "dsgrads", "freegrads", "keepgrads", "nogroups",
                                                "memberclaims", "blockclaims", "hpz", "divide", "nowatch", "lpkept", "layerrb")]
    if unknown or (base.split("@")[0] not in ("stock", "z3ext", "unsharded", "fsdp2")):
        raise ValueError(f"unknown system {name!r}")
    if "hpz" in variants and (a.hpz < 2 or base not in ("stock", "z3ext")):
        raise ValueError(f"{name!r}: the hpz variant is for stock and z3ext, with --hpz M (M >= 2)")
    mel = "mel" in variants
    if base.split("@")[0] in ("stock", "z3ext"):
        # "z3ext@N": z3ext gathering up to N elements per collective (the unit-size sweep)
        bucket = int(float(base.split("@")[1])) if "@" in base else None
        options = dict(hold_for_backward="nohold" not in variants)
        if "nopool" in variants:
            options["pool_budget_mb"] = 0
        if "dsgrads" in variants:
            options["reduce_gradients"] = False
        if "freegrads" in variants:
            options["free_grad_partitions"] = True
        if "keepgrads" in variants:
            options["free_grad_partitions"] = False
        if "nowatch" in variants:
            options["hang_timeout"] = 0
        if "lpkept" in variants:
            options["partition_from_master"] = False
        if "divide" in variants:
            options["divide_after_reduce"] = False
        if "nogroups" in variants:
            options["fetch_group_numel"] = 0
        if "memberclaims" in variants or "blockclaims" in variants:
            options["fetch_group_claim_numel"] = 0 if "memberclaims" in variants else 10**12
        cfg = ds_config(a, base.startswith("z3ext"), options, prefetch_bucket=bucket, mel=mel, hpz="hpz" in variants)
        if "layerrb" in variants:  # gradients reduced a transformer block at a time (DeepSpeed's default: 5e8 elements)
            cfg["zero_optimization"]["reduce_bucket_size"] = 12 * a.hidden ** 2 + 13 * a.hidden
        from deepspeed.utils import groups
        # DeepSpeed makes the hpZ intra-node group once per process: later hpZ engines reuse it.
        hpz_group = groups._get_zero_param_intra_parallel_group() if "hpz" in variants else None
        with deepspeed.zero.Init(config_dict_or_path=cfg, zero_param_parallel_group=hpz_group):
            model = make_model(a)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                          optimizer=lambda ps: _opt(ps, a, device))
        sys_ = System(name, engine, engine, engine.backward, engine.step, 0, linear=F.linear)
        F.linear = TORCH_LINEAR
    elif base == "unsharded":
        with torch.device(device):  # built in place: a 6.7B model's CPU init alone takes tens of seconds
            model = make_model(a)
        model = model.to(dtype=dtype)
        opt = _opt(model.parameters(), a, device)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        sys_ = System(name, model, model, lambda loss: loss.backward(), step, 0)
    elif base == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        with torch.device(device):
            model = make_model(a)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if a.dtype == "bf16" else None
        kw = {"mp_policy": mp} if mp else {}
        for blk in model.blocks:
            fully_shard(blk, **kw)
        fully_shard(model, **kw)
        opt = _opt(model.parameters(), a, device)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        sys_ = System(name, model, model, lambda loss: loss.backward(), step, 0)
    else:
        raise ValueError(name)
    if mel and base in ("unsharded", "fsdp2"):
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        sys_.linear = zero3_linear_wrap
    if device.type == "cuda":
        torch.cuda.synchronize()
        sys_.resident = torch.cuda.memory_allocated() - mem0
    elif host:  # [Note: CPU peak]
        sys_.resident = host.in_use() - mem0
    return sys_


# ---------------------------------------------------------------------------------------------- timing
class Clock:

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def time_train_step(s, x, clock):
    F.linear = s.linear
    t0 = clock.now()
    loss = s.forward(x)
    t1 = clock.now()
    s.backward(loss)
    t2 = clock.now()
    s.step()
    t3 = clock.now()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def time_tiny_forward(s, x, clock):
    F.linear = s.linear
    with torch.no_grad():
        t0 = clock.now()
        s.forward(x)
        return (clock.now() - t0) * 1e3


def raw_all_gather(a, device, unit_bytes, total_bytes, repeats):
    """The limit: all-gather of the model's bytes in the benchmark's unit sizes (nccl-tests algbw)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    elt = 2 if a.dtype == "bf16" else 4
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    numel = max(unit_bytes // elt // world, 1)
    n_units = max(total_bytes // (numel * world * elt), 1)
    out = torch.empty(numel * world, dtype=dtype, device=device)
    inp = out.narrow(0, dist.get_rank() * numel, numel)
    clock = Clock(device)
    times = []
    for i in range(repeats + 2):
        t0 = clock.now()
        for _ in range(n_units):
            dist.all_gather_into_tensor(out, inp)
        t = (clock.now() - t0) * 1e3
        if i >= 2:
            times.append(t)
    ms = statistics.median(times)
    algbw = n_units * out.numel() * elt / (ms / 1e3) / 1e9
    # The same bytes with each unit split 3:1:4:4 (a GPT block's qkv, proj, fc1, fc2) and gathered in
    # one coalesced call per unit, in place, as z3ext gathers a batch ([Note: parameter-major buckets]).
    pg = dist.distributed_c10d._get_default_group()
    sizes = [numel * k // 12 for k in (3, 1, 4, 4)]
    sizes[-1] += numel - sum(sizes)
    outs, ins, off = [], [], 0
    for n in sizes:
        outs.append(out.narrow(0, off, n * world))
        ins.append(outs[-1].narrow(0, dist.get_rank() * n, n))
        off += n * world
    coalesced = []
    for i in range(repeats + 2):
        t0 = clock.now()
        for _ in range(n_units):
            pg.allgather_into_tensor_coalesced(outs, ins).wait()
        t = (clock.now() - t0) * 1e3
        if i >= 2:
            coalesced.append(t)
    return dict(ms=ms, units=n_units, unit_bytes=out.numel() * elt, algbw_GBps=algbw,
                busbw_GBps=algbw * (world - 1) / world, coalesced_ms=statistics.median(coalesced))


# ---------------------------------------------------------------------------------------------- main
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    p.add_argument("--model", choices=["gpt", "moe", "linear"], default="gpt" if gpu else "linear",
                   help="moe: a GPT whose MLPs are --experts expert modules each (top --topk routing)")
    p.add_argument("--experts", type=int, default=32, help="moe: experts per block")
    p.add_argument("--topk", type=int, default=2, help="moe: experts per token")
    p.add_argument("--moe-routing", choices=["position", "learned"], default="position",
                   help="moe: experts chosen by token position (default: the same work on every system, as a "
                        "simulated world's gathered weights are not real) or by the router's top k")
    p.add_argument("--expert-ffn", type=int, default=None, help="moe: an expert's hidden width (default hidden / 2)")
    p.add_argument("--layers", type=int, default=16 if gpu else 200)
    p.add_argument("--hidden", type=int, default=2048 if gpu else 64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048 if gpu else 4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16" if gpu else "fp32")
    p.add_argument("--steps", type=int, default=5, help="timed steps per system per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over all steps)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--sweep", default="", help="z3ext bucket sizes (elements per collective) to add, e.g. 0,1e6,5e7,2e8")
    p.add_argument("--persistence", type=int, default=0 if not gpu else 100000)
    p.add_argument("--prefetch-bucket", type=int, default=50_000_000)
    p.add_argument("--max-live", type=int, default=1_000_000_000)
    p.add_argument("--memory-efficient-linear", action="store_true",
                   help="DeepSpeed's zero_optimization.memory_efficient_linear for stock and z3ext (default off)")
    p.add_argument("--world", type=int, default=None, help="ranks to spawn (default: GPUs, or 2 on CPU)")
    p.add_argument("--sim-world", type=int, default=None, metavar="N",
                   help="run rank 0 of a simulated world of N ranks on one device (GPU 0, or the CPU): collectives "
                        "do nothing, so per-rank memory and host time are real, communication time is zero and values "
                        "are wrong. Default: 8 after the world-1 run on a machine with exactly one GPU and no --world; "
                        "0: never")
    p.add_argument("--sim-backend", choices=["simworld", "fake"], default="simworld",
                   help="simulated world's backend: simworld (collectives do nothing; the reported numbers) or "
                        "torch's fake (copies the input into every chunk: O(N x tensors) work, for comparison)")
    p.add_argument("--out", default=None, help="JSON path (default bench/out/<machine>.json, untracked)")
    p.add_argument("--hpz", type=int, default=0, metavar="M",
                   help="ZeRO++ hpZ for the systems named <stock|z3ext>...-hpz: nodes of M ranks "
                        "(zero_hpz_partition_size); with --sim-world N, rank 0 of N in nodes of M")
    p.add_argument("--gradient-clipping", type=float, default=None,
                   help="DeepSpeed's gradient_clipping for stock and z3ext (default: DeepSpeed's, 1.0); FSDP2 and "
                        "unsharded never clip")
    p.add_argument("--smoke", action="store_true", help="tiny and fast (CI)")
    p.add_argument("--isolated", action="store_true",
                   help="each system in its own processes, one after another (a 6.6B model fits one system at a "
                        "time); no interleaving, so compare only runs made back to back")
    p.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # one system of an --isolated run
    a = p.parse_args(argv)
    if a.sim_world is not None and a.sim_world < 0:
        p.error("--sim-world takes a number of ranks (0: no simulated world)")
    if a.sim_world and a.world:
        p.error("--sim-world and --world exclude each other (a simulated world runs one process)")
    if a.smoke:  # three rounds: the targets' spread is over rounds (`targets`)
        a.layers, a.steps, a.rounds, a.warmup = min(a.layers, 20), 2, 3, 1
    return a


def machine_name(world, device, sim_world=None):
    """`<ranks>x<device>`; a simulated world is one device: `1x<device>-sim<N>`."""
    if sim_world:
        dev = torch.cuda.get_device_name(0).replace(' ', '-') if device.type == "cuda" else "CPU"
        return f"1x{dev}-sim{sim_world}"
    if device.type == "cuda":
        return f"{world}x{torch.cuda.get_device_name(0).replace(' ', '-')}"
    return f"{world}xCPU-gloo"


def nvml_snapshot():
    try:
        import pynvml
        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append(dict(sm_clock_MHz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                            power_W=pynvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                            used_MiB=pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20))
        return out
    except Exception as e:  # no NVML (CPU machine)
        return str(e)


class NvmlSampler:
    """Samples this rank's GPU SM clock (MHz) and power (W) on a thread every `period` seconds while a
    system's timed steps run (`with sampler.during(samples):`); a no-op without CUDA or NVML."""

    def __init__(self, device, period=None):
        # BENCH_NVML_PERIOD: seconds between samples, 0 (default) no sampling: the sampling thread shares the
        # GIL with the timed steps and slows the host-bound ones ([Note: bench host noise]).
        period = float(os.environ.get("BENCH_NVML_PERIOD", 0)) if period is None else period
        self.period, self.handle, self.error = period, None, None
        if device.type != "cuda" or period <= 0:
            self.error = None if device.type != "cuda" else "off (BENCH_NVML_PERIOD=0)"
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml = pynvml
            p = torch.cuda.get_device_properties(device)
            try:  # CUDA and NVML may number devices differently (CUDA_VISIBLE_DEVICES): match by PCI bus
                bus = f"{getattr(p, 'pci_domain_id', 0):08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
                self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception as e:  # no NVML: numbers without clocks and power
            self.error = f"{type(e).__name__}: {e}"[:200]

    def _loop(self, out, stop):
        nv, h = self.nvml, self.handle
        while not stop.wait(self.period):
            try:
                out["sm_clock_MHz"].append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
                out["power_W"].append(nv.nvmlDeviceGetPowerUsage(h) / 1e3)
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"[:200]
                return

    def during(self, out):
        sampler = self

        class _During:

            def __enter__(self):
                if sampler.handle is None:
                    return self
                out.setdefault("sm_clock_MHz", [])
                out.setdefault("power_W", [])
                self.stop = threading.Event()
                self.thread = threading.Thread(target=sampler._loop, args=(out, self.stop), daemon=True)
                self.thread.start()
                return self

            def __exit__(self, *exc):
                if sampler.handle is not None:
                    self.stop.set()
                    self.thread.join()

        return _During()


# [Note: bench host noise] A host-bound step moves with whatever else the host does in it. Two causes
# inside the process are counted per system and timed step (medians over rounds in the results):
# `gc_ms`, the time the Python collector ran (a full collection walks every object of the engines
# sharing the process), and `device_calls`, the CUDA caching allocator's device allocations and frees
# plus its retries (each `cudaMalloc`/`cudaFree` can synchronize the device): a system whose steady step
# needs new segments pays them at every step, not only in warm-up. On the H200 (2026-12-03) both were
# negligible (GC under 1.2 ms per step for every system, no device call in any timed step), but a third
# cause was not: the NVML sampler's thread, waking every 20 ms, took the GIL from the steps. With it,
# z3ext's tiny no_grad forward of the 0.94B GPT at simulated world 8 took 14.0 / 11.9 ms and its step
# 57.6 / 50.9; without it 9.8 / 7.9 and 49.2 / 48.2, while the unsharded model moved less (processes
# alternated, `bench/results/tiny-nvml-1xNVIDIA-H200-934954e.md`). Sampling is therefore off unless
# BENCH_NVML_PERIOD asks for it; every simulated-world table before that date ran with it.
def _gc_timer(pauses):
    started = []

    def timer(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    return timer


def _device_calls(device):
    if device.type != "cuda":
        return 0
    st = torch.cuda.memory_stats()
    return st.get("num_device_alloc", 0) + st.get("num_device_free", 0) + st.get("num_alloc_retries", 0)


def prime(a):
    """One throwaway training step and no_grad forward of a tiny plain model of the same kind, before any
    system is built: torch's one-time allocations (its compiler stack, imported at an optimizer's first
    use, about 24 MiB; thread pools) would otherwise count in the first system's CPU peak ([Note: CPU peak])."""
    small = argparse.Namespace(**dict(vars(a), layers=1, hidden=64, heads=4, vocab=256, seq=min(a.seq, 8)))
    model = make_model(small)
    opt = _opt(model.parameters(), small, torch.device("cpu"))
    model(make_input(small, "cpu")).backward()
    opt.step()
    with torch.no_grad():
        model(make_input(small, "cpu", tiny=True))


def run(a):
    import deepspeed
    import torch.distributed as dist
    import deepspeed_z3ext
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    names = [s for s in a.systems.split(",") if s] + [f"z3ext@{b}" for b in a.sweep.split(",") if b]
    if rank == 0:
        print(f"# building {len(names)} systems on each of {world} rank(s)", flush=True)
    if device.type == "cpu":
        prime(a)
    systems, skipped = {}, {}
    for n in names:
        try:
            systems[n] = build_system(n, a, device)
        except Exception as e:  # e.g. FSDP2 unavailable for this device/torch
            skipped[n] = f"{type(e).__name__}: {e}"[:200]
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in make_model_meta(a).parameters())
    elt = 2 if a.dtype == "bf16" else 4
    x, tiny = make_input(a, device), make_input(a, device, tiny=True)
    clock = Clock(device)
    samples = {n: dict(fwd=[], bwd=[], opt=[], step=[], tiny=[], peak=[], peak_over_base=[], held=[], base=[],
                       gc_ms=[], device_calls=[]) for n in systems}
    pauses = []  # [Note: bench host noise]
    gc_timer = _gc_timer(pauses)
    gc.callbacks.append(gc_timer)
    nvml, gpu = NvmlSampler(device), {n: {} for n in systems}  # clocks and power during each system's steps
    try:
        from tqdm import tqdm
        bar = tqdm(total=a.rounds * len(systems), disable=rank != 0, desc="bench", file=sys.stdout)
    except ImportError:
        bar = None
    # [Note: bench peak] A system's peak is what it holds when its timed steps start plus the rise over
    # that during them. What it holds is tallied per system (allocation at build, then every change
    # across its own calls: optimizer state, pools, parameters a tiny forward leaves gathered), since
    # the systems share the process and the others are idle meanwhile. Crediting memory held between
    # steps as "base" instead would favour a system that holds more between steps than at build
    # (stock keeps what its no_grad forward gathered until the next forward). On CPU the same from
    # malloc's bytes in use and the rise of the resident high-water mark ([Note: CPU peak]).
    held = {n: s.resident for n, s in systems.items()}
    steps_run = {n: 0 for n in systems}
    host = hostmem.HostMemory() if device.type == "cpu" else None
    memory = device.type == "cuda" or (host is not None and host.error is None)

    def allocated():
        if device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return host.in_use() if memory else 0

    for rnd in range(a.rounds):
        for n, s in systems.items():  # interleaved: every round runs every system
            before = allocated()
            for _ in range(a.warmup if rnd == 0 else 0):
                steps_run[n] += 1
                time_train_step(s, x, clock)
                time_tiny_forward(s, tiny, clock)
            held[n] += allocated() - before
            # The garbage of the systems before (four engines share the process) is collected before this
            # one's timed steps, not during them; the collector stays on while they run. Before `base`:
            # what the collection frees is not this system's.
            gc.collect()
            if memory:
                base = allocated()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            pauses.clear()
            dev0 = _device_calls(device)
            if host and memory:
                rss0 = host.reset_peak()
            with nvml.during(gpu[n]):
                for _ in range(a.steps):
                    steps_run[n] += 1
                    f, b, o = time_train_step(s, x, clock)
                    samples[n]["fwd"].append(f)
                    samples[n]["bwd"].append(b)
                    samples[n]["opt"].append(o)
                    samples[n]["step"].append(f + b + o)
                    samples[n]["tiny"].append(time_tiny_forward(s, tiny, clock))
            samples[n]["gc_ms"].append(sum(pauses) * 1e3 / a.steps)
            samples[n]["device_calls"].append((_device_calls(device) - dev0) / a.steps)
            if memory:
                rise = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else host.peak() - rss0
                samples[n]["peak"].append(held[n] + rise)
                samples[n]["peak_over_base"].append(rise)
                samples[n]["held"].append(held[n])  # held when its timed steps started
                samples[n]["base"].append(base)
                held[n] += allocated() - base
            if bar:
                bar.update(1)
    gc.callbacks.remove(gc_timer)
    if bar:
        bar.close()
    unit_bytes = (n_params // max(a.layers, 1)) * elt
    # No limit in a simulated world: its all-gather does nothing, so there is no bandwidth to measure.
    limit = None if a.sim_world else raw_all_gather(a, device, unit_bytes, n_params * elt,
                                                    repeats=max(a.rounds * a.steps, 3))
    result = dict(systems={}, skipped=skipped, limit=limit, n_params=n_params, args=vars(a), world=world)
    # What "peak" measured: the CUDA allocator, a CPU rank's malloc and resident memory ([Note: CPU peak]),
    # or nothing, and why.
    result["memory"] = "cuda" if device.type == "cuda" else "cpu" if memory else f"n/a: {host.error}"
    if a.sim_world:
        result["simulated_world"] = dict(world=world, backend=a.sim_backend, note=simworld.label(world))
    for n, smp in samples.items():
        med = {k: statistics.median(v) for k, v in smp.items() if v}
        for k, v in gpu[n].items():
            if v:
                med[k + "_median"], med[k + "_min"], med[k + "_max"] = statistics.median(v), min(v), max(v)
        if n.startswith("z3ext"):
            st = deepspeed_z3ext.stats(systems[n].model)
            med["z3ext_peak_live_MiB"] = st.peak_live_bytes / 2**20
            med["z3ext_collectives"] = st.collectives
            # getattr: a before/after run may load a package older than hpZ (device_run.sh: .before, Z3EXT_SRC)
            if getattr(st, "secondary_collectives", 0) or getattr(st, "secondary_bytes", 0):  # hpZ
                med["hpz_node_collectives"] = st.secondary_collectives
                med["hpz_secondary_MiB"] = st.secondary_bytes / 2**20
            if getattr(st, "schedule_checks", 0):  # [Note: schedule check]: host time per step
                med["schedule_check_ms_per_step"] = st.schedule_check_seconds * 1e3 / steps_run[n]
            grads = deepspeed_z3ext.grad_stats(systems[n].model)
            if grads is not None:  # z3ext's gradient path: host ms per step in its flushes
                med["grad_flushes_per_step"] = grads.flushes / steps_run[n]
                med["grad_host_ms_per_step"] = grads.host_seconds * 1e3 / steps_run[n]
        med["params_per_rank"] = params_per_rank(systems[n])
        med["samples_ms"] = {k: smp[k] for k in ("fwd", "bwd", "opt", "tiny") if smp[k]}  # every timed step, in order
        med["per_round"] = per_round(smp, a)
        result["systems"][n] = med
    # Host microseconds per fetch unit and per parameter for the ZeRO-3 systems (tiny forward is gather-bound).
    n_tensors = sum(1 for _ in make_model_meta(a).parameters())
    n_units = sum(1 for m in make_model_meta(a).modules() if any(True for _ in m.parameters(recurse=False)))
    for n in ("stock", "z3ext", "z3ext-nohold", "stock-mel", "z3ext-mel"):
        if n in result["systems"]:
            t = result["systems"][n]["tiny"]
            result["systems"][n]["us_per_unit_tiny_fwd"] = t * 1e3 / n_units
            result["systems"][n]["us_per_param_tiny_fwd"] = t * 1e3 / n_tensors
    result["nvml"] = nvml_snapshot() if device.type == "cuda" else None
    result["nvml_sampling"] = nvml.error or ("every %.0f ms during each system's timed steps (rank 0's GPU)" % (
        nvml.period * 1e3) if nvml.handle is not None else "off (no CUDA)")
    # Rank 0's view; every rank ran the same work in lockstep.
    return result


def params_per_rank(s):
    """Elements of the model this rank keeps between steps: ZeRO-3's partitions, FSDP2's local shards."""
    total = 0
    for p in s.model.parameters():
        if hasattr(p, "ds_tensor"):
            total += p.ds_tensor.ds_numel
        elif hasattr(p, "to_local"):  # FSDP2's DTensor
            total += p.to_local().numel()
        else:
            total += p.numel()
    return total


def make_model_meta(a):
    with torch.device("meta"):
        return make_model(a)


def count_text(n):
    """A number of weights, readable at any size: 83,200 -> "0.0832M", 6.7e9 -> "6.74B"."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def bandwidth_text(gbps):
    """GB/s, or MB/s below 1 GB/s (a CPU run's gloo moves a few MB/s: "0.0 GB/s" said nothing)."""
    return f"{gbps:.1f} GB/s" if gbps >= 1 else f"{gbps * 1e3:.1f} MB/s"


def ratio_text(r):
    return f"{r:.2f}" if r >= 0.01 else f"{r:.2g}"


def mib_text(b, width=9):
    mib = b / 2**20
    return f"{mib:{width}.0f}" if mib >= 100 else f"{mib:{width}.2f}"


def table(res, machine):
    s, lim, sim = res["systems"], res["limit"], res.get("simulated_world")
    cuda = res.get("memory") == "cuda"
    lines = [f"# gather_release on {machine}: {count_text(res['n_params'])} params, world {res['world']}, "
             f"dtype {res['args']['dtype']}, model {res['args']['model']}"]
    if sim:
        lines.append(f"# {sim['note']} (backend {sim['backend']}: rank 0 of {sim['world']} on one device)")
    if lim:
        lines.append(f"# limit: all-gather of the model's bytes in {lim['units']} units of "
                     f"{lim['unit_bytes']/2**20:.2f} MiB: {lim['ms']:.3f} ms "
                     f"(algbw {bandwidth_text(lim['algbw_GBps'])}, busbw {bandwidth_text(lim['busbw_GBps'])}); "
                     f"each unit as 4 tensors in one coalesced call: {lim.get('coalesced_ms', float('nan')):.3f} ms")
    lines.append(f"{'system':>12} {'fwd ms':>9} {'bwd ms':>9} {'opt ms':>9} {'step ms':>9} {'tiny-fwd ms':>12} "
                 f"{'peak MiB':>9} {'params/rank':>12}")
    for n, m in s.items():
        peak = mib_text(m["peak"]) if "peak" in m else f"{'n/a (CPU)' if not cuda else 'n/a':>9}"
        lines.append(f"{n:>12} {m['fwd']:9.2f} {m['bwd']:9.2f} {m['opt']:9.2f} {m['step']:9.2f} {m['tiny']:12.3f} {peak} "
                     f"{m.get('params_per_rank', 0):12,}")
    if any("power_W_median" in m for m in s.values()):
        lines.append(f"# during the timed steps ({res.get('nvml_sampling')}): SM clock MHz median [min], power W median [max]")
        for n, m in s.items():
            if "power_W_median" in m:
                lines.append(f"{n:>12} {m['sm_clock_MHz_median']:7.0f} [{m['sm_clock_MHz_min']:.0f}] MHz "
                             f"{m['power_W_median']:7.1f} [{m['power_W_max']:.1f}] W")
    if any(m.get("gc_ms", 0) or m.get("device_calls", 0) for m in s.values()):
        # A CPU run has no device allocator: its column would be zeros.
        lines.append("# per timed step (medians over rounds): garbage collector ms" +
                     (", device allocator calls" if cuda else ""))
        for n, m in s.items():
            calls = f"  device allocs/frees/retries {m.get('device_calls', 0):7.1f}" if cuda else ""
            lines.append(f"{n:>12} gc {m.get('gc_ms', 0):7.2f} ms{calls}")
    for n, why in res["skipped"].items():
        lines.append(f"{n:>12} skipped: {why}")
    if "z3ext" in s:
        z = s["z3ext"]
        ratios = []
        for other in ("stock", "stock-mel", "z3ext-dsgrads", "fsdp2", "unsharded"):
            if other in s:
                peak = f", peak {ratio_text(z['peak']/s[other]['peak'])}x" if "peak" in z and "peak" in s[other] else ""
                ratios.append(f"z3ext/{other}: step {z['step']/s[other]['step']:.2f}x, fwd {z['fwd']/s[other]['fwd']:.2f}x, "
                              f"tiny-fwd {z['tiny']/s[other]['tiny']:.2f}x{peak}")
        for variant in (n for n in s if n.startswith("z3ext-") and "fsdp2" in s):
            v, f = s[variant], s["fsdp2"]
            peak = f", peak {ratio_text(v['peak']/f['peak'])}x" if "peak" in v and "peak" in f else ""
            ratios.append(f"{variant}/fsdp2: step {v['step']/f['step']:.2f}x{peak}")
        if lim:
            ratios.append(f"z3ext/limit: tiny-fwd {z['tiny']/lim['ms']:.2f}x")
        lines += ["# ratios (< 1 means z3ext is faster)"] + ["  " + r for r in ratios]
        for n in ("stock", "z3ext", "z3ext-nohold", "stock-mel", "z3ext-mel"):
            if n in s:
                lines.append(f"  {n}: host {s[n]['us_per_unit_tiny_fwd']:.1f} us per fetch unit, "
                             f"{s[n]['us_per_param_tiny_fwd']:.1f} us per parameter (tiny forward)")
        for n, m in s.items():
            if "hpz_node_collectives" in m:
                lines.append(f"  {n}: hpZ {m['hpz_node_collectives']} of {m['z3ext_collectives']} all-gathers over the "
                             f"node group, secondary partitions {m['hpz_secondary_MiB']:.1f} MiB now")
            if "schedule_check_ms_per_step" in m:
                lines.append(f"  {n}: schedule check {m['schedule_check_ms_per_step']:.3f} host ms per step "
                             f"({100 * m['schedule_check_ms_per_step'] / m['step']:.2f} % of its step)")
            if "grad_host_ms_per_step" in m:
                lines.append(f"  {n}: gradient path {m['grad_flushes_per_step']:.1f} flushes, "
                             f"{m['grad_host_ms_per_step']:.2f} host ms per step")
    lines += targets(res)
    lines += legend(res)
    return "\n".join(lines)


def per_round(smp, a):
    """One value per round, the median of its timed steps (one per timed step when a single round ran):
    what the targets' spread is made of. Peaks are one per round already."""
    k = a.steps if a.rounds > 1 else 1
    out = {p: [statistics.median(smp[p][i:i + k]) for i in range(0, len(smp[p]), k)]
           for p in ("fwd", "bwd", "opt", "step", "tiny") if smp[p]}
    if smp["peak"]:
        out["peak"] = list(smp["peak"])
    return out


def verdict(values, bound):
    """"met" if even the worst value is within `bound`, "MISSED" if even the best is over it, otherwise
    "within noise": the values straddle the bound, so a verdict from one median would flip between runs."""
    return "met" if max(values) <= bound else "MISSED" if min(values) > bound else "within noise"


def on_device(res) -> bool:
    """Whether this run's systems computed on a GPU: the only runs the targets are set for."""
    return res.get("memory") == "cuda"


def targets(res):
    """Issue 9's targets, checked on this run (each against systems measured in it): one ratio per round,
    shown as median [lowest-highest] with `verdict`'s word. They are device targets: a CPU run (host-bound
    gloo ranks, a tiny model) prints its ratios beside them for reference, without a verdict."""
    s, out = res["systems"], []
    if not all(n in s for n in ("z3ext", "stock", "unsharded")):
        return out
    device = on_device(res)

    def of(n, part):  # per round; a result from before per_round: its one median
        return s[n].get("per_round", {}).get(part) or [s[n][part]]

    def row(what, values, bound):
        lo, med, hi = min(values), statistics.median(values), max(values)
        judged = verdict(values, bound) if device else "(device target: not judged on CPU)"
        out.append(f"  {what:<44} {med:6.2f} [{lo:.2f}-{hi:.2f}]  want <= {bound:<5.2f} {judged}")

    def ratio(part, other):
        return [x / y for x, y in zip(of("z3ext", part), of(other, part))]

    rounds = res["args"]["rounds"]
    unit = f"{rounds} rounds" if rounds > 1 else f"the {res['args']['steps']} timed steps of its one round"
    if device:
        out.append(f"# targets: z3ext against the other systems of this run, each ratio's median [lowest-highest] "
                   f"over {unit}")
    else:
        out.append(f"# device targets (set for GPU runs; this CPU run's ratios for reference, median [lowest-highest] "
                   f"over {unit})")
    row("fwd / unsharded fwd", ratio("fwd", "unsharded"), 1.15)
    if res["limit"]:
        row("tiny fwd / max(limit, unsharded tiny fwd)",
            [z / max(res["limit"]["ms"], u) for z, u in zip(of("z3ext", "tiny"), of("unsharded", "tiny"))], 1.5)
    row("step / stock step", ratio("step", "stock"), 0.5)
    if "fsdp2" in s:
        row("step / fsdp2 step (stretch goal)", ratio("step", "fsdp2"), 1.0)
    if "peak" in s["z3ext"] and "peak" in s["stock"]:
        row("peak / stock peak", ratio("peak", "stock"), 1.0)
    return out


def _wrapped(label, text, width=112):
    """`#   label  text`, text wrapped under itself."""
    import textwrap
    head = f"#   {label:<17} "
    return textwrap.wrap(text, width, initial_indent=head, subsequent_indent="#" + " " * (len(head) - 1))


def legend(res):
    """What every column, line and system name of the table means, in plain words: printed under it."""
    s, lim, memory = res["systems"], res["limit"], res.get("memory", "")
    names = list(s) + list(res["skipped"])
    out = ["# legend: systems (one row each; " + ("with --isolated each ran alone in its own processes, one after "
                                                  "another, so compare only runs made back to back)" if
                                                  res["args"].get("isolated") else
                                                  "they take turns in the same processes, round after round, so a "
                                                  "slow moment hits them alike)")]
    for base, what in BASES.items():
        if any(n.split("#")[0].split("-")[0].split("@")[0] == base for n in names):
            out += _wrapped(base, what)
    for v, what in VARIANTS.items():
        if any(v in n.split("#")[0].split("-")[1:] for n in names):
            out += _wrapped(("<system>-" if v in ("mel", "hpz") else "z3ext-") + v, what)
    if any("@" in n for n in names):
        out += _wrapped("z3ext@N", "z3ext fetching at most N weights per transfer (--sweep)")
    if any("#" in n for n in names):
        out += _wrapped("<system>#K", "a second copy of <system>, built and run later in each round: how much "
                                      "running later costs by itself")
    out += _wrapped("fwd, bwd, opt ms", "time of one training step's forward pass, backward pass and optimizer "
                                        "update; step ms: the three together. Median over all timed steps "
                                        "(--rounds x --steps, after --warmup steps)")
    out += _wrapped("tiny-fwd ms", "a forward pass on a one-row input without gradients: almost no arithmetic, so "
                                   "it is the fixed cost of fetching and freeing every weight once (unsharded: of "
                                   "just running the layers)")
    if memory == "cuda":
        out += _wrapped("peak MiB", "the most GPU memory torch's allocator held for this system: what it kept "
                                    "between its steps plus the highest rise during its timed steps (MiB = 2^20 bytes)")
    elif memory == "cpu":
        out += _wrapped("peak MiB", "what this system kept between its calls (bytes in use in malloc, read from "
                                    "glibc) plus the highest rise of this rank's memory in RAM (Linux's high-water "
                                    "mark) during its timed steps. Counts all memory malloc hands out, not only "
                                    "tensors, so the first DeepSpeed engine of a process also carries DeepSpeed's "
                                    "one-time allocations (about 15 MiB): stock's row, or every engine's with "
                                    "--isolated (MiB = 2^20 bytes)")
    else:
        out += _wrapped("peak MiB", f"n/a (CPU): {memory.partition(': ')[2] or 'not measured'}")
    out += _wrapped("params/rank", "weights (single numbers, not tensors) this rank keeps between steps: its "
                                   "share of the model; the unsharded model keeps all of them")
    if lim:
        cpu = " Here gloo between processes of one machine, in small units: the fixed cost of each call " \
              "dominates, hence the low bandwidth." if memory != "cuda" else ""
        out += _wrapped("limit", "the fastest these ranks can fetch the model's weights from one another: the same "
                                 "bytes all-gathered in the same unit sizes with nothing else running. algbw: bytes "
                                 "fetched per second; busbw: algbw x (ranks - 1) / ranks, what each link carried "
                                 "(nccl-tests' terms)." + cpu)
    if res.get("simulated_world"):
        out += _wrapped("simulated world", "this process is rank 0 of N ranks whose communication does nothing: "
                                           "memory and host time are real, communication is free, values wrong")
    if "z3ext" in s:
        out += _wrapped("ratios", "z3ext's median time (or peak) divided by another system's: below 1, z3ext is "
                                  "faster (smaller)")
        out += _wrapped("us per fetch unit", "tiny-fwd time divided by the layers that own weights (units) or by the "
                                             "weight tensors: the host cost of fetching one")
        if any("schedule_check_ms_per_step" in m for m in s.values()):
            out += _wrapped("schedule check", "host time z3ext spends per step checking that every rank fetched the "
                                              "same weights in the same order")
        if any("grad_host_ms_per_step" in m for m in s.values()):
            out += _wrapped("gradient path", "gradient batches z3ext reduced across ranks per step (flushes) and the "
                                             "host time they took")
    if any(m.get("gc_ms", 0) or m.get("device_calls", 0) for m in s.values()):
        out += _wrapped("gc ms", "time Python's garbage collector ran per timed step" +
                        ("; device allocs: calls of torch's GPU allocator into the driver per step" if memory == "cuda"
                         else ""))
    if all(n in s for n in ("z3ext", "stock", "unsharded")) and on_device(res):
        out += _wrapped("targets", "the project's performance goals, checked against this run. Each ratio is taken "
                                   "once per round (per timed step if one round ran). met: even the worst round is "
                                   "within the bound; MISSED: even the best round is over it; within noise: rounds "
                                   "fall on both sides, the machine's noise is larger than the gap (more --rounds, "
                                   "or a quieter machine, may decide it)")
    elif all(n in s for n in ("z3ext", "stock", "unsharded")):
        out += _wrapped("device targets", "the project's performance goals, set for runs on GPUs. On CPU, gloo ranks "
                                          "and a tiny model measure the host's bookkeeping, which the goals are not "
                                          "about, so the ratios are shown beside the goals without a verdict; a GPU "
                                          "run (bench/device_run.sh) judges them")
    if memory != "cuda" and not res.get("simulated_world"):
        threads = res.get("machine", {}).get("threads")
        out += _wrapped("CPU run", "gloo ranks on CPU with a tiny model: the numbers show host overhead (the "
                                   "bookkeeping of fetching and freeing), not what a GPU run would show" +
                        (f"; each rank computes on {threads} thread(s), the cores split between the ranks as "
                         f"under torchrun" if threads else ""))
    return out


def plot(res, path):
    """Step time per system, the gather speed a tiny forward achieves against the limit, and the peak
    when measured: whatever this device measured (a CPU run too)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    s = res["systems"]
    names = list(s)
    peaks = [n for n in names if "peak" in s[n]]
    fig, axes = plt.subplots(1, 3 if peaks else 2, figsize=(15 if peaks else 10, 4.5))
    ax1, ax2 = axes[0], axes[1]
    bottom = [0.0] * len(names)
    for part in ("fwd", "bwd", "opt"):
        vals = [s[n][part] for n in names]
        ax1.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("ms per training step (median)")
    ax1.legend()
    model_bytes = res["n_params"] * (2 if res["args"]["dtype"] == "bf16" else 4)
    bw = {n: model_bytes / (s[n]["tiny"] / 1e3) / 1e9 for n in names if n != "unsharded"}
    if res["limit"]:
        bw["limit"] = res["limit"]["algbw_GBps"]
    ax2.bar(list(bw), list(bw.values()))
    ax2.set_ylabel("achieved gather GB/s (model bytes / tiny forward)")
    if peaks:
        mib = [s[n]["peak"] / 2**20 for n in peaks]
        axes[2].bar_label(axes[2].bar(peaks, mib), fmt="%.4g")
        if min(mib) > 0 and max(mib) > 100 * min(mib):  # stock's 2 GB CPU reduce bucket beside 3 MiB
            axes[2].set_yscale("log")
        axes[2].set_ylabel("peak MiB per rank" + (" (malloc held + resident rise)" if res.get("memory") == "cpu" else ""))
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=45)
    m = res.get("machine", {})
    title = f"{m.get('name', '')} {m.get('commit', '')} {count_text(res['n_params'])} params, world {res['world']}"
    if res.get("simulated_world"):
        title += f"; {res['simulated_world']['note']}"
    elif res.get("memory") != "cuda":
        title += "; CPU: host overhead only"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def init_distributed(a):
    """The process group (a simulated world's when --sim-world), then DeepSpeed's comm on it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    if a.sim_world:
        simworld.init(a.sim_world, backend=a.sim_backend)  # deepspeed.init_distributed then reuses it
    elif torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               auto_mpi_discovery=False)


def _entry(a):
    init_distributed(a)  # first: it sets DS_ACCELERATOR on a machine without CUDA before DeepSpeed loads
    import deepspeed
    import torch.distributed as dist
    res = run(a)
    if dist.get_rank() == 0 and a.part:
        Path(a.out).write_text(json.dumps(res))
    elif dist.get_rank() == 0:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        machine = machine_name(dist.get_world_size(), device, a.sim_world)
        res["machine"] = dict(name=machine, host=platform.node(), torch=torch.__version__,
                              deepspeed=deepspeed.__version__, python=platform.python_version(),
                              nccl=".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
                              driver=_driver(), cpu=platform.processor() or platform.machine(),
                              threads=torch.get_num_threads())
        report(res, a, machine, device)
    dist.barrier()
    dist.destroy_process_group()


def report(res, a, machine, device):
    # Every run its own file (machine, commit, UTC time): a second run no longer overwrites the first.
    rev, when = outname.commit(), outname.utc()
    res["machine"].update(commit=rev, utc=when)
    out = Path(a.out) if a.out else outname.stamped(f"{machine}{'-smoke' if a.smoke else ''}", rev, when)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    png = plot(res, out.with_suffix(".png"))
    if device.type == "cpu" and not res.get("simulated_world"):
        print("# CPU run: gloo ranks on CPU show host overhead only, not GPU behaviour")
    if a.isolated:
        print("# --isolated: each system ran alone in its own processes, one after another (not interleaved)")
    print(table(res, machine))
    print(f"# results: {outname.shown(out)}")
    if png:
        print(f"# plot:    {outname.shown(png)}")


def _without(argv, *options):
    """argv minus each `--option VALUE` / `--option=VALUE` named."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not any(arg.startswith(o + "=") for o in options):
            out.append(arg)
    return out


def run_isolated(a, argv, world):
    """--isolated: one spawn per system (its own processes and GPU memory), results merged into one
    report; the all-gather limit is the first system's measurement."""
    import tempfile
    names = [s for s in a.systems.split(",") if s] + [f"z3ext@{b}" for b in a.sweep.split(",") if b]
    base = _without(argv, "--systems", "--sweep", "--out")
    parts = []
    with tempfile.TemporaryDirectory(prefix="z3ext-bench-") as tmp:
        for n in names:
            part = os.path.join(tmp, f"part{len(parts)}.json")
            try:
                spawn(_rank_main, base + ["--systems", n, "--sweep", "", "--out", part, "--part"], world)
                parts.append(json.loads(Path(part).read_text()))
            except Exception as e:  # e.g. out of memory: the other systems still run
                parts.append(dict(systems={}, skipped={n: f"{type(e).__name__}: {e}"[:200]}))
    measured = [p for p in parts if "limit" in p]
    if not measured:
        raise SystemExit(f"every system failed: {[p['skipped'] for p in parts]}")
    merged = measured[0]
    for p in parts:
        if p is not merged:
            merged["systems"].update(p["systems"])
            merged["skipped"].update(p["skipped"])
    merged["args"]["systems"], merged["args"]["isolated"] = a.systems, True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    machine = machine_name(world, device, a.sim_world)
    merged["machine"] = dict(name=machine, host=platform.node(), torch=torch.__version__, python=platform.python_version(),
                             driver=_driver(), cpu=platform.processor() or platform.machine())
    report(merged, a, machine + "-isolated", device)


def _driver():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:
        return None


def _spawned(rank, world, port, target, argv):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
        # Ranks sharing the CPU split its cores, as under torchrun (OMP_NUM_THREADS=1): 2 ranks of 2 threads
        # each on 2 cores made whole steps wait for a descheduled thread, 100-250 ms optimizer steps instead
        # of 2 ms, in some runs and not others.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    target(argv)


def spawn(target, argv, world):
    """Runs `target(argv)` on `world` local processes with torchrun's environment (one per GPU)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, target, argv), nprocs=world, join=True)


def _rank_main(argv):
    _entry(parse(argv))


def sim_out(out, world):
    """--out for the simulated world that follows a world-1 run: `<stem>-sim<N><suffix>`."""
    if not out:
        return []
    p = Path(out)
    return ["--out", str(p.with_name(f"{p.stem}-sim{world}{p.suffix or '.json'}"))]


def say_start(a, how):
    """The run's first lines, printed before anything slow (builds of ops, processes starting), so that a
    new user never faces minutes of silence."""
    names = [s for s in a.systems.split(",") if s] + [f"z3ext@{b}" for b in a.sweep.split(",") if b]
    model = (f"GPT of {a.layers} blocks, hidden {a.hidden}" if a.model == "gpt" else
             f"GPT of {a.layers} blocks, hidden {a.hidden}, {a.experts} expert modules per block (top {a.topk})"
             if a.model == "moe" else f"{a.layers} x Linear({a.hidden}, {a.hidden})")
    print(f"# gather_release: {how}; model {model}; {len(names)} systems ({', '.join(names)}), each "
          f"{a.rounds} round(s) x {a.steps} timed steps after {a.warmup} warm-up", flush=True)
    cpu = "" if torch.cuda.is_available() else " and DeepSpeed its CPU communication op"
    print(f"# the first run in a checkout builds z3ext's C++ ops (1-3 minutes; it prints when it starts and "
          f"ends){cpu}; then the systems are built and timed, a bar counts the rounds", flush=True)


def main(argv=None):
    a = parse(argv)
    argv = sys.argv[1:] if argv is None else argv
    if a.sim_world:  # one process on this device, rank 0 of the simulated world
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--sim-world runs one process: not under torchrun with several ranks")
        say_start(a, f"one process, rank 0 of a {simworld.label(a.sim_world)}")
        return run_isolated(a, argv, 1) if a.isolated else _entry(a)
    if "RANK" in os.environ:  # under torchrun
        if os.environ["RANK"] == "0":
            say_start(a, f"{os.environ.get('WORLD_SIZE', '?')} ranks under torchrun")
        return _entry(a)
    world = a.world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    say_start(a, f"starting {world} ranks, " + ("one per GPU" if torch.cuda.is_available() else
                                                 "processes on this CPU talking through gloo (no GPU found)"))
    if a.isolated:
        run_isolated(a, argv, world)
    else:
        spawn(_rank_main, argv, world)
    # One GPU and no --world: world 1 shards nothing, so the run continues with what ZeRO-3 is for, a
    # simulated world of 8 (same options; its own report and file).
    if a.sim_world is None and a.world is None and torch.cuda.is_available() and torch.cuda.device_count() == 1:
        print(f"\n# one GPU: next, the same systems as rank 0 of a {simworld.label(8)}", flush=True)
        sim_argv = _without(argv, "--out") + ["--sim-world", "8"] + sim_out(a.out, 8)
        main(sim_argv)


if __name__ == "__main__":
    main()
