"""Where the optimizer step's time goes, phase by phase, for DeepSpeed's stage-3 step under each system.

    python bench/step_breakdown.py [--systems stock,z3ext-dsgrads,z3ext] [--gradient-clipping 0] [gather_release options]
    python bench/step_breakdown.py --sim-world 8    # rank 0 of a simulated world of 8 on one device

Same model, data and ranks as bench/gather_release.py. Each phase of `DeepSpeedZeroOptimizer_Stage3.step`
is wrapped on the optimizer instance with a device synchronisation before and after (so phases do
not overlap; the sum is a little above an unwrapped step). `z3ext-dsgrads` is z3ext with DeepSpeed's
gradient path and step (z3ext.reduce_gradients false): the before of the gradient path's changes,
side by side. FSDP2 and unsharded report their whole `optimizer.step` + `zero_grad` as one phase.
Rank 0 prints ms per step (median) and peak MiB allocated during the step.
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gather_release as gr  # noqa: E402

PHASES = ("_pre_step", "_partition_all_parameters", "_overflow_check_and_loss_scale_update", "_get_norm_groups",
          "_loss_scale_update_and_overflow_cleanup", "zero_grad", "_prepare_sub_group", "unscale_and_clip_grads",
          "_optimizer_step", "_reassign_or_swap_out_partitioned_parameters", "_release_sub_group", "_post_step")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _wrap_phases(optimizer, current, device):
    """Each phase adds its ms into `current["ms"]` (a fresh dict per step)."""
    for name in PHASES:
        fn = getattr(optimizer, name, None)
        if fn is None:
            continue

        def timed(*args, _fn=fn, _name=name, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _sync(device)
                ms = current["ms"]
                ms[_name] = ms.get(_name, 0.0) + (time.perf_counter() - t0) * 1e3

        setattr(optimizer, name, timed)  # instance attribute: shadows the class's (and z3ext's seam) method


def run(a):
    import torch.distributed as dist
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    x = gr.make_input(a, device)
    clock = gr.Clock(device)
    rows, peaks, notes = {}, {}, {}
    for name in [s for s in a.systems.split(",") if s]:
        s = gr.build_system(name, a, device)
        opt = getattr(s.model, "optimizer", None)
        per_step, current = [], {"ms": {}}
        for i in range(a.warmup + a.steps):
            if i == a.warmup and opt is not None:
                _wrap_phases(opt, current, device)
            current["ms"] = {}
            torch.nn.functional.linear = s.linear
            loss = s.forward(x)
            s.backward(loss)
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = clock.now()
            s.step()
            total = (clock.now() - t0) * 1e3
            if i >= a.warmup:
                phases = current["ms"] if opt is not None else {"optimizer.step + zero_grad": total}
                per_step.append(dict(phases, step=total))
                if device.type == "cuda":
                    peaks.setdefault(name, []).append((torch.cuda.max_memory_allocated() - base) / 2**20)
        rows[name] = {k: statistics.median(d.get(k, 0.0) for d in per_step) for k in set().union(*per_step)}
        if name.startswith("z3ext"):
            import deepspeed_z3ext
            from deepspeed_z3ext.state import of_optimizer
            reducer = of_optimizer(opt).grad_reducer
            notes[name] = (f"{deepspeed_z3ext.grad_stats(s.model)}; last copy: {reducer.step_copy_reason}" if reducer
                           else "DeepSpeed's gradient path")
        del s
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows, peaks, notes, dist.get_rank()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = gr.parse(argv)
    if a.sim_world:  # one process: rank 0 of the simulated world
        return _rank_main(argv)
    gr.spawn(_rank_main, argv, a.world or (torch.cuda.device_count() or 2))


def _rank_main(argv):
    import torch.distributed as dist
    a = gr.parse(argv)
    if a.systems == ",".join(gr.SYSTEMS):
        a.systems = "stock,z3ext-dsgrads,z3ext"
    gr.init_distributed(a)
    rows, peaks, notes, rank = run(a)
    if rank == 0:
        names = list(rows)
        keys = [k for k in PHASES + ("optimizer.step + zero_grad", "step") if any(k in r for r in rows.values())]
        if a.sim_world:
            print(f"# {gr.simworld.label(a.sim_world)}")
        print(f"# optimizer step phases, ms per step (median of {a.steps}), world {dist.get_world_size()}, "
              f"model {a.model} layers {a.layers} hidden {a.hidden}, dtype {a.dtype}")
        print(f"{'phase':>45} " + " ".join(f"{n:>14}" for n in names))
        for k in keys:
            print(f"{k:>45} " + " ".join(f"{rows[n].get(k, 0.0):14.2f}" for n in names))
        if peaks:
            print(f"{'peak MiB allocated during step (over before)':>45} " +
                  " ".join(f"{statistics.median(peaks[n]):14.0f}" if n in peaks else f"{'-':>14}" for n in names))
        for n, note in notes.items():
            print(f"# {n}: {note}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
