"""The real client: a tiny Llama (from a config, no downloads) trained by HF `transformers.Trainer`
through Accelerate with a DeepSpeed ZeRO-3 config dict, with `"z3ext": true` vs the same config
without it, on 2 real gloo ranks. Per-step losses and final parameters must be bitwise equal (CPU,
fp32, same seed) for three recipes: full fine-tune, LoRA (PEFT) with reentrant gradient
checkpointing, and a DPO-shaped loss (policy forward, then a reference forward of the same model
under no_grad with the adapter disabled, then backward) with every parameter partitioned."""
import pytest

from tests.harness import run_on_ranks
from tests.hf_tiny import hf_zero3_config, tiny_llama_config, z3ext_engaged

STEPS = 4
SEQ = 16
VOCAB = 128


def _dataset(n, seed=4321):
    import torch
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ, ), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(SEQ, dtype=torch.long)})
    return rows


def checkpointing_args(**kwargs):
    """`TrainingArguments` keywords that turn on activation checkpointing with these kwargs, by the
    name this transformers takes: `activation_checkpointing*` where it has them (5.25), whose
    `gradient_checkpointing*` aliases warn of their removal in v6 whenever passed (even False);
    `gradient_checkpointing*` before (5.18 and older). Off: pass none of them."""
    import dataclasses
    from transformers import TrainingArguments
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": kwargs}


def _train_once(recipe, ds_config, out_dir, seed=1234, steps=STEPS, bsz=2, ga=1):
    """One HF Trainer run; returns (per-step local losses, {name: full parameter}) on every rank."""
    import torch
    import deepspeed
    import deepspeed_z3ext  # before the engine is built: installs the seams ("z3ext" is ignored without it)
    import transformers
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, TrainingArguments

    AcceleratorState._reset_state()  # a second Trainer in this process gets its own DeepSpeed plugin
    lora = recipe in ("lora", "dpo")
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=ds_config, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no", eval_strategy="no", logging_strategy="no", dataloader_num_workers=0,
        per_device_train_batch_size=bsz, gradient_accumulation_steps=ga, max_steps=steps,
        learning_rate=1e-2 if lora else 1e-3, warmup_steps=0, weight_decay=0.01, seed=seed, data_seed=seed,
        bf16=False, fp16=False, remove_unused_columns=False, disable_tqdm=True,
        **(checkpointing_args(use_reentrant=True) if lora else {}))
    assert transformers.integrations.is_deepspeed_zero3_enabled()
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=64)
    transformers.set_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # inside zero.Init (ZeRO-3 is on)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    losses = []
    trainer_cls = _DPOTrainer() if recipe == "dpo" else _RecordingTrainer()
    trainer = trainer_cls(model=model, args=args, train_dataset=_dataset(steps * bsz * ga * 2))
    trainer.recorded = losses
    trainer.train()
    engine = trainer.model_wrapped
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    engaged = z3ext_engaged(engine)
    assert engaged == bool(ds_config.get("z3ext")), f"z3ext engaged={engaged} but config z3ext={ds_config.get('z3ext')}"
    collectives = deepspeed_z3ext.stats(engine).collectives if engaged else None
    params = {}
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        for n, p in engine.module.named_parameters():
            params[n] = p.detach().clone()
    partitioned = sum(1 for p in engine.module.parameters() if not p.ds_persist)
    n_trainable = sum(1 for p in engine.module.parameters() if p.requires_grad)
    engine.destroy()
    return dict(losses=losses, params=params, collectives=collectives, partitioned=partitioned,
                n_params=len(params), n_trainable=n_trainable)


def _RecordingTrainer():
    from transformers import Trainer

    class RecordingTrainer(Trainer):
        """Records each micro-step's local loss exactly (Trainer's own logs round to 4 digits)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            loss = out[0] if return_outputs else out
            self.recorded.append(loss.detach().item())
            return out

    return RecordingTrainer


def _DPOTrainer():
    import torch
    import torch.nn.functional as F
    from transformers import Trainer

    def seq_logps(logits, labels):
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return torch.gather(logp, 2, labels[:, 1:].unsqueeze(-1)).squeeze(-1).sum(-1)

    class DPOShapedTrainer(Trainer):
        """TRL's DPO with a PEFT model, reduced to its shape: the policy forward, then the reference
        forward of the same model with the adapter disabled under no_grad, then a sigmoid loss on the
        chosen/rejected log-prob margins (row 0 of each batch is 'chosen', row 1 'rejected')."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            policy = seq_logps(model(input_ids=ids, attention_mask=mask).logits, ids)
            peft_model = self.accelerator.unwrap_model(model)
            with torch.no_grad(), peft_model.disable_adapter():
                ref = seq_logps(model(input_ids=ids, attention_mask=mask).logits, ids)
            margin = (policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2])
            loss = -F.logsigmoid(0.1 * margin).mean()
            self.recorded.append(loss.detach().item())
            return (loss, None) if return_outputs else loss

    return DPOShapedTrainer


