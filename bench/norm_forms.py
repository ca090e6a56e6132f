"""How fast one device computes a gradient norm over a rank's partitions in each form z3ext could use.

    python bench/norm_forms.py [--numel 838e6] [--tensors 390] [--dtype bf16]

A rank's gradient partitions (`--tensors` views of one flat buffer, `--numel` elements in all, sizes in
the proportions of a GPT's parameters: a few large matrices, many small vectors) and the forms of their
2-norm: stock's loop (`g.to(fp64).norm(2)` per partition), `torch._foreach_norm(..., dtype=fp64)` (z3ext's
[Note: gradient norm]), the same in fp32, and the flat buffer (the partitions' consecutive run) as one
tensor of `_foreach_norm` or of `linalg.vector_norm`. Median ms over
repeats, wall from the host with the device synchronized, printed as a table.

Then the total norm each fp64 form gives (stock's `sum(pow(stack(norms), 2)) ** 0.5`; for the flat run
`pow(norm, 2) ** 0.5`, as [Note: gradient norm] computes it) against stock's loop on the same partitions:
the largest relative difference over `--seeds` draws of each value distribution (`randn`; `randn` with a
log-uniform scale per partition over 1e-4..1e4, as a model's layers differ).
"""
import argparse
import statistics
import time

import torch


def _sizes(numel: int, tensors: int):
    """Per GPT block 4 matrices (qkv 3h², proj h², fc 4h², fc2 4h² in the ratio 3:1:4:4) and 8 vectors."""
    blocks = max(1, tensors // 12)
    per_block = numel // blocks
    mats = [per_block * w // 12 for w in (3, 1, 4, 4)]
    vec = max(1, (per_block - sum(mats)) // 8)
    out = []
    for _ in range(blocks):
        out += mats + [vec] * 8
    return out[:tensors]


def _time(fn, repeats):
    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=838e6, help="elements of the partitions together")
    p.add_argument("--tensors", type=int, default=390)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seeds", type=int, default=5, help="draws per value distribution for the norms' differences")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sizes = _sizes(int(a.numel), a.tensors)
    flat = torch.randn(sum(sizes), device=device, dtype=dtype)
    parts = list(flat.split(sizes))
    forms = {
        "stock loop (fp64 per partition)": lambda: torch.stack([g.to(torch.float64).norm(2) for g in parts]),
        "_foreach_norm dtype fp64": lambda: torch._foreach_norm(parts, 2.0, dtype=torch.float64),
        "_foreach_norm dtype fp32": lambda: torch._foreach_norm(parts, 2.0, dtype=torch.float32),
        "_foreach_norm (input dtype)": lambda: torch._foreach_norm(parts, 2.0),
        "_foreach_norm of the flat buffer, fp64": lambda: torch._foreach_norm([flat], 2.0, dtype=torch.float64),
        "vector_norm of the flat buffer, fp64": lambda: torch.linalg.vector_norm(flat, 2.0, dtype=torch.float64),
        "vector_norm of the flat buffer, fp32": lambda: torch.linalg.vector_norm(flat, 2.0, dtype=torch.float32),
    }
    print(f"# bench/norm_forms.py on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}: "
          f"{len(parts)} partitions, {sum(sizes) / 1e6:.0f}M {a.dtype} elements, median of {a.repeats}")
    for name, fn in forms.items():
        print(f"{name:>40}: {_time(fn, a.repeats):8.3f} ms")
    _differences(flat, parts, a.seeds)


def _total(norms):
    """Stock's reduction of per-partition norms (`_get_norm_groups`, then the root)."""
    return float(torch.sum(torch.pow(torch.stack(list(norms)), 2.0)) ** 0.5)


def _differences(flat, parts, seeds):
    f64 = torch.float64
    totals = {
        "_foreach_norm dtype fp64 (per partition)": lambda: _total(torch._foreach_norm(parts, 2.0, dtype=f64)),
        "_foreach_norm of the flat run, fp64": lambda: float(torch.pow(torch._foreach_norm([flat], 2.0, dtype=f64)[0],
                                                                        2.0) ** 0.5),
        "vector_norm of the flat buffer, fp64": lambda: float(torch.linalg.vector_norm(flat, 2.0, dtype=f64)),
    }
    worst = {name: 0.0 for name in totals}
    scales = torch.empty(len(parts), dtype=torch.float64)
    for dist in ("randn", "randn, log-uniform scale per partition"):
        for seed in range(seeds):
            gen = torch.Generator(device=flat.device).manual_seed(seed)
            flat.copy_(torch.randn(flat.shape, generator=gen, device=flat.device, dtype=flat.dtype))
            if dist != "randn":
                scales.uniform_(-4.0, 4.0, generator=torch.Generator().manual_seed(seed))
                for part, s in zip(parts, scales.tolist()):
                    part.mul_(10.0 ** s)
            stock = _total(g.to(f64).norm(2) for g in parts)
            for name, fn in totals.items():
                worst[name] = max(worst[name], abs(fn() - stock) / stock)
    print(f"# total norm against stock's loop, largest relative difference over {2 * seeds} draws")
    for name, w in worst.items():
        print(f"{name:>40}: {w:.3e}")


if __name__ == "__main__":
    main()
