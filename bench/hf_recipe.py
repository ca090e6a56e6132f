"""The HF Trainer recipe users run on ZeRO-3, stock DeepSpeed vs z3ext: peak memory and step time.

    python bench/hf_recipe.py                   # GPUs: one rank per visible GPU (a fresh torchrun per system)
    DS_ACCELERATOR=cpu python bench/hf_recipe.py --smoke     # no GPU: 2 gloo ranks, tiny shape

The recipe (from an issue): `transformers.Trainer` with a DeepSpeed ZeRO-3 config dict passed as
`TrainingArguments(deepspeed=cfg)`; a GPT-2 built from `GPT2Config` (no download, under the
`zero.Init` that transformers opens for ZeRO-3); LoRA (peft) on `c_attn` (`--lora-targets`);
reentrant gradient checkpointing; a DPO loss in a Trainer subclass: the policy forward on the
chosen and rejected batches (concatenated, or `--forwards separate`), then the reference forward of
the same model under `torch.no_grad()` inside the PeftModel's `disable_adapter()`, then
`-logsigmoid(beta * ((pc - rc) - (pr - rr)))` on summed per-sequence log-probs of the response tokens.

Systems: `stock` (the config without "z3ext", deepspeed_z3ext not imported), `z3ext` (`"z3ext": true`),
`z3ext-nohold` (`{"enabled": true, "hold_for_backward": false}`). Each system runs in its own
`torchrun` group, one after the other, so Trainer/accelerate state and DeepSpeed's process-wide
patches never leak between them; same seed and data. Per system: median step time (on_step_begin to
on_step_end of the Trainer, synchronised), peak allocated GPU memory over the timed steps
(`torch.cuda.max_memory_allocated`, reset after warm-up; None on CPU), max RSS of the processes,
per-step DPO losses (rank 0's and the mean over ranks). A system that fails (or times out) is
reported as failed with the last line of its error; the others still run. Results:
`bench/out/hf-recipe-<machine>[-smoke].{json,txt}` (untracked) unless --out is given.
"""
import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("stock", "z3ext", "z3ext-nohold")
T_START = time.perf_counter()


