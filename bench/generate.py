"""Generation benchmark: HF `generate` on a Llama-shaped model, unsharded, stock ZeRO-3 and z3ext at several
residency budgets ([Note: generation residency] in deepspeed_z3ext/resident_set.py), side by side.

    python bench/generate.py --sim-world 8                 # rank 0 of a simulated world of 8 on one device
    python bench/generate.py --sim-world 64 --layers 32 --hidden 4096
    python bench/generate.py --smoke                       # tiny, CPU (host time only)

Greedy decoding in `torch.no_grad`, batch B, prompt P, N new tokens. Per system: ms per new token, as
(time of N new tokens - time of 1) / (N - 1), so the prompt's forward is left out; the median over
interleaved rounds; and on GPU the peak the CUDA allocator saw during the call above what the system held
before it. Systems:
- unsharded: the whole model on the device;
- stock, z3ext: ZeRO-3 engines (inference: no optimizer); z3ext at its default budget
  (stage3_max_live_parameters less stage3_prefetch_bucket_size);
- z3ext@F: z3ext with `z3ext.resident_numel` = F x the model's elements (1, 0.5, 0.25; 0: off);
- stock-trl, z3ext-trl: TRL's `unwrap_model_for_generation` with ds3_gather_for_generation (its
  remove_hooks, a GatheredParameters block over the whole model, add_hooks after);
- z3ext-gathered: generation inside a whole-model GatheredParameters block with z3ext's hooks on.
A simulated world ([Note: simulated world]) makes communication free: "what real communication adds" is
estimated on paper from the bytes each token gathers (printed) and a bus bandwidth.
"""
import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ["PYTHONWARNINGS"] = "ignore"
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simworld  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "out"


def parse(argv=None):
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim-world", type=int, default=8)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default="unsharded,stock,z3ext,z3ext@1,z3ext@0.5,z3ext@0.25,z3ext@0,stock-trl,z3ext-trl,"
                                        "z3ext-gathered")
    p.add_argument("--persistence", type=int, default=100_000 if gpu else 0)
    p.add_argument("--prefetch-bucket", type=int, default=50_000_000)
    p.add_argument("--max-live", type=int, default=1_000_000_000)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU host time)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.layers, a.hidden, a.vocab, a.batch, a.prompt, a.new_tokens, a.rounds = 4, 64, 256, 2, 8, 8, 2
        a.prefetch_bucket = min(a.prefetch_bucket, 20_000)
    return a


def llama_config(a):
    from transformers import LlamaConfig
    heads = max(1, a.hidden // 128)
    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 2.6875) // 64 * 64,
                       num_hidden_layers=a.layers, num_attention_heads=heads, num_key_value_heads=heads,
                       max_position_embeddings=a.prompt + a.new_tokens + 8, tie_word_embeddings=False)


def ds_config(a, z3ext):
    cfg = {"train_micro_batch_size_per_gpu": a.batch,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": a.persistence,
                                 "stage3_prefetch_bucket_size": a.prefetch_bucket,
                                 "stage3_max_live_parameters": a.max_live},
           "steps_per_print": 10**9}
    if torch.cuda.is_available():
        cfg["bf16"] = {"enabled": True}
    if z3ext is not None:
        cfg["z3ext"] = z3ext
    return cfg


class System:

    def __init__(self, name, model, engine=None):
        self.name, self.model, self.engine = name, model, engine


def build(name, a, device, n_params):
    import deepspeed
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = name.split("#")[0].split("-")[0]  # "<system>#K": another copy, built and measured later
    if base == "unsharded":
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(a)).to(dtype)
        return System(name, model.eval())
    z3ext = None
    if base.startswith("z3ext"):
        z3ext = {"enabled": True}
        if "@" in base:
            z3ext["resident_numel"] = int(float(base.split("@")[1]) * n_params)
    cfg = ds_config(a, z3ext)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(llama_config(a))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    engine.module.eval()
    return System(name, engine.module, engine)


def _trl_gathered(engine):
    """TRL's unwrap_model_for_generation with ds3_gather_for_generation (trl/models/utils.py, 1.16)."""
    import contextlib
    import deepspeed
    from deepspeed.runtime.zero.partitioned_param_coordinator import iter_params

    @contextlib.contextmanager
    def ctx():
        from deepspeed_z3ext.state import offload_of
        offload = offload_of(engine)
        for p in iter_params(offload.module, recurse=True):
            p.ds_active_sub_modules.clear()
        for h in offload.forward_hooks:
            h.remove()
        offload.forward_hooks = []
        try:
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                yield
        finally:
            offload._register_deepspeed_module(offload.module)

    return ctx()


def _z3ext(s):
    from deepspeed_z3ext.state import of_engine
    return s.engine is not None and of_engine(s.engine) is not None


def run_generate(s, ids, new_tokens):
    import contextlib
    import deepspeed
    ctx = contextlib.nullcontext()
    kind = s.name.split("#")[0]
    if kind.endswith("-trl"):
        ctx = _trl_gathered(s.engine)
    elif kind.endswith("-gathered"):
        ctx = deepspeed.zero.GatheredParameters(list(s.model.parameters()))
    with torch.no_grad(), ctx:
        out = s.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0)
    if _z3ext(s):
        import deepspeed_z3ext
        deepspeed_z3ext.release_resident(s.engine)  # generation over ([Note: generation residency])
    return out