def compare_hf(recipe, persistence="auto", z3ext=True, zero_extra=None, steps=STEPS):
    import tempfile
    import time
    import torch
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        stock = _train_once(recipe, hf_zero3_config(False, persistence, zero_extra), tmp + "/stock", steps=steps)
        t1 = time.monotonic()
        z3 = _train_once(recipe, hf_zero3_config(z3ext, persistence, zero_extra), tmp + "/z3ext", steps=steps)
        t2 = time.monotonic()
    mismatched = {n: (stock["params"][n] - z3["params"][n]).abs().max().item()
                  for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])}
    trained = [n for n, p in z3["params"].items() if "lora_" in n or recipe == "full"]
    return dict(rank=dist.get_rank(), stock_losses=stock["losses"], z3_losses=z3["losses"], mismatched=mismatched,
                collectives=z3["collectives"], stock_partitioned=stock["partitioned"],
                z3_partitioned=z3["partitioned"], n_params=z3["n_params"], n_trainable=z3["n_trainable"],
                trained=len(trained), seconds=(t1 - t0, t2 - t1))


def _check(results, recipe, steps=STEPS, all_partitioned=False):
    for r in results:
        assert len(r["stock_losses"]) == steps and len(r["z3_losses"]) == steps, r
        assert r["stock_losses"] == r["z3_losses"], \
            f"rank {r['rank']}: losses differ:\n stock {r['stock_losses']}\n z3ext {r['z3_losses']}"
        assert not r["mismatched"], f"rank {r['rank']}: parameters differ (max abs diff): {r['mismatched']}"
        assert r["collectives"] and r["collectives"] > 0, "z3ext issued no all-gather: it did not engage"
        assert r["stock_partitioned"] == r["z3_partitioned"] > 0
        if all_partitioned:
            assert r["z3_partitioned"] == r["n_params"], "persistence threshold 0: every parameter is partitioned"
        else:  # "auto" (10 * hidden): the norm weights persistent, the rest partitioned
            assert r["z3_partitioned"] < r["n_params"]
        if recipe != "full":
            assert 0 < r["n_trainable"] < r["n_params"], "LoRA: only the adapters train"
    losses = results[0]["z3_losses"]
    assert losses[0] != losses[-1], "training did not move the loss"


def test_hf_trainer_full_finetune():
    results = run_on_ranks(compare_hf, recipe="full", timeout=240)
    _check(results, "full")


def test_hf_trainer_lora_reentrant_checkpointing():
    results = run_on_ranks(compare_hf, recipe="lora", timeout=240)
    _check(results, "lora")


def test_hf_trainer_dpo_shaped_peft_reference_forward():
    """Issue 15 (1): the reference forward (no_grad, adapter disabled) between the policy forward
    and its backward; threshold 0 partitions the RMSNorm weights, which autograd saves itself."""
    results = run_on_ranks(compare_hf, recipe="dpo", persistence=0, timeout=240)
    _check(results, "dpo", all_partitioned=True)


def _rms_model():
    """Blocks of an RMSNorm as HF's LlamaRMSNorm (reads its input twice) plus a residual."""
    import torch
    import torch.nn as nn

    class RMSNorm(nn.Module):

        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)  # first read of x
            return self.weight * (x * torch.rsqrt(var + 1e-6))  # second read of x

    class Block(nn.Module):

        def __init__(self, d):
            super().__init__()
            self.norm = RMSNorm(d)
            self.fc = nn.Linear(d, d)

        def forward(self, x):
            return x + self.fc(self.norm(x))  # third read of x: the residual, outside the norm

    class Net(nn.Module):

        def __init__(self, vocab=64, d=32):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(3))
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            h = self.embed(tokens)
            for b in self.blocks:
                h = b(h)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.roll(-1, 1).flatten())

    return Net()


def compare_grads_rms(z3ext_options=None, steps=3):
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from tests.models import batch, build_engine, ds_config, full_params

    def run(cfg):
        engine = build_engine(cfg, model_fn=_rms_model)
        losses, grads = [], []
        for step in range(steps):
            loss = engine(batch(step, dist.get_rank()))
            engine.backward(loss)
            grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
            engine.step()
            losses.append(loss.item())
        return losses, grads, full_params(engine)

    sl, sg, sp = run(ds_config(persistence=0, ga=1))
    zl, zg, zp = run(ds_config(z3ext={"enabled": True, **(z3ext_options or {})}, persistence=0, ga=1))
    grad_diffs = [sorted(n for n in s if not torch.equal(s[n], z[n])) for s, z in zip(sg, zg)]
    return dict(stock_losses=sl, z3_losses=zl, grad_diffs=grad_diffs,
                mismatched=sorted(n for n in sp if not torch.equal(sp[n], zp[n])))


@pytest.mark.parametrize("hold", [True, False], ids=["hold", "nohold"])
def test_gradient_sum_order_of_a_module_input_read_inside_and_outside(hold):
    """Issue 15 (6): stock wraps every module input in an identity autograd node, so the gradient
    contributions from inside a module (RMSNorm reads its input twice) are summed before the one from
    outside (the residual); without that node autograd sums all three in its own order, and the
    result differs in the last bit. Gradients are compared directly (Adam hides such differences
    from the losses for a few steps)."""
    results = run_on_ranks(compare_grads_rms, z3ext_options={"hold_for_backward": hold})
    for rank, r in enumerate(results):
        assert all(not d for d in r["grad_diffs"]), f"rank {rank}: gradients differ from stock per step: {r['grad_diffs']}"
        assert r["stock_losses"] == r["z3_losses"], f"rank {rank}: losses differ"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
