"""The README's snippet as a script: a tiny model trained a few steps by a z3ext ZeRO-3 engine, printing
its losses, what z3ext did (`stats`, `grad_stats`) and the full weights `full_weights` streams out.

    torchrun --nproc_per_node 2 examples/train.py                      # GPUs (NCCL)
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/train.py   # CPU (gloo)
    deepspeed --num_gpus 2 examples/train.py                           # DeepSpeed's launcher

Installed with pip, `import deepspeed_z3ext` is not needed for the engine (the config's `"z3ext": true`
attaches it); it is imported here for `stats`, `grad_stats` and `full_weights`. tests/test_examples.py
runs it on 2 CPU ranks.
"""
import torch
import deepspeed
import deepspeed_z3ext

STEPS, BATCH, WIDTH = 5, 8, 64

torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                            torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))
config = {
    "train_micro_batch_size_per_gpu": BATCH,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},  # torch's AdamW: no op to build
    # 0: even this tiny model's parameters are partitioned and gathered (by default ones under 1e5 elements stay whole)
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "z3ext": True,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
rank = engine.global_rank

x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 + rank))  # each rank its own batch
y = x @ torch.randn(WIDTH, 1, generator=torch.Generator().manual_seed(1)) / WIDTH**0.5  # to learn
x, y = x.to(engine.device), y.to(engine.device)
for step in range(STEPS):
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)

stats = deepspeed_z3ext.stats(engine)          # live bytes, claims, re-fills, all-gathers, prefetches
grads = deepspeed_z3ext.grad_stats(engine)     # flushes, reduce-scatters, host time
numel = 0
for bucket in deepspeed_z3ext.full_weights(engine, bucket_bytes=1 << 29):  # collective: every rank iterates
    numel += sum(w.tensor.numel() for w in bucket)  # [(name, full tensor)]; copy what you keep
if rank == 0:
    print(stats, flush=True)
    print(grads, flush=True)
    print(f"full weights: {numel} elements", flush=True)

torch.distributed.barrier()  # every rank done with its collectives before any tears the group down
engine.destroy()
torch.distributed.destroy_process_group()