def measure(s, ids, a, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    peak = None
    for n in (1, a.new_tokens):
        sync()
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        run_generate(s, ids, n)
        sync()
        times[n] = time.perf_counter() - t0
        if device.type == "cuda" and n == a.new_tokens:
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return (times[a.new_tokens] - times[1]) / (a.new_tokens - 1) * 1e3, peak


def gathered_per_token(s):
    """All-gathers and gathered parameters per new token (z3ext's stats), or None."""
    if not _z3ext(s):
        return None
    import deepspeed_z3ext
    return deepspeed_z3ext.stats(s.engine)


def main(argv=None):
    a = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    simworld.init(a.sim_world)
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", auto_mpi_discovery=False)
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(llama_config(a)).parameters())
    names = a.systems.split(",")
    systems = [build(n, a, device, n_params) for n in names]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, a.vocab, (a.batch, a.prompt), generator=g).to(device)
    for s in systems:  # warm-up: plans recorded, kernels chosen
        run_generate(s, ids, 2)
    per_token, peaks, gathers = {n: [] for n in names}, {n: [] for n in names}, {}
    for _ in range(a.rounds):
        for s in systems:
            before = gathered_per_token(s)
            ms, peak = measure(s, ids, a, device)
            after = gathered_per_token(s)
            per_token[s.name].append(ms)
            if peak is not None:
                peaks[s.name].append(peak)
            if before is not None:
                gathers[s.name] = ((after.gathered_params - before.gathered_params) / (1 + a.new_tokens),
                                   after.resident_forwards - before.resident_forwards)
    dtype_bytes = 2 if device.type == "cuda" else 4
    res = dict(args=vars(a), n_params=n_params, simulated_world=simworld.label(a.sim_world), device=str(
        torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), torch=torch.__version__,
        deepspeed=deepspeed.__version__, systems={})
    unsharded = statistics.median(per_token["unsharded"]) if "unsharded" in per_token else None
    print(f"# generate: Llama {a.layers}x{a.hidden}, {n_params / 1e9:.2f}B params, batch {a.batch}, prompt {a.prompt}, "
          f"{a.new_tokens} new tokens, {simworld.label(a.sim_world)}, {res['device']}")
    print(f"{'system':>16} {'ms/token':>9} {'x unsharded':>11} {'peak MiB':>9} {'params gathered/token':>22} {'fast fwds':>9}")
    for n in names:
        ms = statistics.median(per_token[n])
        peak = max(peaks[n]) if peaks[n] else None
        gp, fast = gathers.get(n, (None, None))
        res["systems"][n] = dict(ms_per_token=ms, runs=per_token[n], peak_mib=peak, params_gathered_per_token=gp,
                                 fast_forwards=fast)
        print(f"{n:>16} {ms:9.2f} {ms / unsharded if unsharded else float('nan'):11.2f} "
              f"{peak if peak is not None else float('nan'):9.0f} {gp if gp is not None else float('nan'):22.1f} "
              f"{fast if fast is not None else '':>9}")
    print(f"# model bytes: {n_params * dtype_bytes / 2**30:.2f} GiB; a token that gathers the whole model moves it once")
    out = Path(a.out) if a.out else OUT_DIR / f"generate-w{a.sim_world}-{a.layers}x{a.hidden}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, OUT_DIR / f"{out.stem}.png")  # beside the bench's other plots, not beside --out
    return res


def plot(res, path):
    """ms per token and peak against the residency budget (z3ext@F), stock and unsharded as lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = res["systems"]
    budgets = sorted((float(n.split("@")[1]), n) for n in s if n.startswith("z3ext@"))
    if not budgets:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [b for b, _ in budgets]
    ax1.plot(xs, [s[n]["ms_per_token"] for _, n in budgets], "o-", label="z3ext")
    for ref in ("unsharded", "stock"):
        if ref in s:
            ax1.axhline(s[ref]["ms_per_token"], ls="--", label=ref, color="k" if ref == "unsharded" else "r")
    ax1.set_xlabel("z3ext.resident_numel / model elements")
    ax1.set_ylabel("ms per new token")
    ax1.legend()
    if all(s[n]["peak_mib"] is not None for _, n in budgets):
        ax2.plot(xs, [s[n]["peak_mib"] for _, n in budgets], "o-", label="z3ext")
        for ref in ("unsharded", "stock"):
            if ref in s and s[ref]["peak_mib"] is not None:
                ax2.axhline(s[ref]["peak_mib"], ls="--", label=ref, color="k" if ref == "unsharded" else "r")
        ax2.set_ylabel("peak MiB above resident")
        ax2.legend()
    ax2.set_xlabel("z3ext.resident_numel / model elements")
    fig.suptitle(res["simulated_world"])
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


if __name__ == "__main__":
    main()
