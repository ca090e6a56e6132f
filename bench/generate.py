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
- stock, z3ext: ZeRO-3 engines (inference: no optimizer); z3ext at its default budget (sized from memory,
  [Note: resident budget]; with --max-live, stage3_max_live_parameters less stage3_prefetch_bucket_size);
- z3ext@F: z3ext with `z3ext.resident_numel` = F x the model's elements (1, 0.5, 0.25; 0: off);
- stock-trl, z3ext-trl: TRL's `unwrap_model_for_generation` with ds3_gather_for_generation (its
  remove_hooks, a GatheredParameters block over the whole model, add_hooks after);
- z3ext-gathered: generation inside a whole-model GatheredParameters block with z3ext's hooks on.
A simulated world ([Note: simulated world]) makes communication free: "what real communication adds" is
estimated on paper from the bytes each token gathers (printed) and a bus bandwidth. Results go to a new
bench/out/generate-<machine>-<layers>x<hidden>-<commit>-<UTC time>.json (the plot beside it) unless --out
is given; a legend under the table says what each column means.
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
import hostmem  # noqa: E402  (the peak on CPU, [Note: CPU peak])
import outname  # noqa: E402  (one results file per run)
import simworld  # noqa: E402

OUT_DIR = outname.OUT_DIR


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
    p.add_argument("--max-live", type=int, default=None,
                   help="stage3_max_live_parameters (default: not set, as DeepSpeed's default config)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens of each system's warm-up call (default: --new-tokens, [Note: a full-length warm-up])")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU host time)")
    p.add_argument("--out", default=None)
    p.add_argument("--pool", nargs="+", metavar="JSON", default=None,
                   help="no run: pool these results (one system per process, alternated) into one table")
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
                                 "stage3_prefetch_bucket_size": a.prefetch_bucket},
           "steps_per_print": 10**9}
    if a.max_live is not None:
        cfg["zero_optimization"]["stage3_max_live_parameters"] = a.max_live
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


