"""Issue 4: external parameters discovered independently of residency, in forward and during
activation-checkpoint recomputation; LoRA-style resume (save_checkpoint -> new engine ->
load_checkpoint) equals plain PyTorch; the plan resynchronises on divergence; live gathered memory
stays within a written-out budget.

Reference: tests/lora.py::reference, plain PyTorch fp32 without checkpointing. Tolerance: rtol 1e-5,
atol 1e-6 (DeepSpeed averages gradients over ranks with a reduce-scatter, so the summation order
differs from the reference by a few ulps; nothing else may differ).

`python -m tests.test_trace stock` runs the same regression on stock DeepSpeed (no z3ext) and prints
the outcome of each case (not part of the suite: stock fails some of them).
"""
import os
import sys

import pytest

from tests.harness import run_on_ranks

GA, STEPS_BEFORE, STEPS_AFTER = 4, 2, 2
RTOL, ATOL = 1e-5, 1e-6
# Elements: the adapter (lora_A 4x16, lora_B 16x4 = 64 each) is persistent below 100, the base
# Linear (16x16) is not; 0 makes everything non-persistent.
PERSISTENCE = {"persistent": 100, "non-persistent": 0}
BUCKETS = {"bucket 0": 0, "bucket default": None}
# "dtype": the adapter only reads lora_A.weight.dtype outside lora_A; "numeric": it also computes with
# lora_A.weight and base.weight outside their modules.
ACCESS = ("dtype", "numeric")


def _close(a, b):
    import torch
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def lora_resume(ckpt, access, persistence, bucket, ckpt_dir, z3ext=True):
    """Trains STEPS_BEFORE optimizer steps, saves, builds a new engine, loads, trains STEPS_AFTER
    more; returns a list of mismatches (empty: every micro-step loss and both post-load updates match
    the reference)."""
    import deepspeed
    import torch
    import torch.distributed as dist
    if z3ext:
        import deepspeed_z3ext  # noqa: F401
    from tests import training
    from tests.lora import LoraNet, data, ds_config, reference, trainable
    from tests.models import full_params

    rank, world = dist.get_rank(), dist.get_world_size()
    total = STEPS_BEFORE + STEPS_AFTER
    ref_losses, ref_states = reference(seed=11, world=world, ga=GA, steps=total, access=access)
    cfg = ds_config(persistence, bucket, GA, z3ext=z3ext)
    problems = []

    def build(seed):
        torch.manual_seed(seed)
        model = LoraNet(ckpt=ckpt, access=access)  # partitioned by deepspeed.initialize (the adapter's init needs full tensors)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable(model), config=cfg)
        # The adapters start resident, as after `param.all_gather()` (or a re-gather by a checkpoint
        # load): their first external access must still be discovered.
        for layer in engine.module.layers:
            for p in (layer.lora_A.weight, layer.lora_B.weight, layer.base.weight):
                p.all_gather()
        return engine

    def train(engine, first_step, n_steps):
        losses = []  # this call's, micro-step first_step * GA onwards

        def forward(engine, micro):
            if micro == first_step * GA:
                # The engine's first forward runs with the adapters resident (a GatheredParameters
                # block around it, e.g. to log them); its backward, and the checkpoint
                # recomputation in it, run after the block: the external uses recorded while
                # resident must be gathered then.
                adapters = [p for layer in engine.module.layers
                            for p in (layer.lora_A.weight, layer.lora_B.weight, layer.base.weight)]
                with deepspeed.zero.GatheredParameters(adapters):
                    return engine(*data(micro, rank))
            return engine(*data(micro, rank))

        def check(engine, step):
            for micro in range(step * GA, (step + 1) * GA):
                loss = losses[micro - first_step * GA]
                if not _close(torch.tensor(loss), torch.tensor(ref_losses[micro][rank])):
                    problems.append(f"micro-step {micro}: loss {loss!r} != reference {ref_losses[micro][rank]!r}")
            full = full_params(engine)
            for name, want in ref_states[step].items():
                if not _close(full[name], want):
                    err = (full[name] - want).abs().max().item()
                    problems.append(f"after step {step}: {name} differs from the reference by {err:.3g}")

        training.train(engine, n_steps, ga=GA, first_step=first_step, forward=forward, after_step=check,
                       losses=losses)

    engine = build(seed=11)
    train(engine, 0, STEPS_BEFORE)
    engine.save_checkpoint(ckpt_dir, tag="resume")
    engine.destroy()
    engine = build(seed=12345)  # different initial values: only the checkpoint can make them right
    engine.load_checkpoint(ckpt_dir, tag="resume")
    train(engine, STEPS_BEFORE, STEPS_AFTER)
    if z3ext:
        st = deepspeed_z3ext.stats(engine)
        leftover = [n for n in st.gathered if not any(k == "persist" for k, _ in st.claims.get(n, []))]
        if leftover:
            problems.append(f"gathered after the last step without a persist claim: {leftover}")
    engine.destroy()
    return problems


