"""The bench's simulated world (bench/simworld): rank 0 of a world of 8 on CPU through collectives that
do nothing. Stock ZeRO-3, z3ext and FSDP2 each train two steps on it, every parameter keeps a 1/8 shard,
z3ext's C++ gathers and reduce-scatters run on the backend, and the collectives leave tensors alone.
Runs in its own process: the process group it creates must not meet the other tests'."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent("""
    import math, sys
    sys.path.insert(0, sys.argv[1])
    import gather_release as gr
    import torch
    a = gr.parse(["--smoke", "--sim-world", "8", "--model", "linear", "--layers", "4", "--hidden", "64",
                  "--systems", "stock,z3ext,fsdp2"])
    gr.init_distributed(a)
    import torch.distributed as dist
    import deepspeed_z3ext
    assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (8, 0, "simworld")

    # Collectives check sizes and touch nothing.
    shard, full = torch.full((4,), 1.0), torch.full((32,), 7.0)
    dist.all_gather_into_tensor(full, shard)
    dist.reduce_scatter_tensor(shard, full)
    dist.all_reduce(shard)
    assert bool((full == 7).all()) and bool((shard == 1).all())
    try:
        dist.all_gather_into_tensor(torch.empty(31), shard)
        raise AssertionError("a wrongly sized all-gather passed")
    except RuntimeError as e:
        assert "not world (8)" in str(e), e

    device, clock = torch.device("cpu"), gr.Clock(torch.device("cpu"))
    x = gr.make_input(a, device)
    for name in ("stock", "z3ext", "fsdp2"):
        s = gr.build_system(name, a, device)
        for _ in range(2):
            gr.time_train_step(s, x, clock)
        for p in s.model.parameters():
            if name == "fsdp2":  # DTensor sharded on dim 0: rank 0 holds the first ceil(rows / 8) rows
                rows = p.shape[0]
                assert p.to_local().numel() == math.ceil(rows / 8) * p.numel() // rows, (name, p.shape)
            else:
                assert p.ds_tensor.ds_numel == math.ceil(p.ds_numel / 8), (name, p.ds_shape, p.ds_tensor.ds_numel)
        if name == "z3ext":
            assert deepspeed_z3ext.stats(s.model).collectives > 0
            assert deepspeed_z3ext.grad_stats(s.model).flushes > 0  # its C++ reduce-scatter ran
        print(name, "ok", gr.params_per_rank(s))
""")


def _child(code, timeout):
    """`code` run in a process of its own (bench/ on its path), its stdout once it succeeded."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench")], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def test_simulated_world_of_8_shards_and_trains():
    r = _child(CHILD, 900)
    assert [l.split()[:2] for l in r.stdout.splitlines() if " ok " in l] == [["stock", "ok"], ["z3ext", "ok"],
                                                                             ["fsdp2", "ok"]]


MOE_CHILD = textwrap.dedent("""
    import collections, sys
    sys.path.insert(0, sys.argv[1])
    import gather_release as gr
    import torch
    a = gr.parse(["--model", "moe", "--sim-world", "8", "--layers", "2", "--hidden", "64", "--experts", "32",
                  "--topk", "2", "--seq", "64", "--micro-batch", "2", "--systems", "unsharded,z3ext"])
    gr.init_distributed(a)
    import deepspeed_z3ext
    x = gr.make_input(a, torch.device("cpu"))
    for name in ("unsharded", "z3ext"):
        s = gr.build_system(name, a, torch.device("cpu"))
        calls = collections.Counter()
        experts = [m for m in s.model.modules() if type(m).__name__ == "Expert"]
        for k, e in enumerate(experts):
            e.register_forward_pre_hook(lambda m, i, k=k: calls.update([k]))
        s.forward(x)
        print(name, "experts", len(experts), "calls", sum(calls.values()), "distinct", len(calls))
""")


def test_bench_moe_runs_the_same_experts_on_every_system():
    # [Note: bench routing] in bench/gather_release.py: a simulated world's gathered weights are wrong, so
    # routing must not follow them, or the sharded systems run less work than the unsharded model.
    r = _child(MOE_CHILD, 600)
    rows = [l.split() for l in r.stdout.splitlines() if " experts " in l]
    # 128 tokens x top 2 over 32 experts: every expert of both blocks runs, on both systems
    assert rows == [["unsharded", "experts", "64", "calls", "64", "distinct", "64"],
                    ["z3ext", "experts", "64", "calls", "64", "distinct", "64"]], r.stdout[-2000:]
