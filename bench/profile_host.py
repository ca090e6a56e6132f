"""Where the host time goes: cProfile of the tiny no_grad forward and of a training step, per system.

    python bench/profile_host.py [--systems z3ext,unsharded] [gather_release options]
    python bench/profile_host.py --sim-world 8    # rank 0 of a simulated world of 8 on one device

Same model, data and ranks as bench/gather_release.py (its options apply). Rank 0 writes the top
functions by own time to bench/out/profile-<machine>.txt (untracked). cProfile inflates Python time; read
the ranking, not the absolute numbers (those come from gather_release.py).
"""
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather_release as gr  # noqa: E402


def _profile(fn, n):
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    return prof, (time.perf_counter() - t0) / n * 1e3


def _report(title, prof, ms, top):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    body = "\n".join(l for l in out.getvalue().splitlines() if l.strip())
    return f"## {title}: {ms:.2f} ms per call under cProfile\n{body}\n"


class _Timed:
    """Accumulates host nanoseconds per named call (wraps an object's methods)."""

    def __init__(self, totals):
        self.totals = totals

    def wrap(self, obj, name, label):
        fn, totals = getattr(obj, name), self.totals

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0) + time.perf_counter_ns() - t0

        return timed


class _EngineProxy:
    """The C++ GatherEngine with unshard/reshard timed (it is a pybind object: wrap, don't patch)."""

    def __init__(self, engine, timed):
        self._engine = engine
        self.unshard = timed.wrap(engine, "unshard", "C++ unshard")
        self.reshard = timed.wrap(engine, "reshard", "C++ reshard")
        self.unshard_batch = timed.wrap(engine, "unshard_batch", "C++ unshard_batch (prefetch)")

    def __getattr__(self, name):
        return getattr(self._engine, name)


def phases(s, tiny, clock, n):
    """Host time per phase of the tiny forward, without cProfile: wall (synchronized), host enqueue
    (the forward returns before the device finishes), and the time inside z3ext's coordinator calls."""
    from deepspeed_z3ext.stats import state_of
    st = state_of(s.model)
    totals = {}
    timed = _Timed(totals)
    coord, engine = st.coordinator, st.engine
    saved = dict(fetch=coord.fetch_sub_module, release=coord.release_sub_module, prefetch=coord._prefetch)
    coord.fetch_sub_module = timed.wrap(coord, "fetch_sub_module", "fetch_sub_module (incl. prefetch)")
    coord.release_sub_module = timed.wrap(coord, "release_sub_module", "release_sub_module")
    coord._prefetch = timed.wrap(coord, "_prefetch", "  of which _prefetch")
    st.engine = _EngineProxy(engine, timed)
    host, wall = [], []
    try:
        for _ in range(n):
            with torch.no_grad():
                clock.now()
                t0 = time.perf_counter()
                s.forward(tiny)
                t1 = time.perf_counter()
                clock.now()
                t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
    finally:
        st.engine = engine
        coord.fetch_sub_module, coord.release_sub_module, coord._prefetch = saved["fetch"], saved["release"], saved["prefetch"]
    lines = [f"## z3ext tiny no_grad forward, host phases (median of {n}, no cProfile)",
             f"  wall (synchronized)        {sorted(wall)[n // 2]:8.2f} ms",
             f"  host until forward returns {sorted(host)[n // 2]:8.2f} ms"]
    for k, v in totals.items():
        lines.append(f"  {k:<34} {v / n / 1e6:8.2f} ms per forward")
    return "\n".join(lines) + "\n"


def ops_table(s, tiny, clock, n, top):
    """torch.profiler over n tiny forwards: host (self CPU) time per ATen op / CUDA runtime call."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            gr.time_tiny_forward(s, tiny, clock)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
    return f"## {s.name} tiny no_grad forward, torch.profiler ({n} forwards), by self CPU time\n{table}\n"


def run(a):
    import deepspeed  # noqa: F401
    import torch.distributed as dist
    import deepspeed_z3ext  # noqa: F401
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    clock = gr.Clock(device)
    x, tiny = gr.make_input(a, device), gr.make_input(a, device, tiny=True)
    sections = []
    for name in [s for s in a.systems.split(",") if s]:
        s = gr.build_system(name, a, device)
        for _ in range(a.warmup + 1):
            gr.time_train_step(s, x, clock)
            gr.time_tiny_forward(s, tiny, clock)
        if name.startswith("z3ext"):
            sections.append(phases(s, tiny, clock, max(a.steps, 5)))
            sections.append(ops_table(s, tiny, clock, max(a.steps, 5), a.top))
        prof, ms = _profile(lambda: gr.time_tiny_forward(s, tiny, clock), a.steps)
        sections.append(_report(f"{name} tiny no_grad forward", prof, ms, a.top))
        prof, ms = _profile(lambda: gr.time_train_step(s, x, clock), a.steps)
        sections.append(_report(f"{name} training step", prof, ms, a.top))
        del s
    return sections


def _entry(a):
    import torch.distributed as dist
    gr.init_distributed(a)
    sections = run(a)
    if dist.get_rank() == 0:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        machine = gr.machine_name(dist.get_world_size(), device, a.sim_world)
        gr.OUT_DIR.mkdir(parents=True, exist_ok=True)
        out = gr.OUT_DIR / f"profile-{machine}.txt"
        sim = f"# {gr.simworld.label(a.sim_world)}\n" if a.sim_world else ""
        text = f"# bench/profile_host.py on {machine}, args {sys.argv[1:]}\n{sim}" + "\n".join(sections)
        out.write_text(text)
        print(text)
        print(f"# wrote {out}")
    dist.barrier()
    dist.destroy_process_group()


def _rank_main(argv):
    _entry(parse(argv))


def parse(argv):
    argv = list(argv)
    top = 30
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i:i + 2]
    if "--systems" not in argv:
        argv += ["--systems", "z3ext,unsharded"]
    a = gr.parse(argv)
    a.top = top
    return a


def main():
    a = parse(sys.argv[1:])
    if "RANK" in os.environ or a.sim_world:  # under torchrun, or one process: rank 0 of the simulated world
        return _entry(a)
    world = a.world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    gr.spawn(_rank_main, sys.argv[1:], world)


if __name__ == "__main__":
    main()
