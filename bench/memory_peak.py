"""What is allocated at each system's memory peak, by allocation site (CUDA only).

    python bench/memory_peak.py [--systems stock,z3ext,z3ext-nohold] [gather_release options]
    python bench/memory_peak.py --sim-world 8    # rank 0 of a simulated world of 8 on one GPU

Same model, data and ranks as bench/gather_release.py. After warm-up steps, one training step runs
under torch's allocator history; replaying it gives the peak over the step's starting allocation,
the phase it falls in (forward, backward, optimizer step), and the live bytes at that moment grouped
by the innermost frame of this repository, DeepSpeed or the benchmark's model that allocated them.
Rank 0 writes bench/out/memory-<machine>.txt (untracked).
"""
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather_release as gr  # noqa: E402

_OURS = ("deepspeed_z3ext/", "/deepspeed/", "gather_release.py")


def _site(frames):
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in _OURS):
            short = name.split("site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{f.get('name')}"
    return frames[0].get("name", "?") if frames else "<no python frame>"


def _replay(trace, marks):
    """Peak of live bytes over the trace's start, its phase, and live bytes by site at the peak."""
    live, total, peak, at = {}, 0, 0, 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            total += ev["size"]
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
        if total > peak:
            peak, at = total, i
    # Second pass to the peak: the live set there.
    live, by_site = {}, defaultdict(int)
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    for size, site in live.values():
        by_site[site] += size
    phase = next((name for name, end in marks if at < end), "after")
    return peak, phase, at, sorted(by_site.items(), key=lambda kv: -kv[1])


def _rank_main(argv):
    import torch.distributed as dist
    a = gr.parse(argv)
    gr.init_distributed(a)
    import deepspeed_z3ext
    device = torch.device("cuda", torch.cuda.current_device())
    x = gr.make_input(a, device)
    clock = gr.Clock(device)
    lines = []
    for name in [s for s in a.systems.split(",") if s]:
        s = gr.build_system(name, a, device)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(a.warmup):
            gr.time_train_step(s, x, clock)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        held = s.resident + start - before  # this system's allocation at the step's start ([Note: bench peak])
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        dev = torch.cuda.current_device()

        def events():
            torch.cuda.synchronize()
            return len(torch.cuda.memory._snapshot()["device_traces"][dev])

        z3 = name.startswith("z3ext")

        def z3ext_now():
            if not z3:
                return ""
            st = deepspeed_z3ext.stats(s.model)
            return f"z3ext live {st.live_bytes / 2**20:.0f} MiB, pool {st.pool_cached_bytes / 2**20:.0f} MiB"

        gr.F.linear = s.linear
        loss = s.forward(x)
        n_fwd = events()
        after_fwd = z3ext_now()
        s.backward(loss)
        n_bwd = events()
        s.step()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][dev]
        peak, phase, at, sites = _replay(trace, [("forward", n_fwd), ("backward", n_bwd), ("step", len(trace))])
        lines.append(f"## {name}: peak {(held + peak) / 2**20:.0f} MiB = held at the step's start {held / 2**20:.0f} + "
                     f"{peak / 2**20:.0f} over it (max_memory_allocated says "
                     f"{(torch.cuda.max_memory_allocated() - start) / 2**20:.0f}); in the {phase} (event {at} of "
                     f"{len(trace)}; forward ends at {n_fwd}, backward at {n_bwd}). Live at the peak, by allocation "
                     f"site, of what was allocated during the step:")
        for site, b in sites[:14]:
            lines.append(f"  {b / 2**20:9.0f} MiB  {site}")
        if z3:
            st = deepspeed_z3ext.stats(s.model)
            lines.append(f"  at the end of forward: {after_fwd}; after the step: {z3ext_now()}; pool reused "
                         f"{st.pool_reused}, orphaned {st.pool_orphaned}")
        del s, loss
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        machine = gr.machine_name(dist.get_world_size(), device, a.sim_world)
        sim = f"# {gr.simworld.label(a.sim_world)}\n" if a.sim_world else ""
        text = f"# bench/memory_peak.py on {machine}, args {argv}\n{sim}" + "\n".join(lines) + "\n"
        gr.OUT_DIR.mkdir(parents=True, exist_ok=True)
        out = gr.OUT_DIR / f"memory-{machine}.txt"
        out.write_text(text)
        print(text)
    dist.barrier()
    dist.destroy_process_group()


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench/memory_peak.py needs CUDA (it reads the CUDA allocator's history)")
    argv = sys.argv[1:]
    if not any(v.startswith("--systems") for v in argv):
        argv += ["--systems", "stock,z3ext,z3ext-nohold,z3ext-nopool"]
    a = gr.parse(argv)
    if a.sim_world:  # one process: rank 0 of the simulated world
        return _rank_main(argv)
    gr.spawn(_rank_main, argv, a.world or torch.cuda.device_count())


if __name__ == "__main__":
    main()
