"""A user's HF Trainer script: a tiny Llama (from a config, no downloads) trained with a DeepSpeed
ZeRO-3 config dict that says `"z3ext": true`, launched by `torchrun` or `accelerate launch`. It never
imports deepspeed_z3ext unless `--explicit-import` (the reference run); the installed .pth attaches
it ([Note: activation]). Writes per-rank JSON to OUT_DIR: losses (exact floats), what z3ext did
(read from the module DeepSpeed's config check imported, not imported here), and DeepSpeed's comms
logger records when `--comms-logger`."""
import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--explicit-import", action="store_true")
parser.add_argument("--comms-logger", action="store_true")
args = parser.parse_args()
if args.explicit_import:
    import deepspeed_z3ext  # noqa: F401

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

STEPS, SEQ, VOCAB, BSZ = 3, 16, 128, 2
ds_config = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                          "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
    "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    "z3ext": True,
}
if args.comms_logger:
    ds_config["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True, "debug": False}


class RecordingTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self.recorded.append((out[0] if return_outputs else out).detach().item())
        return out


g = torch.Generator().manual_seed(4321)
rows = []
for _ in range(STEPS * BSZ * 2):
    ids = torch.randint(0, VOCAB, (SEQ, ), generator=g)
    rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(SEQ, dtype=torch.long)})
targs = TrainingArguments(output_dir=os.path.join(args.out_dir, "trainer"), deepspeed=ds_config, use_cpu=True,
                          ddp_backend="gloo", report_to=[], save_strategy="no", eval_strategy="no",
                          logging_strategy="no", dataloader_num_workers=0, per_device_train_batch_size=BSZ,
                          max_steps=STEPS, learning_rate=1e-3, warmup_steps=0, seed=1234, data_seed=1234,
                          remove_unused_columns=False, disable_tqdm=True)
config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
                     dtype="float32")
transformers.set_seed(1234)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # inside zero.Init (ZeRO-3 is on)
trainer = RecordingTrainer(model=model, args=targs, train_dataset=rows)
trainer.recorded = []
trainer.train()

engine = trainer.model_wrapped
z3ext = sys.modules.get("deepspeed_z3ext")  # imported by the activation check, not by this script
out = {"losses": trainer.recorded, "z3ext_imported": z3ext is not None, "explicit": args.explicit_import}
if z3ext is not None:
    stats, grads = z3ext.stats(engine), z3ext.grad_stats(engine)
    out.update(gather_collectives=stats.collectives, grad_flushes=grads.flushes, reduced_params=grads.reduced_params,
               grad_reduce_scatters=grads.reduce_scatters)
if args.comms_logger:
    from deepspeed import comm as ds_comm
    out["comms"] = {name: {str(size): rec[0] for size, rec in sizes.items()}
                    for name, sizes in ds_comm.comms_logger.get_raw_data().items()}
rank = int(os.environ["RANK"])
with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
# An orderly end: both ranks done with every collective before either tears its process group down
# (a rank of this script aborted at exit once in CI, "terminate called without an active exception",
# after its results were written; not reproduced in 39 runs on the 2-core VM).
torch.distributed.barrier()
engine.destroy()
torch.distributed.destroy_process_group()
