"""How fast the GPU gathers one unit's bytes in each form z3ext could issue it.

    python bench/allgather_forms.py [--unit-mib 112] [--units 16] [--parts 3,1,4,4]

Forms, each gathering `units` units of `unit-mib` MiB (the bench GPT's block size by default):
flat (one buffer, in place: the limit in gather_release.py), coalesced in place (each unit as
`parts` tensors, inputs inside their outputs: the limit's second number), coalesced out of place
(inputs are separate partition tensors: what z3ext issues, [Note: parameter-major buckets]), and
one call per tensor. Median ms over repeats; rank 0 writes bench/out/allgather-forms-<machine>.txt
(untracked).
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather_release as gr  # noqa: E402


def _time(fn, clock, repeats):
    times = []
    for i in range(repeats + 2):
        t0 = clock.now()
        fn()
        if i >= 2:
            times.append((clock.now() - t0) * 1e3)
    return statistics.median(times)


def _rank_main(argv):
    import os
    import torch.distributed as dist
    a = _parse(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    clock = gr.Clock(device)
    weights = [int(k) for k in a.parts.split(",")]
    per_rank = (a.unit_mib << 20) // 2 // world  # bf16 elements per rank per unit
    sizes = [per_rank * k // sum(weights) for k in weights]
    sizes[-1] += per_rank - sum(sizes)
    out = torch.empty(per_rank * world, dtype=torch.bfloat16, device=device)
    outs, ins_inplace, off = [], [], 0
    for n in sizes:
        outs.append(out.narrow(0, off, n * world))
        ins_inplace.append(outs[-1].narrow(0, rank * n, n))
        off += n * world
    ins_separate = [torch.ones(n, dtype=torch.bfloat16, device=device) for n in sizes]
    flat_in = out.narrow(0, rank * per_rank, per_rank)

    forms = {
        "flat, in place": lambda: [dist.all_gather_into_tensor(out, flat_in) for _ in range(a.units)],
        "coalesced, in place": lambda: [pg.allgather_into_tensor_coalesced(outs, ins_inplace).wait()
                                        for _ in range(a.units)],
        "coalesced, out of place": lambda: [pg.allgather_into_tensor_coalesced(outs, ins_separate).wait()
                                            for _ in range(a.units)],
        "one call per tensor": lambda: [dist.all_gather_into_tensor(o, i) for _ in range(a.units)
                                        for o, i in zip(outs, ins_separate)],
    }
    results = {name: _time(fn, clock, a.repeats) for name, fn in forms.items()}
    if rank == 0:
        machine = gr.machine_name(world, device)
        total = a.units * per_rank * world * 2
        lines = [f"# bench/allgather_forms.py on {machine}: {a.units} units of {a.unit_mib} MiB, parts {a.parts}"]
        for name, ms in results.items():
            lines.append(f"{name:>26} {ms:8.3f} ms  {total / ms / 1e6:7.1f} GB/s algbw  "
                         f"{ms / results['flat, in place']:.2f}x flat")
        text = "\n".join(lines) + "\n"
        gr.OUT_DIR.mkdir(parents=True, exist_ok=True)
        (gr.OUT_DIR / f"allgather-forms-{machine}.txt").write_text(text)
        print(text)
    dist.barrier()
    dist.destroy_process_group()


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unit-mib", type=int, default=112)
    p.add_argument("--units", type=int, default=16)
    p.add_argument("--parts", default="3,1,4,4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--world", type=int, default=None)
    return p.parse_args(argv)


def main():
    a = _parse(sys.argv[1:])
    world = a.world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    gr.spawn(_rank_main, sys.argv[1:], world)


if __name__ == "__main__":
    main()
