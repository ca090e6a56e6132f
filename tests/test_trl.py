"""TRL's trainers unchanged on z3ext: SFTTrainer, DPOTrainer and GRPOTrainer, driven by their configs (TRL's
defaults, activation checkpointing on) with `deepspeed=<ZeRO-3 config dict>`, on 2 real gloo ranks, a tiny Llama
and a character tokenizer saved to a local folder that TRL loads by path (policy and reference alike). Every case
trains on stock ZeRO-3 first, then with `"z3ext": true`, in the same processes; nothing here imports z3ext (the
installed .pth attaches it at the config check). Every logged step (loss, grad norm, TRL's metrics, and
`total_flos`, which HF counts from the numel of the parameters after each backward: which ones are gathered then)
and every final parameter of the policy and of TRL's reference engine must be bitwise equal (CPU, fp32, same
seeds). GRPO without the gather for generation raises on stock 0.19.8; there z3ext must train with the bits of
stock's run with the gather."""
import pytest

from tests.harness import run_on_ranks

pytest.importorskip("trl")

STEPS = 2
TIMING = ("runtime", "per_second", "_time", "profiling")  # wall-clock entries of the logs, not results


def _rows(kind, n, seed=4321):
    import random
    from tests.hf_tiny import CHARS
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice(CHARS) for _ in range(k))  # noqa: E731
    if kind == "sft":
        return [{"text": text(20)} for _ in range(n)]
    if kind == "dpo":
        return [{"prompt": text(6), "chosen": text(8), "rejected": text(8)} for _ in range(n)]
    return [{"prompt": text(6)} for _ in range(n)]


def _reward_a(completions, **kwargs):
    """GRPO's reward: how many 'a' each completion holds (a plain Python reward function)."""
    return [float(c.count("a")) for c in completions]


def _train(kind, opts, model_dir, run_dir, z3ext):
    """One TRL run on this rank: its logged steps, final parameters and what z3ext did; or what it raised."""
    import os
    import sys
    import datasets
    import deepspeed
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from peft import LoraConfig
    import trl
    from tests.hf_tiny import hf_zero3_config, z3ext_engaged

    AcceleratorState._reset_state()  # a second trainer in this process gets its own DeepSpeed plugin
    if dist.get_rank() == 0:  # on disk: DPO's precomputed log-probs are cached next to the data, one file for all ranks
        datasets.Dataset.from_list(_rows(kind, 64)).save_to_disk(os.path.join(run_dir, "data"))
    dist.barrier()
    data = datasets.load_from_disk(os.path.join(run_dir, "data"))
    lora = opts.get("lora", False)
    opts = {k: v for k, v in opts.items() if k not in ("lora", "stock_raises", "as_stock")}  # the test's own keys
    common = dict(output_dir=os.path.join(run_dir, "out"), deepspeed=hf_zero3_config(z3ext), use_cpu=True,
                  ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=1, max_steps=STEPS,
                  per_device_train_batch_size=2, learning_rate=1e-2 if lora else 1e-3, seed=1234, data_seed=1234,
                  bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0)
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             task_type="CAUSAL_LM") if lora else None
    if kind == "sft":
        trainer = trl.SFTTrainer(model=model_dir, args=trl.SFTConfig(max_length=32, **common, **opts),
                                 train_dataset=data, peft_config=peft_config)
    elif kind == "dpo":
        trainer = trl.DPOTrainer(model=model_dir, args=trl.DPOConfig(max_length=32, **common, **opts),
                                 train_dataset=data, peft_config=peft_config)
    else:
        trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_reward_a,
                                  args=trl.GRPOConfig(max_completion_length=8, num_generations=2, **common, **opts),
                                  train_dataset=data, peft_config=peft_config)
    engines = {}
    if isinstance(getattr(trainer, "ref_model", None), deepspeed.DeepSpeedEngine):
        engines["ref"] = trainer.ref_model
    try:
        trainer.train()
    except Exception as e:  # every rank raises at the same call (stock's GRPO without the gather)
        return dict(raised=f"{type(e).__name__}: ...{str(e)[-200:]}")  # a tensor may open the message
    engines["policy"] = trainer.model_wrapped
    out = dict(logs=[{k: v for k, v in e.items() if not any(t in k for t in TIMING)} for e in trainer.state.log_history],
               engaged={n: z3ext_engaged(e) for n, e in engines.items()}, params={}, raised=None)
    for name, e in engines.items():
        with deepspeed.zero.GatheredParameters(list(e.module.parameters())):
            out["params"][name] = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    z3 = sys.modules.get("deepspeed_z3ext")  # imported by the activation check, not here
    out["collectives"] = z3.stats(engines["policy"]).collectives if z3 is not None and z3ext else 0
    dist.barrier()
    for e in engines.values():
        e.destroy()
    return out


