"""Out of memory inside a step leaves a usable engine ([Note: gather rollback] in csrc/engine.h,
[Note: failed pass] in grads.py, [Note: out of memory] in csrc/oom.h), on 2 real gloo ranks.

The fault is real to everything above the allocator: tests/faults installs a CPU allocator that throws
c10::OutOfMemoryError (what the CUDA caching allocator throws) for one chosen allocation, by its exact
size, and passes every other one through. Each case trains a step, runs a micro-batch whose chosen
allocation fails, checks that torch.OutOfMemoryError came out of the expected phase, and trains on with
a smaller batch; its losses and final parameters must be `torch.equal` to stock ZeRO-3's on the same
micro-batches without the one that failed (the engine after the fault trains as a fresh one would),
with nothing left gathered or claimed and the failed pass's gradients gone. The cases:
- gather: the forward gather (or the prefetch) of one layer's weight;
- refill: with the hold off, the re-fill of that weight's released storage in backward;
- flush: the layout buffer of the epilogue's reduce-scatter;
- autograd: autograd's own gradient of that weight (an op z3ext did not write), at the window's first
  micro-step and, with gradient accumulation 2, at its second.
"""
import pytest

from tests.harness import run_on_ranks

B, SMALL = 8, 4  # the batch that fails, and the smaller one that follows


def _net():
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(16, 37)
            self.odd = nn.Linear(37, 29)  # 1073 weight elements: its gathered storage (1074) and its
            self.l3 = nn.Linear(29, 16)   # gradient (1073) have sizes no other tensor here has

        def forward(self, x):
            return self.l3(self.odd(self.l1(x).tanh()).tanh()).square().mean()

    return Net


CASES = {  # name: (z3ext options, ga, what fails, index of the failing micro-batch, phase it fails in,
    #         passes abandoned: 1 where the pass had noted gradients before it raised)
    "gather": ({}, 1, "gathered", 1, "forward", 0),
    "refill": ({"hold_for_backward": False}, 1, "gathered", 1, "backward", 0),  # before l3's gradients
    "flush": ({}, 1, "layout", 1, "backward", 1),
    "autograd": ({}, 1, "grad", 1, "backward", 1),  # after l3's gradients were noted
    "autograd-ga2": ({}, 2, "grad", 3, "backward", 1),
}


def faults_next_to_stock(cases):
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.faults import allocator
    from tests.models import build_engine, ds_config, full_params
    fa = allocator()
    fa.install()  # before any engine: the storages z3ext makes then allocate through it too
    rank, world = dist.get_rank(), dist.get_world_size()

    def micro_batches(ga, fail_at):
        # (data seed, batch size, fails): full batches up to the failing one, smaller ones after it.
        return [(i, B if i <= fail_at else SMALL, i == fail_at) for i in range(3 * ga + 1)]

    def run(engine, batches, arm=None):
        losses, raised = [], None
        for seed, bsz, fails in batches:
            if fails and arm is None:
                continue  # stock: the failed micro-batch never happened
            x = torch.randn(bsz, 16, generator=torch.Generator().manual_seed(100 * seed + rank))
            if fails and arm.phase == "forward":
                arm()
            phase, loss = "forward", None
            try:
                loss = engine(x)
                phase = "backward"
                if fails and arm.phase == "backward":
                    arm()
                engine.backward(loss)
            except torch.OutOfMemoryError as e:
                fa.disarm()
                raised = (phase, str(e).splitlines()[0])
                loss = None  # what a retry loop drops before its next batch
                continue
            fa.disarm()
            engine.step()
            losses.append(loss.item())
        return losses, raised

    out = {}
    stock_ref = {}
    for name in cases:
        options, ga, what, fail_at, phase, abandoned = CASES[name]
        batches = micro_batches(ga, fail_at)
        if ga not in stock_ref:
            stock = build_engine(ds_config(persistence=0, mel=False, ga=ga), model_fn=_net())
            stock_ref[ga] = (run(stock, batches)[0], full_params(stock))
            stock.destroy()
        ref_losses, ref_params = stock_ref[ga]
        eng = build_engine(ds_config(z3ext={"enabled": True, **options}, persistence=0, mel=False, ga=ga),
                           model_fn=_net())
        odd = eng.module.odd.weight
        gathered = odd.ds_tensor.ds_numel * world * 4
        layout = 4 * world * sum(p.ds_tensor.ds_numel for p in eng.module.parameters())

        def arm():  # armed before the phase it is to fail in (gloo's coalesced gather has a flat buffer
            fa.arm({"gathered": gathered, "layout": layout, "grad": odd.ds_numel * 4}[what], 0)  # of `layout` bytes)

        arm.phase = phase

        fired = fa.fired()
        losses, raised = run(eng, batches, arm)
        params = full_params(eng)
        state = eng.optimizer.parameter_offload.z3ext
        g = deepspeed_z3ext.grad_stats(eng)
        out[name] = dict(
            fired=fa.fired() - fired, raised=raised, expected_phase=phase, expected_abandoned=abandoned, losses=losses, ref_losses=ref_losses,
            mismatched=[n for n in ref_params if not torch.equal(ref_params[n], params[n])],
            live_bytes=deepspeed_z3ext.stats(eng).live_bytes,
            claimed=[h.name for h in state.engine.handles if h.claims],
            abandoned=g.abandoned_passes, bucket=g.bucket_elements,
            grads=[n for n, p in eng.module.named_parameters() if p.grad is not None])
        eng.destroy()
    return out


