"""[Note: blocks over several engines] (gathered.py) on 2 real gloo ranks: one GatheredParameters block over a
policy engine's and a reference engine's parameters with modifier_rank=0, as TRL's reference-model sync
(`SyncRefModelCallback.sync_target_model`) opens it, gives stock ZeRO-3's bits with both engines z3ext, with
z3ext and stock mixed either way, and leaves nothing gathered; a block that raises in its body still writes
back and releases every part."""
import pytest

from tests.harness import run_on_ranks

ALPHA = 0.5


def _sync(policy, ref):
    """TRL's sync: the reference moves towards the policy, written on rank 0 and broadcast."""
    import deepspeed
    params = list(policy.module.parameters()) + list(ref.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if deepspeed.comm.get_rank() == 0:
            for t, p in zip(ref.module.parameters(), policy.module.parameters()):
                t.data.mul_(1.0 - ALPHA).add_(p.data, alpha=ALPHA)


def _engines(policy_z3ext, ref_z3ext):
    from tests.models import TinyGPT, build_engine, ds_config
    policy = build_engine(ds_config(z3ext=policy_z3ext, persistence=0, ga=1))
    ref_cfg = ds_config(z3ext=ref_z3ext, persistence=0, ga=1)
    del ref_cfg["optimizer"]  # TRL's reference engine: inference only
    ref = build_engine(ref_cfg, model_fn=lambda: TinyGPT(), seed=99)
    return policy, ref


def _numpy(params):
    return {n: t.cpu().numpy() for n, t in params.items()}


def sync_runs(kinds):
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import batch, full_params
    rank = dist.get_rank()
    out = {}
    for policy_z3ext, ref_z3ext in kinds:
        policy, ref = _engines(policy_z3ext, ref_z3ext)
        losses = []
        for step in range(2):
            loss = policy(batch(step, rank))
            policy.backward(loss)
            policy.step()
            _sync(policy, ref)
            with torch.no_grad():
                losses.append((loss.item(), ref(batch(100 + step, rank)).item()))
        raised = None
        try:  # a body that raises: every part still written back and released
            import deepspeed
            with deepspeed.zero.GatheredParameters(list(policy.module.parameters()) + list(ref.module.parameters()),
                                                   modifier_rank=0):
                raise KeyError("body")
        except KeyError as e:
            raised = str(e)
        left = [deepspeed_z3ext.stats(e).gathered for e, on in ((policy, policy_z3ext), (ref, ref_z3ext)) if on]
        out[(policy_z3ext, ref_z3ext)] = dict(losses=losses, ref=_numpy(full_params(ref)), policy=_numpy(full_params(policy)),
                                              raised=raised, left=left)
        policy.destroy()
        ref.destroy()
    return {f"{a}-{b}": v for (a, b), v in out.items()}


def test_one_block_over_two_engines_syncs_like_stock():
    import numpy as np
    kinds = [(False, False), (True, True), (True, False), (False, True)]
    for rank, res in enumerate(run_on_ranks(sync_runs, kinds=kinds, timeout=300)):
        stock = res["False-False"]
        for name, r in res.items():
            where = f"rank {rank}, z3ext policy-ref {name}"
            assert r["losses"] == stock["losses"], f"{where}: {r['losses']} vs {stock['losses']}"
            for which in ("ref", "policy"):
                diff = [n for n in stock[which] if not np.array_equal(stock[which][n], r[which][n])]
                assert not diff, f"{where}: {which} parameters differ: {diff}"
            assert r["raised"] == "'body'" and all(not g for g in r["left"]), (where, r["raised"], r["left"])
    # The sync moved the reference: it is not the engine it was built as.
    assert res["True-True"]["losses"][0][1] != res["True-True"]["losses"][1][1]