def compare_trl(kind, cases, model_dir, work_dir):
    """Every case on stock first (z3ext not imported yet: stock's own code throughout), then on z3ext."""
    import os
    import sys
    import time
    import torch
    import torch.distributed as dist
    assert "deepspeed_z3ext" not in sys.modules, "the test must not import deepspeed_z3ext"
    runs, seconds = {}, {}
    for z3ext in (False, True):
        for name, opts in cases.items():
            t0 = time.monotonic()
            runs[name, z3ext] = _train(kind, opts, model_dir, os.path.join(work_dir, name, str(z3ext)), z3ext)
            seconds[name, z3ext] = round(time.monotonic() - t0, 1)
        if not z3ext:
            assert "deepspeed_z3ext" not in sys.modules, "a stock run imported deepspeed_z3ext"
    results = {}
    for name, opts in cases.items():
        stock, z3 = runs[opts.get("as_stock", name), False], runs[name, True]
        r = dict(rank=dist.get_rank(), stock_raised=runs[name, False]["raised"], z3_raised=z3["raised"],
                 seconds=(seconds[name, False], seconds[name, True]))
        if stock["raised"] is None and z3["raised"] is None:
            r.update(stock_logs=stock["logs"], z3_logs=z3["logs"], stock_engaged=stock["engaged"],
                     z3_engaged=z3["engaged"], collectives=z3["collectives"], engines=sorted(z3["params"]),
                     mismatched={f"{e}.{n}": (p - z3["params"][e][n]).abs().max().item()
                                 for e, ps in stock["params"].items() for n, p in ps.items()
                                 if not torch.equal(p, z3["params"][e][n])})
        results[name] = r
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama and its tokenizer, saved once; TRL loads both by path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from tests.hf_tiny import char_tokenizer, tiny_llama_config
    d = tmp_path_factory.mktemp("tiny-llama")
    tok = char_tokenizer()
    config = tiny_llama_config(vocab_size=len(tok), hidden_size=32, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.set_seed(1234)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def _check(results, cases):
    for rank_results in results:
        for name, r in rank_results.items():
            case, where = cases[name], f"rank {r['rank']}, {name}"
            assert r["z3_raised"] is None, f"{where}: z3ext raised: {r['z3_raised']}"
            expected = case.get("stock_raises")
            assert (expected in r["stock_raised"]) if expected else r["stock_raised"] is None, \
                f"{where}: stock raised {r['stock_raised']!r}, expected {expected!r}"
            steps = [e for e in r["stock_logs"] if "loss" in e]
            assert len(steps) == STEPS, f"{where}: {r['stock_logs']}"
            assert r["stock_logs"] == r["z3_logs"], f"{where}: logs differ:\n stock {r['stock_logs']}\n z3ext {r['z3_logs']}"
            assert not r["mismatched"], f"{where}: parameters differ (max abs diff): {r['mismatched']}"
            # TRL's reference engine exists where a reference model is kept (sync_ref_model here)
            assert r["engines"] == (["policy", "ref"] if case.get("sync_ref_model") else ["policy"]), (where, r["engines"])
            assert not any(r["stock_engaged"].values()), f"{where}: the stock run engaged z3ext: {r['stock_engaged']}"
            assert all(r["z3_engaged"].values()) and r["collectives"] > 0, f"{where}: z3ext idle: {r}"


def _run(kind, cases, model_dir, tmp_path):
    _check(run_on_ranks(compare_trl, kind=kind, cases=cases, model_dir=model_dir, work_dir=str(tmp_path), timeout=400),
           cases)


def test_sft(model_dir, tmp_path):
    _run("sft", {"sft": {}}, model_dir, tmp_path)


DPO = {
    # TRL's reference engine (prepare_deepspeed: ZeRO-3 without optimizer), moved towards the policy after every
    # step by SyncRefModelCallback: one GatheredParameters over both engines, modifier_rank=0
    "dpo-ref-sync": {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
    # reference log-probs computed before training by an inference engine over the policy's own module
    "dpo-precompute": {"precompute_ref_log_probs": True},
    # no reference model: the policy with its adapter disabled
    "dpo-lora": {"lora": True},
}


def test_dpo(model_dir, tmp_path):
    _run("dpo", DPO, model_dir, tmp_path)


# A window of 3 micro-steps, a generation every 2 (steps_per_generation 1, num_iterations 2): the second one
# falls inside the window, after backwards, and the misaligned windows make TRL compute the old log-probs too.
GRPO_WINDOW = {"gradient_accumulation_steps": 3, "steps_per_generation": 1, "num_iterations": 2, "beta": 0.1}
SYNC = {"sync_ref_model": True, "ref_model_sync_steps": 1}
GRPO = {
    "grpo-gather": {"ds3_gather_for_generation": True, **SYNC, **GRPO_WINDOW},
    # Stock raises here (the fused LM head's GatheredParameters meets a parameter the coordinator prefetched
    # during generation); z3ext trains, with the bits of stock's run with the gather.
    "grpo-nogather": {"ds3_gather_for_generation": False, **SYNC, **GRPO_WINDOW,
                      "stock_raises": "Cannot partition a param in flight", "as_stock": "grpo-gather"},
    "grpo-lora": {"lora": True, **GRPO_WINDOW},
}


def test_grpo(model_dir, tmp_path):
    _run("grpo", GRPO, model_dir, tmp_path)
