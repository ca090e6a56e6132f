"""fp16 with loss scaling, step by step: stock ZeRO-3 against z3ext engines built one after another in the same
rank processes (TinyGPT 42 wide, 3 steps of 2 micro-steps, the program of tests/test_master.py), on gloo ranks
sharing one GPU ([Note: ranks on one GPU] in tests/harness.py) or on the CPU.

    Z3EXT_RANKS_ON_ONE_GPU=4 GLOO_SOCKET_IFNAME=lo python3 bench/fp16_steps.py --repeat 3
    python3 bench/fp16_steps.py --world 4 --variants default      # CPU (DeepSpeed's fp16 check passed over)

Per engine and rank: each step's loss scale, stock's or z3ext's overflow verdict and the parameters whose fp32
master differs from the first stock engine's. `--variants` (z3ext options): default, keep_grads
(free_grad_partitions off), ds_grads (reduce_gradients off: DeepSpeed's gradient path), lp_kept
(partition_from_master off); stock runs `--repeat` times too, so that stock's own run-to-run differences show."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"default": {}, "keep_grads": {"free_grad_partitions": False}, "ds_grads": {"reduce_gradients": False},
            "lp_kept": {"partition_from_master": False}}


def engines(names, repeat):
    import numpy as np
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from tests.harness import on_gpu
    from tests.models import batch
    from tests.test_master import GA, STEPS, _engine, allow_fp16_on_cpu
    from tests.training import train
    allow_fp16_on_cpu()
    rank, out, first = dist.get_rank(), [], None
    for k in range(repeat):
        for name in ["stock"] + names:
            engine = _engine("fp16", False if name == "stock" else dict(enabled=True, **VARIANTS[name]))
            rows = []

            def after(engine, step):
                opt = engine.optimizer
                masters = {n: safe_get_full_fp32_param(p).cpu().numpy().copy()
                           for n, p in engine.module.named_parameters()}
                rows.append((float(opt.loss_scale), bool(getattr(opt, "overflow", False)), masters))

            train(engine, STEPS, lambda i: batch(i, rank).cuda() if on_gpu() else batch(i, rank), ga=GA,
                  after_step=after)
            engine.destroy()
            if first is None:
                first = rows
            out.append((f"{name}#{k}", [(scale, overflow, sorted(n for n in m if not np.array_equal(m[n], f[2][n])))
                                        for (scale, overflow, m), f in zip(rows, first)]))
    return out


def main():
    from tests.harness import ranks_on_one_gpu, run_on_ranks
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="default,keep_grads,ds_grads,lp_kept")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--world", type=int, default=2, help="ranks on the CPU (on one GPU: Z3EXT_RANKS_ON_ONE_GPU)")
    a = p.parse_args()
    backend = "nccl" if ranks_on_one_gpu() else "gloo"
    results = run_on_ranks(engines, world_size=2 if ranks_on_one_gpu() else a.world, backend=backend, timeout=900,
                           names=a.variants.split(","), repeat=a.repeat)
    print(f"# fp16 steps: {len(results)} ranks ({'gloo ranks on one GPU' if backend == 'nccl' else 'gloo, CPU'})")
    print("| engine | rank | step: loss scale, overflow, masters unlike the first stock engine's |")
    print("|---|---|---|")
    for i, (engine, _) in enumerate(results[0]):
        for rank, r in enumerate(results):
            steps = "; ".join(f"{scale:g} {'overflow' if o else 'ok'} {len(d)}" for scale, o, d in r[i][1])
            print(f"| {engine} | {rank} | {steps} |")


if __name__ == "__main__":
    main()