def measure(s, ids, a, device, host=None):
    """ms per new token, and the peak (MiB) of the N-token call above what was allocated before it: the CUDA
    allocator's, or on CPU the rise of the resident high-water mark (`host`, [Note: CPU peak]; None: no peak)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    peak = None
    for n in (1, a.new_tokens):
        sync()
        if device.type == "cuda":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        elif host is not None:
            base = host.reset_peak()
        t0 = time.perf_counter()
        run_generate(s, ids, n)
        sync()
        times[n] = time.perf_counter() - t0
        if device.type == "cuda" and n == a.new_tokens:
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        elif host is not None and n == a.new_tokens:
            peak = (host.peak() - base) / 2**20
    return (times[a.new_tokens] - times[1]) / (a.new_tokens - 1) * 1e3, peak


def gathered_per_token(s):
    """All-gathers and gathered parameters per new token (z3ext's stats), or None."""
    if not _z3ext(s):
        return None
    import deepspeed_z3ext
    return deepspeed_z3ext.stats(s.engine)


def count_text(n):
    """83,200 -> "0.0832M", 6.7e9 -> "6.74B" (a tiny model printed "0.00B params")."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def main(argv=None):
    a = parse(argv)
    if a.pool:
        return print(pool(a.pool))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # First, before the slow parts (a first run builds two C++ extensions, quietly for the backend).
    print(f"# generate: Llama {a.layers}x{a.hidden}, {len(a.systems.split(','))} systems, "
          f"{simworld.label(a.sim_world)}, on {device.type.upper()}; the first run in a checkout builds the "
          f"simulated world's backend (bench/simworld, about a minute) and z3ext's C++ ops (1-3 minutes; it says "
          f"when), then each system generates {a.rounds} rounds", flush=True)
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
    for s in systems:  # warm-up: plans recorded, kernels chosen, the allocator grown ([Note: a full-length warm-up])
        run_generate(s, ids, a.warmup_tokens or a.new_tokens)
    host = hostmem.HostMemory() if device.type == "cpu" else None
    memory = "cuda" if device.type == "cuda" else "cpu" if host.error is None else f"n/a: {host.error}"
    host = host if memory == "cpu" else None
    per_token, peaks, gathers = {n: [] for n in names}, {n: [] for n in names}, {}
    for _ in range(a.rounds):
        for s in systems:
            before = gathered_per_token(s)
            ms, peak = measure(s, ids, a, device, host)
            after = gathered_per_token(s)
            per_token[s.name].append(ms)
            if peak is not None:
                peaks[s.name].append(peak)
            if before is not None:
                gathers[s.name] = ((after.gathered_params - before.gathered_params) / (1 + a.new_tokens),
                                   after.resident_forwards - before.resident_forwards)
    dtype_bytes = 2 if device.type == "cuda" else 4
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    machine = f"1x{device_name.replace(' ', '-') if device.type == 'cuda' else 'CPU'}-sim{a.sim_world}"
    rev, when = outname.commit(), outname.utc()
    res = dict(args=vars(a), n_params=n_params, simulated_world=simworld.label(a.sim_world), device=device_name,
               torch=torch.__version__, deepspeed=deepspeed.__version__, machine=machine, commit=rev, utc=when,
               memory=memory, systems={})
    unsharded = statistics.median(per_token["unsharded"]) if "unsharded" in per_token else None
    print(f"# generate: Llama {a.layers}x{a.hidden}, {count_text(n_params)} params, batch {a.batch}, prompt {a.prompt}, "
          f"{a.new_tokens} new tokens, {simworld.label(a.sim_world)}, {res['device']}")
    print(f"{'system':>16} {'ms/token':>9} {'x unsharded':>11} {'peak MiB':>9} {'params gathered/token':>22} {'fast fwds':>9}")
    for n in names:
        ms = statistics.median(per_token[n])
        peak = max(peaks[n]) if peaks[n] else None
        gp, fast = gathers.get(n, (None, None))
        res["systems"][n] = dict(ms_per_token=ms, runs=per_token[n], peak_mib=peak, params_gathered_per_token=gp,
                                 fast_forwards=fast)
        # No nan: what was not measured says so (the legend says why).
        ratio = f"{ms / unsharded:11.2f}" if unsharded else f"{'n/a':>11}"
        peak_text = (f"{peak:9.0f}" if peak >= 100 else f"{peak:9.2f}") if peak is not None else f"{'n/a (CPU)':>9}"
        if gp is not None:
            gp_text, fast_text = f"{gp:22.1f}", f"{fast:>9}"
        else:  # the unsharded model gathers nothing; stock counts nothing
            gp_text, fast_text = (f"{0:22.1f}" if n.split("#")[0] == "unsharded" else f"{'n/a':>22}"), f"{'n/a':>9}"
        print(f"{n:>16} {ms:9.2f} {ratio} {peak_text} {gp_text} {fast_text}")
    model_bytes = n_params * dtype_bytes
    print(f"# model bytes: {model_bytes / 2**30:.2f} GiB" if model_bytes >= 2**30 else
          f"# model bytes: {model_bytes / 2**20:.2f} MiB", end="")
    print("; a token that gathers the whole model moves it once")
    print("\n".join(legend(res)))
    # Every run its own file, unless --out names one; with --out the plot goes beside the bench's other plots
    # (bench/device_run.sh collects it there), not beside --out.
    out = Path(a.out) if a.out else outname.stamped(f"generate-{machine}-{a.layers}x{a.hidden}"
                                                    f"{'-smoke' if a.smoke else ''}", rev, when)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    png = plot(res, (OUT_DIR if a.out else out.parent) / f"{out.stem}.png")
    print(f"# results: {outname.shown(out)}")
    if png:
        print(f"# plot:    {outname.shown(png)}")
    return res


def pool(paths):
    """One table from runs that each measured one system in a process of its own, processes alternated.

    [Note: a full-length warm-up] After a 2-token warm-up, the first 64-token call of a copy ran up to 3.5x slower
    per token than its later calls (unsharded Llama 16x2048 on the H200: 75.6, then 21.1 and 23.6 ms): the first
    call to reach each length does work once (the CUDA allocator grows for longer KV caches, among others) inside
    the timed call. The warm-up now generates as many tokens as the timed calls; with it no first round stood
    out in 6 processes (10.5-13.3 ms, bench/results/generate-procs-*). Systems in one process also differ in what the process has: once
    `deepspeed.zero.Init` has run, DeepSpeed's memory-efficient linear replaces `F.linear` for the whole process
    ("this will persist unless manually reset"), so an unsharded model beside a ZeRO-3 one runs every linear
    through an autograd Function. Each system in its own process compares a system with the model as its user
    would run it alone. Every round of every process counts: the median over all of them, their range, and the
    ratio per repetition (its two processes ran one after the other)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    groups = {}
    for r in runs:
        key = (r["args"]["layers"], r["args"]["hidden"], r["simulated_world"])
        groups.setdefault(key, []).append(r)
    out = []
    for (layers, hidden, world), rs in groups.items():
        a = rs[0]
        out.append(f"### Llama {layers}x{hidden}, batch {a['args']['batch']}, prompt {a['args']['prompt']}, "
                   f"{a['args']['new_tokens']} new tokens, {world}, {a['device']}, commit {a['commit']}")
        out.append(f"({len(rs)} processes, one system each, alternated; {a['args']['rounds']} rounds each; "
                   "ms per new token)\n")
        per = {}
        for r in rs:
            for n, s in r["systems"].items():
                per.setdefault(n.split("#")[0], []).append(s)
        ref = per.get("unsharded")
        ref_ms = statistics.median([x for s in ref for x in s["runs"]]) if ref else None
        out.append("| system | median | range (every round) | per process | x unsharded (median) | "
                   "x unsharded per repetition | peak MiB |")
        out.append("|---|---|---|---|---|---|---|")
        for n, ss in per.items():
            every = [x for s in ss for x in s["runs"]]
            med = statistics.median(every)
            procs = ", ".join(f"{s['ms_per_token']:.2f}" for s in ss)
            ratio = f"{med / ref_ms:.3f}" if ref_ms else "n/a"
            reps = (", ".join(f"{s['ms_per_token'] / u['ms_per_token']:.3f}" for s, u in zip(ss, ref))
                    if ref and n != "unsharded" else "")
            peak = max((s["peak_mib"] for s in ss if s["peak_mib"] is not None), default=None)
            out.append(f"| {n} | {med:.2f} | {min(every):.2f}-{max(every):.2f} | {procs} | {ratio} | {reps} | "
                       f"{'n/a' if peak is None else f'{peak:.0f}'} |")
        out.append("")
    return "\n".join(out)


def legend(res):
    """What each system name and column of the table means, in plain words: printed under it."""
    names = {n.split("#")[0] for n in res["systems"]}

    def line(label, text):
        import textwrap
        head = f"#   {label:<22} "
        return textwrap.wrap(text, 112, initial_indent=head, subsequent_indent="#" + " " * (len(head) - 1))

    out = ["# legend: systems (they take turns, round after round, in this one process)"]
    systems = {
        "unsharded": "the whole model in this process, plain transformers: nothing to fetch (the speed to aim for)",
        "stock": "DeepSpeed ZeRO-3 as shipped: this rank keeps 1/N of the weights and fetches each layer's "
                 "before it runs, for every token",
        "z3ext": "the same with this package, which keeps the weights of one token's forward for the next "
                 "(up to its default budget: sized from memory, or with --max-live that less the prefetch bucket)",
        "z3ext@F": "z3ext keeping at most F x the model's weights between tokens (z3ext.resident_numel; 1: all, "
                   "0: none)",
        "stock-trl": "TRL's unwrap_model_for_generation: all weights fetched once before generate, hooks removed",
        "z3ext-trl": "the same with z3ext",
        "z3ext-gathered": "generate inside one GatheredParameters block over the whole model, z3ext's hooks on",
    }
    for n, text in systems.items():
        if n in names or (n == "z3ext@F" and any("@" in m for m in names)):
            out += line(n, text)
    out += line("ms/token", "time per generated token without the prompt: (time of N new tokens - time of 1) "
                            "/ (N - 1), median over rounds")
    out += line("x unsharded", "ms/token divided by unsharded's (n/a: no unsharded system in this run)")
    if res["memory"] == "cuda":
        out += line("peak MiB", "the most GPU memory torch's allocator held during the N-token call above what it "
                                "held before the call (the highest over rounds)")
    elif res["memory"] == "cpu":
        out += line("peak MiB", "the highest rise of this process's memory in RAM (Linux's high-water mark) during the "
                                "N-token call above where it stood before (the highest over rounds; counts all "
                                "memory, not only tensors: bench/hostmem.py, [Note: CPU peak])")
    else:
        out += line("peak MiB", f"n/a (CPU): {res['memory'].partition(': ')[2]}")
    out += line("params gathered/token", "weight tensors z3ext fetched per generated token, over the last round's "
                                         "two calls (1 + N tokens); 0 for unsharded, which fetches nothing; n/a for "
                                         "stock, which keeps no such count")
    out += line("fast fwds", "forwards of the last round's two calls that found every weight still kept from the "
                             "forward before (at most N - 1: a call's first forward never does); z3ext only")
    if res.get("simulated_world"):
        out += line("simulated world", "this process is rank 0 of N ranks whose communication does nothing: memory "
                                       "and host time are real, communication is free, values wrong")
    return out


def plot(res, path):
    """ms per token and peak against the residency budget (z3ext@F), stock and unsharded as lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# no plot: matplotlib is not installed (pip install matplotlib)")
        return None
    s = res["systems"]
    budgets = sorted((float(n.split("@")[1]), n) for n in s if n.startswith("z3ext@"))
    if not budgets:
        print("# no plot: it draws z3ext@F systems against F, and this run has none")
        return None
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
        ax2.set_ylabel("peak MiB above resident" + (" (RAM high-water mark)" if res.get("memory") == "cpu" else ""))
        ax2.legend()
    ax2.set_xlabel("z3ext.resident_numel / model elements")
    fig.suptitle(f"{res['simulated_world']}; {res.get('machine', '')} {res.get('commit', '')}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
