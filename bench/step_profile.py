"""Where a training step's phases spend their time: device busy, host calls that block, per system.

    python bench/step_profile.py --sim-world 64 --layers 32 --hidden 1024 --heads 16 --seq 1024 --micro-batch 4 \
        --systems unsharded,z3ext

Same model, data and ranks as bench/gather_release.py (its options apply). For each system, after
warm-up, each phase (forward, backward, optimizer step) of `--steps` training steps is run under
torch.profiler on its own, and the report gives per phase and step: wall time (synchronized), the
device's kernel and copy time, the host time of CUDA runtime calls that can block the host
(synchronizations, device allocations and frees), and the ATen ops with the most host time.
[Note: step profile] A host-bound phase shows wall well above device time with few blocking calls;
a phase that synchronizes shows the host waiting in those calls, so host and device time add instead of
overlapping; allocator calls in a steady step mean a segment is made and freed every step. The
profiler inflates host time: compare systems and worlds within one report, not with gather_release's
numbers.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather_release as gr  # noqa: E402

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMalloc", "cudaFree",
            "cudaMallocAsync", "cudaFreeAsync", "cudaMemcpy", "cudaMemGetInfo", "cudaHostAlloc", "cudaFreeHost")


def _profile(fn):
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof, out


def _summary(prof):
    """(device us, {blocking call: (count, host us)}, [(op, host us)], {runtime call: count})"""
    device_us, blocking, ops, runtime = 0.0, {}, {}, {}
    for e in prof.key_averages():
        name = e.key
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        device_us += dev
        if name in BLOCKING:
            blocking[name] = (e.count, e.self_cpu_time_total)
        elif name.startswith("cu") and e.self_cpu_time_total > 0:  # CUDA runtime and driver calls
            runtime[name] = e.count
        elif dev == 0:
            ops[name] = ops.get(name, 0.0) + e.self_cpu_time_total
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
    return device_us, blocking, top, runtime


def _python_profile(s, x, steps, top):
    """cProfile of `steps` backward passes: the Python functions with the most own time."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    for _ in range(steps):
        loss = s.forward(x)
        prof.enable()
        s.backward(loss)
        prof.disable()
        s.step()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    out = []
    for (file, line, fn), (cc, nc, tt, ct, _) in rows:
        out.append(f"      {tt / steps * 1e3:6.2f} own {ct / steps * 1e3:6.2f} cum ms {nc / steps:6.0f}x "
                   f"{Path(file).name}:{line}({fn})")
    return out


def run(a):
    import deepspeed  # noqa: F401
    import deepspeed_z3ext  # noqa: F401
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    clock = gr.Clock(device)
    x = gr.make_input(a, device)
    lines = []
    for name in [s for s in a.systems.split(",") if s]:
        s = gr.build_system(name, a, device)
        for _ in range(a.warmup + 1):
            gr.time_train_step(s, x, clock)
        gr.F.linear = s.linear
        acc = {ph: dict(wall=0.0, device=0.0, blocking={}, ops={}, runtime={}) for ph in ("fwd", "bwd", "opt")}
        for _ in range(a.steps):
            for ph in ("fwd", "bwd", "opt"):
                t0 = clock.now()
                if ph == "fwd":
                    prof, loss = _profile(lambda: s.forward(x))
                elif ph == "bwd":
                    prof, _ = _profile(lambda: s.backward(loss))
                else:
                    prof, _ = _profile(s.step)
                wall = (clock.now() - t0) * 1e6
                dev, blocking, top, runtime = _summary(prof)
                r = acc[ph]
                r["wall"] += wall
                r["device"] += dev
                for k, (c, us) in blocking.items():
                    c0, us0 = r["blocking"].get(k, (0, 0.0))
                    r["blocking"][k] = (c0 + c, us0 + us)
                for k, us in top:
                    r["ops"][k] = r["ops"].get(k, 0.0) + us
                for k, c in runtime.items():
                    r["runtime"][k] = r["runtime"].get(k, 0) + c
        n = a.steps
        lines.append(f"## {name}: per step, mean of {n} (profiled: host times inflated)")
        for ph, r in acc.items():
            block = ", ".join(f"{k} {c / n:.1f}x {us / n / 1e3:.2f} ms" for k, (c, us) in sorted(r["blocking"].items()))
            lines.append(f"  {ph}: wall {r['wall'] / n / 1e3:8.2f} ms  device {r['device'] / n / 1e3:8.2f} ms  "
                         f"blocking calls: {block or 'none'}")
            top = sorted(r["ops"].items(), key=lambda kv: -kv[1])[:6]
            lines.append("      host: " + ", ".join(f"{k[:60]} {us / n / 1e3:.2f}" for k, us in top))
            calls = sorted(r["runtime"].items(), key=lambda kv: -kv[1])[:6]
            lines.append("      runtime calls: " + ", ".join(f"{k} {c / n:.0f}" for k, c in calls))
        if a.python_top:
            lines.append(f"    backward under cProfile, per pass (top {a.python_top} by own time):")
            lines += _python_profile(s, x, n, a.python_top)
        del s
        gr.F.linear = gr.TORCH_LINEAR
    return lines


def main():
    argv = sys.argv[1:]
    python_top = 0
    if "--python-top" in argv:  # also a cProfile of the backward: its N Python functions with the most own time
        i = argv.index("--python-top")
        python_top = int(argv[i + 1])
        del argv[i:i + 2]
    a = gr.parse(argv)
    a.python_top = python_top
    gr.init_distributed(a)
    import torch.distributed as dist
    lines = run(a)
    if dist.get_rank() == 0:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        machine = gr.machine_name(dist.get_world_size(), device, a.sim_world)
        sim = f"# {gr.simworld.label(a.sim_world)}\n" if a.sim_world else ""
        print(f"# bench/step_profile.py on {machine}, args {sys.argv[1:]}\n{sim}" + "\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