# ---------------------------------------------------------------------------------------------- options
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="stock,z3ext,z3ext-nohold", help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--layers", type=int, default=None, help="GPT-2 n_layer (GPU 16, CPU 2)")
    p.add_argument("--hidden", type=int, default=None, help="GPT-2 n_embd (GPU 1536, CPU 64)")
    p.add_argument("--heads", type=int, default=None, help="GPT-2 n_head (GPU 16, CPU 4)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--positions", type=int, default=1024, help="GPT-2 n_positions")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence, prompt half + response half (GPU 1024, CPU 32)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="chosen/rejected pairs per rank per step (GPU 2, CPU 1); a forward sees twice as many sequences")
    p.add_argument("--steps", type=int, default=None, help="timed steps (GPU 10, CPU 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps, not timed (GPU 5, CPU 1)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="GPU bf16, CPU fp32")
    p.add_argument("--world", type=int, default=None, help="ranks per system (default: visible GPUs, or 2 on CPU)")
    p.add_argument("--forwards", choices=["concat", "separate"], default="concat",
                   help="policy and reference forwards on one concatenated chosen+rejected batch, or two forwards each")
    p.add_argument("--lora-targets", default="c_attn", help="comma list of GPT-2 modules for LoRA, e.g. c_attn,c_proj")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--memory-efficient-linear", choices=["default", "on", "off"], default="default",
                   help="DeepSpeed's zero_optimization.memory_efficient_linear (default: DeepSpeed's default, on)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per system (its whole torchrun)")
    p.add_argument("--out", default=None, help="JSON path (default bench/out/hf-recipe-<machine>[-smoke].json, untracked)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny and fast: 2 layers, n_embd 64, seq 32, 1 warm-up + 3 timed steps, fp32")
    p.add_argument("--logs", default=None, help="folder for each system's torchrun log (default: a temp folder)")
    # internal: one system's worker under torchrun
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    gpu = _gpu_available()
    tiny = dict(layers=2, hidden=64, heads=4, seq=32, micro_batch=1, steps=3, warmup=1, dtype="fp32")
    full = dict(layers=16, hidden=1536, heads=16, seq=1024, micro_batch=2, steps=10, warmup=5, dtype="bf16")
    for k, v in (full if gpu and not a.smoke else tiny).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.dtype == "bf16" and not gpu:
        p.error("--dtype bf16 needs a GPU (Trainer refuses bf16 on CPU unless use_cpu, which skips DeepSpeed's init)")
    unknown = [s for s in a.systems.split(",") if s and s not in SYSTEMS]
    if unknown:
        p.error(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if a.seq > a.positions:
        p.error(f"--seq {a.seq} > --positions {a.positions}")
    return a


def _gpu_available():
    if os.environ.get("DS_ACCELERATOR", "") == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------- worker
def ds_config(a, system):
    """The ZeRO-3 config of the recipe, with the "auto" values HF fills from TrainingArguments and the model."""
    zero = {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if a.memory_efficient_linear != "default":
        zero["memory_efficient_linear"] = a.memory_efficient_linear == "on"
    cfg = {
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if system == "z3ext":
        cfg["z3ext"] = True
    elif system == "z3ext-nohold":
        cfg["z3ext"] = {"enabled": True, "hold_for_backward": False}
    return cfg


def checkpointing_args(**kwargs):
    """`TrainingArguments` keywords for activation checkpointing: `activation_checkpointing*` where
    transformers has them (5.25; its `gradient_checkpointing*` aliases warn of removal in v6),
    `gradient_checkpointing*` before (as `tests/test_hf.py`)."""
    import dataclasses
    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": kwargs}


def _pairs(a, n):
    """n (chosen, rejected) pairs: a shared prompt (first half), different responses (second half)."""
    import torch
    g = torch.Generator().manual_seed(a.seed)
    chosen = torch.randint(0, a.vocab, (n, a.seq), generator=g)
    rejected = chosen.clone()
    rejected[:, a.seq // 2:] = torch.randint(0, a.vocab, (n, a.seq - a.seq // 2), generator=g)

    class Pairs(torch.utils.data.Dataset):

        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"chosen_input_ids": chosen[i], "rejected_input_ids": rejected[i]}

    return Pairs()


def _rank_main(a):
    """One system on this rank (under torchrun). Writes `<_result>.rank<r>.json` with its numbers or its
    error; rank 0 also writes `<_result>` with every rank's numbers."""
    rank = int(os.environ.get("RANK", 0))
    out = Path(a._result)
    try:
        res = _train(a, rank)
    except BaseException as e:  # noqa: BLE001 -- reported, then re-raised so torchrun tears the group down
        tb = traceback.format_exc()
        last = [ln for ln in tb.strip().splitlines() if ln.strip()][-1]
        Path(f"{out}.rank{rank}.json").write_text(json.dumps(dict(rank=rank, error=last[:1000], traceback=tb[-8000:],
                                                                  time=time.time())))
        raise
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(res))


def _train(a, rank):
    import torch
    import torch.nn.functional as F
    t0 = time.perf_counter()
    system = a._worker
    if system.startswith("z3ext"):
        import deepspeed_z3ext  # noqa: F401 -- before TrainingArguments/Trainer create the engine
    import deepspeed
    import transformers
    import peft
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback, TrainingArguments
    t_import = time.perf_counter() - t0

    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "") != "cpu"
    world = int(os.environ.get("WORLD_SIZE", 1))
    n_steps = a.warmup + a.steps
    if not cuda:
        # TrainingArguments with a DeepSpeed config hands accelerate no backend, which on a machine
        # without CUDA counts one process (use_cpu=True instead skips DeepSpeed's init): set up
        # accelerate's shared state for DeepSpeed over gloo first, and have TrainingArguments use it.
        from accelerate import PartialState
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        os.environ.pop("ACCELERATE_USE_DEEPSPEED")
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-recipe-out-"),
        deepspeed=ds_config(a, system),
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=n_steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        weight_decay=0.0,
        bf16=a.dtype == "bf16",
        **checkpointing_args(use_reentrant=True),
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        average_tokens_across_devices=False,
        seed=a.seed,
        data_seed=a.seed,
        accelerator_config=None if cuda else {"use_configured_state": True},
    )
    transformers.set_seed(a.seed)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, vocab_size=a.vocab,
                     n_positions=a.positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    # from_config opens deepspeed.zero.Init (TrainingArguments registered the ZeRO-3 config), as
    # from_pretrained would: the model is partitioned as it is built.
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if a.dtype == "bf16" else torch.float32)
    model.enable_input_require_grads()  # reentrant checkpointing of a frozen base needs grad-requiring inputs
    lora = peft.LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, lora_dropout=0.0, fan_in_fan_out=True,
                           target_modules=[t for t in a.lora_targets.split(",") if t], task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    n_total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    n_train = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)

    prompt = a.seq // 2
    losses, step_ms, step_end = [], [], []
    mem = {}

    def seq_logps(m, ids):
        logits = m(input_ids=ids, use_cache=False).logits[:, :-1]
        labels = ids[:, 1:].clone()
        labels[:, :prompt - 1] = -100  # response tokens only
        tok = -F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=-100)
        return tok.view(labels.shape).sum(-1)

    def forwards(m, c, r):
        if a.forwards == "concat":
            return seq_logps(m, torch.cat([c, r])).chunk(2)
        return seq_logps(m, c), seq_logps(m, r)

    class DPOTrainer(Trainer):

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            c, r = inputs["chosen_input_ids"], inputs["rejected_input_ids"]
            pc, pr = forwards(model, c, r)
            peft_model = self.accelerator.unwrap_model(model)
            with torch.no_grad(), peft_model.disable_adapter():
                rc, rr = forwards(model, c, r)
            loss = -F.logsigmoid(a.beta * ((pc - rc) - (pr - rr))).mean()
            losses.append(loss.detach())
            return (loss, {}) if return_outputs else loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Clock(TrainerCallback):

        def on_step_begin(self, args, state, control, **kw):
            sync()
            if state.global_step == a.warmup and cuda:  # first timed step: peak over the timed steps only
                torch.cuda.reset_peak_memory_stats()
                mem["base"] = torch.cuda.memory_allocated()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            now = time.perf_counter()
            step_ms.append((now - self.t) * 1e3)
            step_end.append(now)

    trainer = DPOTrainer(model=model, args=args, train_dataset=_pairs(a, n_steps * a.micro_batch * world),
                         callbacks=[Clock()])
    t_setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    trainer.train()
    sync()
    t_train = time.perf_counter() - t1

    base = trainer.accelerator.unwrap_model(trainer.model_wrapped).get_base_model()
    ckpt = [m for m in base.modules() if getattr(m, "gradient_checkpointing", False) is True]
    res = dict(rank=rank, system=system, world=world, checkpointing_modules=len(ckpt),
               step_ms=step_ms[a.warmup:], warmup_step_ms=step_ms[:a.warmup],
               iter_ms=[(y - x) * 1e3 for x, y in zip(step_end[a.warmup:], step_end[a.warmup + 1:])],
               losses=[float(x) for x in losses],
               max_rss_MiB=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               import_s=t_import, setup_s=t_setup, train_s=t_train, n_params=n_total, n_trainable=n_train,
               versions=dict(torch=torch.__version__, deepspeed=deepspeed.__version__,
                             transformers=transformers.__version__, peft=peft.__version__,
                             python=platform.python_version()))
    if cuda:
        res.update(peak_alloc_MiB=torch.cuda.max_memory_allocated() / 2**20,
                   base_alloc_MiB=mem.get("base", 0) / 2**20,
                   device_name=torch.cuda.get_device_name(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        res.update(peak_alloc_MiB=None, base_alloc_MiB=None, device_name=None)
    if system.startswith("z3ext"):
        try:
            import deepspeed_z3ext
            st = deepspeed_z3ext.stats(trainer.model_wrapped)
            res.update(z3ext_peak_live_MiB=st.peak_live_bytes / 2**20, z3ext_collectives=st.collectives)
        except Exception as e:  # noqa: BLE001 -- stats are extra
            res["z3ext_stats_error"] = f"{type(e).__name__}: {e}"[:300]
    return res


# ---------------------------------------------------------------------------------------------- parent
def _worker_argv(argv, system, result):
    """This script's own options, minus --systems/--out/--logs, plus the worker's."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in ("--systems", "--out", "--logs"):
            skip = True
            continue
        if any(x.startswith(f + "=") for f in ("--systems", "--out", "--logs")):
            continue
        out.append(x)
    return out + ["--_worker", system, "--_result", str(result)]


def run_system(a, argv, system, world, logs):
    result = Path(logs) / f"{system}.json"
    log = Path(logs) / f"{system}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve())] + _worker_argv(argv, system, result)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):  # this system's own process group only
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    rc = proc.wait(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    rc = None
    wall = time.perf_counter() - t0
    ranks = []
    for r in range(world):
        p = Path(f"{result}.rank{r}.json")
        if p.exists():
            ranks.append(json.loads(p.read_text()))
    # the first rank to fail names the cause (the others then fail on the closed connection, or are
    # ended by torchrun)
    errors = sorted((x for x in ranks if "error" in x), key=lambda x: x["time"])
    ok = [x for x in ranks if "error" not in x]
    out = dict(system=system, wall_s=wall, rc=rc, log=str(log))
    if errors or timed_out or rc != 0 or len(ok) != world:
        if errors:
            why = errors[0]["error"]
            out["traceback"] = errors[0]["traceback"]
            out["errors_by_rank"] = {x["rank"]: x["error"] for x in errors}
        elif timed_out:
            why = f"timed out after {a.timeout} s"
        else:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            why = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "?")
            why = f"rc {rc}: {why}"
        out.update(status="failed", error=why.strip()[:1000])
        return out
    r0 = ok[0] if ok[0]["rank"] == 0 else next(x for x in ok if x["rank"] == 0)
    n = len(r0["losses"])
    mean_losses = [statistics.fmean(x["losses"][i] for x in ok) for i in range(n)]
    peaks = [x["peak_alloc_MiB"] for x in ok]
    out.update(
        status="ok",
        step_ms=statistics.median(r0["step_ms"]) if r0["step_ms"] else None,
        # the slowest rank per step: the step is as long as its slowest rank (they sync every step)
        step_ms_max_rank=statistics.median(max(x["step_ms"][i] for x in ok) for i in range(len(r0["step_ms"])))
        if r0["step_ms"] else None,
        iter_ms=statistics.median(r0["iter_ms"]) if r0["iter_ms"] else None,
        peak_alloc_MiB=max(peaks) if all(p is not None for p in peaks) else None,
        peak_alloc_MiB_per_rank=peaks,
        base_alloc_MiB=r0["base_alloc_MiB"],
        max_rss_MiB=max(x["max_rss_MiB"] for x in ok),
        losses_rank0=r0["losses"], losses_mean=mean_losses, final_loss=mean_losses[-1] if n else None,
        setup_s=max(x["setup_s"] for x in ok), train_s=max(x["train_s"] for x in ok),
        n_params=r0["n_params"], n_trainable=r0["n_trainable"], device_name=r0["device_name"],
        versions=r0["versions"], nccl=r0.get("nccl"), per_rank=ok)
    for k in ("z3ext_peak_live_MiB", "z3ext_collectives", "z3ext_stats_error"):
        if k in r0:
            out[k] = r0[k]
    return out


def machine_name(world, results):
    names = [r["device_name"] for r in results.values() if r.get("device_name")]
    if names:
        return f"{world}x{names[0].replace(' ', '-')}"
    if _gpu_available():
        import torch
        return f"{world}x{torch.cuda.get_device_name(0).replace(' ', '-')}"
    return f"{world}xCPU-gloo"


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else f"{'None' if v is None else v:>{spec.split('.')[0]}}"


def table(res):
    a, s = res["args"], res["systems"]
    ok = {n: r for n, r in s.items() if r["status"] == "ok"}
    any_ok = next(iter(ok.values()), {})
    lines = [f"# hf_recipe on {res['machine']['name']}: HF Trainer + ZeRO-3 + LoRA({a['lora_targets']}, r {a['lora_r']}) "
             f"+ reentrant checkpointing + DPO ({a['forwards']} forwards, reference under disable_adapter)",
             f"# GPT-2 {a['layers']} layers, n_embd {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, "
             f"seq {a['seq']}, {a['micro_batch']} pair(s) per rank, world {res['world']}, {a['dtype']}, "
             f"{any_ok.get('n_params', 0)/1e6:.1f}M params ({any_ok.get('n_trainable', 0)/1e6:.2f}M trainable); "
             f"{a['warmup']} warm-up + {a['steps']} timed steps; memory_efficient_linear {a['memory_efficient_linear']}",
             f"{'system':>13} {'step ms':>9} {'slowest-rank ms':>15} {'iter ms':>9} {'peak alloc MiB':>14} "
             f"{'max RSS MiB':>11} {'setup s':>8} {'wall s':>7}  final loss (mean over ranks)"]
    for n, r in s.items():
        if r["status"] != "ok":
            lines.append(f"{n:>13} FAILED after {r['wall_s']:.1f} s: {r['error']}")
            continue
        lines.append(f"{n:>13} {_fmt(r['step_ms'], '9.1f')} {_fmt(r['step_ms_max_rank'], '15.1f')} "
                     f"{_fmt(r['iter_ms'], '9.1f')} {_fmt(r['peak_alloc_MiB'], '14.0f')} {r['max_rss_MiB']:11.0f} "
                     f"{r['setup_s']:8.1f} {r['wall_s']:7.1f}  {r['final_loss']:.6f}")
    lines.append("# per-step DPO loss (mean over ranks; step 1 is log 2 = 0.693147 while LoRA B is zero)")
    for n, r in ok.items():
        lines.append(f"{n:>13} " + " ".join(f"{x:.6f}" for x in r["losses_mean"]))
    st = s.get("stock")
    if st and st["status"] == "ok":
        lines.append("# ratios vs stock (< 1: smaller/faster than stock); max |loss - stock loss| over steps")
        for n, r in ok.items():
            if n == "stock":
                continue
            parts = []
            if r["step_ms"] and st["step_ms"]:
                parts.append(f"step {r['step_ms']/st['step_ms']:.2f}x")
            if r["peak_alloc_MiB"] and st["peak_alloc_MiB"]:
                parts.append(f"peak alloc {r['peak_alloc_MiB']/st['peak_alloc_MiB']:.3f}x "
                             f"({r['peak_alloc_MiB'] - st['peak_alloc_MiB']:+.0f} MiB)")
            else:
                parts.append("peak alloc None (no GPU)")
            parts.append(f"max RSS {r['max_rss_MiB']/st['max_rss_MiB']:.2f}x")
            if len(r["losses_mean"]) == len(st["losses_mean"]):
                d = max(abs(x - y) for x, y in zip(r["losses_mean"], st["losses_mean"]))
                parts.append(f"max |dloss| {d:.2e}" + (" (equal)" if d == 0 else ""))
            lines.append(f"  {n}/stock: " + ", ".join(parts))
    for n, r in s.items():
        if "z3ext_peak_live_MiB" in r:
            lines.append(f"  {n}: z3ext peak live gathered {r['z3ext_peak_live_MiB']:.1f} MiB, "
                         f"{r['z3ext_collectives']} collectives (rank 0)")
    if res["machine"]["name"].endswith("CPU-gloo"):
        lines.append("# CPU run: gloo ranks on CPU show host overhead only; memory is max RSS (no allocator peak)")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse(argv)
    if a._worker:
        return _rank_main(a)
    systems = [s for s in a.systems.split(",") if s]
    gpu = _gpu_available()
    if gpu:
        import torch
        world = a.world or torch.cuda.device_count()
    else:
        world = a.world or 2
        os.environ["DS_ACCELERATOR"] = "cpu"
    logs = Path(a.logs or tempfile.mkdtemp(prefix="hf-recipe-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"# hf_recipe: systems {systems}, world {world}, logs in {logs}", flush=True)
    build = None
    if any(s.startswith("z3ext") for s in systems):  # build the ops once, outside every system's time
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", "import deepspeed_z3ext"], capture_output=True, text=True)
        build = dict(s=time.perf_counter() - t0, rc=p.returncode, tail=(p.stdout + p.stderr)[-2000:])
        print(f"# deepspeed_z3ext import (ops build if not cached): {build['s']:.1f} s, rc {p.returncode}", flush=True)
    results = {}
    for s in systems:
        r = run_system(a, argv, s, world, logs)
        results[s] = r
        if r["status"] == "ok":
            print(f"# {s}: ok in {r['wall_s']:.1f} s, step {r['step_ms']:.1f} ms, final loss {r['final_loss']:.6f}", flush=True)
        else:
            print(f"# {s}: FAILED in {r['wall_s']:.1f} s: {r['error']} (log {r['log']})", flush=True)
    name = machine_name(world, results)
    res = dict(systems=results, world=world, args={k: v for k, v in vars(a).items() if not k.startswith("_")},
               ops_import=build, total_s=time.perf_counter() - T_START,
               machine=dict(name=name, host=platform.node(), cpu=platform.processor() or platform.machine(),
                            env={k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                            "NVSHMEM_DISABLE_NVLS", "TORCH_CUDA_ARCH_LIST",
                                                            "DS_ACCELERATOR") if k in os.environ}))
    out = Path(a.out) if a.out else ROOT / "bench" / "out" / f"hf-recipe-{name}{'-smoke' if a.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    text = table(res)
    out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    print(f"# wrote {out} and {out.with_suffix('.txt')} ({res['total_s']:.0f} s in all)")
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