def _lora_cases(ckpt, persistence, ckpt_dir, z3ext=True):
    out = {}
    for access in ACCESS:
        for bname, bucket in BUCKETS.items():
            case = f"{access} access, {bname}"
            d = os.path.join(ckpt_dir, case.replace(" ", "_").replace(",", ""))
            try:
                out[case] = lora_resume(ckpt, access, persistence, bucket, d, z3ext=z3ext)
            except Exception as e:  # reported per case (stock raises here)
                out[case] = [f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    return out


@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("adapter", list(PERSISTENCE))
def test_lora_resume_matches_pytorch(ckpt, adapter, tmp_path):
    results = run_on_ranks(_lora_cases, ckpt=ckpt, persistence=PERSISTENCE[adapter], ckpt_dir=str(tmp_path),
                           timeout=600)
    failed = {f"rank {r} {case}": p for r, res in enumerate(results) for case, p in res.items() if p}
    assert not failed, failed


if __name__ == "__main__":
    system = sys.argv[1] if len(sys.argv) > 1 else "z3ext"
    import tempfile
    for ckpt in ("reentrant", "non-reentrant"):
        for adapter, thr in PERSISTENCE.items():
            with tempfile.TemporaryDirectory() as d:
                res = run_on_ranks(_lora_cases, ckpt=ckpt, persistence=thr, ckpt_dir=d, z3ext=system == "z3ext",
                                   timeout=600)
            for case, p in res[0].items():
                print(f"{system:6} {ckpt:14} {adapter:15} {case:30} " + ("OK" if not p else p[0]), flush=True)


# ------------------------------------------------------------------------------- memory budget
MAX_LIVE, BUCKET = 10_000, 5_000  # elements: stage3_max_live_parameters, stage3_prefetch_bucket_size


def bounded_live_memory():
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import TinyGPT, batch, build_engine, ds_config
    from tests.training import train

    cfg = ds_config(z3ext=True, persistence=0, ga=2, zero_extra={"stage3_max_live_parameters": MAX_LIVE,
                                                                 "stage3_prefetch_bucket_size": BUCKET})
    eng = build_engine(cfg, model_fn=lambda: TinyGPT(layers=4))
    world, rank = dist.get_world_size(), dist.get_rank()
    units = [sum(p.ds_numel for p in m.parameters(recurse=False)) for m in eng.module.modules()]
    n_params = sum(1 for _ in eng.module.parameters())
    # [budget] The coordinator holds a unit for backward, or gathers ahead, only while the elements
    # of all gathered buffers stay within stage3_max_live_parameters; on top of that only the units
    # of running modules: the root's own (`pos`) and one leaf (at most the largest unit); plus one
    # padding element per parameter and rank.
    root_unit = sum(p.ds_numel for p in eng.module.parameters(recurse=False))
    budget_bytes = 4 * (MAX_LIVE + root_unit + max(units) + n_params * world)
    model_bytes = 4 * sum(p.ds_numel for p in eng.module.parameters())
    per_forward = []

    def counted_forward(eng, i):  # the collectives each forward issues
        before = deepspeed_z3ext.stats(eng).collectives
        loss = eng(batch(i, rank))
        per_forward.append(deepspeed_z3ext.stats(eng).collectives - before)
        return loss

    train(eng, 4, ga=2, forward=counted_forward)
    st = deepspeed_z3ext.stats(eng)
    return dict(peak=st.peak_live_bytes, budget=budget_bytes, model=model_bytes, per_forward=per_forward,
                n_units=sum(1 for u in units if u))


def test_live_gathered_memory_stays_within_budget():
    for r in run_on_ranks(bounded_live_memory):
        assert r["model"] > 2 * r["budget"], r  # the model does not fit in the budget
        assert 0 < r["peak"] <= r["budget"], r
        # Replayed forwards prefetch along the plan: fewer collectives than units.
        assert r["per_forward"][-1] < r["n_units"], r


# -------------------------------------------------------------------- divergence never raises
def divergence_warnings(warn_every):
    import logging
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from deepspeed.utils import logger
    from tests.models import batch, build_engine, ds_config, full_params
    from tests.training import train

    seen = []

    class Catch(logging.Handler):

        def emit(self, record):
            if "left the recorded module order" in record.getMessage():
                seen.append(record.getMessage())

    handler = Catch()
    logger.addHandler(handler)
    out = {}
    try:
        for name in ("stock", "z3ext"):
            # Ranks that agree on their forwards walk past a skipped block ([Note: forwards that differ by rank]):
            # the plan is left only with that agreement off.
            z3 = {"enabled": True, "plan_warning_steps": warn_every, "agree_forwards": False} if name == "z3ext" else False
            eng = build_engine(ds_config(z3ext=z3, persistence=0, ga=1))
            rank = dist.get_rank()

            def forward(eng, step):
                # Every other step skips a different block: the order keeps changing.
                eng.module.skip = (step % 2, ) if step % 2 else ()
                return eng(batch(step, rank))

            def generate(eng, step):
                # generate-style no_grad loop: forwards of growing length
                with torch.no_grad():
                    for t in (4, 8, 12):
                        eng(batch(100 + t, rank)[:, :t])

            out[name] = train(eng, 8, forward=forward, after_step=generate)
            out[name + "_params"] = full_params(eng)
    finally:
        logger.removeHandler(handler)
    out["warnings"] = len(seen)
    out["params_equal"] = all(torch.equal(out["stock_params"][k], out["z3ext_params"][k]) for k in out["stock_params"])
    del out["stock_params"], out["z3ext_params"]
    return out


@pytest.mark.parametrize("warn_every", [0, 10])
def test_divergence_degrades_prefetch_and_warns_at_most_once_per_n(warn_every):
    for r in run_on_ranks(divergence_warnings, warn_every=warn_every):
        assert r["stock"] == r["z3ext"] and r["params_equal"], r
        if warn_every == 0:
            assert r["warnings"] == 0, r  # off by default
        else:
            # 8 steps x 4 forwards = 32 forwards, most diverging: one warning per 10 forwards at most.
            assert 1 <= r["warnings"] <= 32 // warn_every + 1, r


# ------------------------------------------------------- parameters returned by a module's forward
def dangling_parameter():
    """A submodule that returns its own parameter (the weight tying pattern: an embedding hands its
    weight to the head); the parent uses it after the submodule's forward has ended. DeepSpeed's hook
    registers such a parameter to the enclosing module; z3ext's hooks do the same."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.distributed as dist
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train

    class WeightOf(nn.Module):

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(24, 16) * 0.1)

        def forward(self):
            return self.weight

    class Net(nn.Module):

        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.tied = WeightOf()

        def forward(self, x, y):
            w = self.tied()  # the parameter itself comes back as the output
            h = torch.tanh(self.inp(x))
            return F.mse_loss(F.linear(h, w).sum(-1), y)

    out = {}
    rank = dist.get_rank()
    # Without hold_for_backward the submodule's release would partition the weight before the parent
    # uses it, unless it was registered to the parent.
    configs = {"stock": False, "z3ext": {"enabled": True, "hold_for_backward": False}, "z3ext-hold": True}

    def inputs(i):
        g = torch.Generator().manual_seed(31 * i + rank)
        return torch.randn(2, 8, generator=g), torch.randn(2, generator=g)

    for name, z3 in configs.items():
        eng = build_engine(ds_config(z3ext=z3, persistence=0, ga=2), model_fn=Net)
        out[name] = train(eng, 6, inputs)
        out[name + "_params"] = full_params(eng)
    out["params_equal"] = all(
        torch.equal(out["stock_params"][k], out[z + "_params"][k]) for k in out["stock_params"] for z in ("z3ext", "z3ext-hold"))
    for name in configs:
        del out[name + "_params"]
    return out


def test_parameter_returned_by_a_module_matches_stock():
    for r in run_on_ranks(dangling_parameter):
        assert r["stock"] == r["z3ext"] == r["z3ext-hold"] and r["params_equal"], r
        assert r["z3ext"][0] != r["z3ext"][-1]