@pytest.mark.parametrize("cases", [["gather", "refill", "flush"], ["autograd", "autograd-ga2"]],
                         ids=["z3ext-ops", "autograd"])
def test_out_of_memory_leaves_an_engine_that_trains_as_a_fresh_one(cases):
    from tests.faults import allocator
    allocator()  # built once here, not by both ranks at once
    results = run_on_ranks(faults_next_to_stock, timeout=600, cases=cases)
    for rank, res in enumerate(results):
        for name, r in res.items():
            where = f"rank {rank} {name}"
            assert r["fired"] == 1, f"{where}: the injected fault fired {r['fired']} times"
            assert r["raised"] is not None, f"{where}: no torch.OutOfMemoryError came out"
            assert r["raised"][0] == r["expected_phase"], f"{where}: raised in {r['raised']}, expected {r['expected_phase']}"
            assert "injected" in r["raised"][1], (where, r["raised"])
            assert r["losses"] == r["ref_losses"], f"{where}: losses differ:\n{r['losses']}\n{r['ref_losses']}"
            assert not r["mismatched"], f"{where}: parameters differ from stock's: {r['mismatched']}"
            assert r["live_bytes"] == 0, f"{where}: {r['live_bytes']} bytes left gathered"
            assert not r["claimed"], f"{where}: claims left on {r['claimed']}"
            assert r["bucket"] == 0 and not r["grads"], (where, r["bucket"], r["grads"])
            assert r["abandoned"] == r["expected_abandoned"], f"{where}: {r['abandoned']} passes abandoned"


def one_rank_fault(retry):
    """The gather's out of memory on rank 1 only, in the second micro-batch. `retry`: rank 1 catches it and
    goes on with the next batch (a retry loop); else it lets the error end its training. Returns each
    rank's end: the error that ended it (None: trained to the end) and the seconds it took."""
    import time
    import torch
    import torch.distributed as dist
    from tests.faults import allocator
    from tests.models import build_engine, ds_config
    fa = allocator()
    fa.install()
    rank, world = dist.get_rank(), dist.get_world_size()
    eng = build_engine(ds_config(z3ext={"enabled": True}, persistence=0, mel=False, ga=1), model_fn=_net())
    gathered = eng.module.odd.weight.ds_tensor.ds_numel * world * 4
    t0, ooms, error = time.monotonic(), [], None
    try:
        for i in range(6):
            x = torch.randn(B, 16, generator=torch.Generator().manual_seed(100 * i + rank))
            if i == 1 and rank == 1:
                fa.arm(gathered, 0)
            try:
                eng.backward(eng(x))
                eng.step()
            except torch.OutOfMemoryError:
                ooms.append(i)
                if not retry:
                    raise
            finally:
                fa.disarm()
    except BaseException as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
    st = eng.optimizer.parameter_offload.z3ext.engine.stats()
    return dict(error=error, ooms=ooms, seconds=time.monotonic() - t0, collectives=st["collectives"],
                steps=eng.global_steps)


PG_TIMEOUT = 30


@pytest.mark.parametrize("retry", [False, True], ids=["raise", "retry"])
def test_a_fault_on_one_rank_ends_in_an_error_on_every_rank(retry):
    """[Note: one-rank faults]: an out of memory in a gather on one rank leaves the others waiting in a
    collective that rank never issues. Every rank must end in an error within the collective timeout: the
    faulting rank at once (its error), the others when its process group breaks (it stopped) or when the
    schedules part (a gloo size mismatch, the schedule check at the step, or the timeout)."""
    from tests.faults import allocator
    allocator()
    results = run_on_ranks(one_rank_fault, timeout=4 * PG_TIMEOUT + 120, pg_timeout=PG_TIMEOUT, retry=retry)
    for rank, r in enumerate(results):
        print(f"rank {rank} ({'retry' if retry else 'raise'}): {r}")
    assert results[1]["ooms"] == [1] and results[0]["ooms"] == [], results
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} trained on after rank 1's fault: {r}"
        assert r["seconds"] < 2 * PG_TIMEOUT + 30, f"rank {rank} ended after {r['seconds']:.0f} s: {r}"
    if not retry:
        assert results[1]["error"].startswith("OutOfMemoryError"), results[1]


@pytest.mark.gpus(1)
def test_out_of_memory_on_cuda():
    """The CUDA caching allocator itself out of memory (tests/scripts/cuda_oom.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, str(root / "tests" / "scripts" / "cuda_oom.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "cuda out-of-memory: ok" in r.stdout
