"""Ownership: every holder of a full parameter is a claim, and only the last release partitions it.

Each case runs on 2 real ranks (gloo on CPU; test_gpu.py reruns them with NCCL) next to stock
ZeRO-3 from the same seed. Stock's own outcome is recorded in the results so the difference shows.
"""
import pytest

from tests.harness import run_on_ranks


def _dev():
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _batch(i):
    import torch.distributed as dist
    from tests.models import batch
    return batch(i, dist.get_rank()).to(_dev())


def _stock_and_z3(**cfg):
    from tests.models import build_engine, ds_config
    return (build_engine(ds_config(persistence=0, **cfg)), build_engine(ds_config(z3ext=True, persistence=0,
                                                                                   **cfg)))


# --------------------------------------------------------------------------- (2) and (3): GatheredParameters
def gathered_around_forward():
    import torch
    import deepspeed
    import deepspeed_z3ext
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from tests.models import full_params
    out = {}
    stock, z3 = _stock_and_z3(ga=1)
    true_w = {k: v for k, v in full_params(z3).items() if k == "blocks.0.fc1.weight"}["blocks.0.fc1.weight"]
    true_norm = true_w.float().norm().item()
    for name, eng in (("stock", stock), ("z3ext", z3)):
        w = eng.module.blocks[0].fc1.weight
        # (2) between forward and backward
        loss = eng(_batch(0))
        before = deepspeed_z3ext.stats(eng).collectives if name == "z3ext" else None
        with GatheredParameters([w]):
            out[f"{name}_norm_between"] = w.float().norm().item()
        if name == "z3ext":
            out["extra_gathers_between"] = deepspeed_z3ext.stats(eng).collectives - before
        eng.backward(loss)
        out[f"{name}_status_after_backward"] = w.ds_status.name
        eng.step()
        # (3) forward inside the block: modules that run must not release W
        try:
            with GatheredParameters([w]):
                loss = eng(_batch(1))
                out[f"{name}_norm_inside"] = w.float().norm().item()
            eng.backward(loss)
            eng.step()
            out[f"{name}_inside_error"] = None
        except Exception as e:
            out[f"{name}_inside_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out[f"{name}_params"] = full_params(eng)
        out[f"{name}_w_after"] = full_params(eng)["blocks.0.fc1.weight"].float().norm().item()
    out["true_norm"] = true_norm
    out["params_equal"] = all(torch.equal(out["stock_params"][k], out["z3ext_params"][k]) for k in out["stock_params"])
    out["z3_gathered_after"] = deepspeed_z3ext.stats(z3).gathered
    del out["stock_params"], out["z3ext_params"]
    return out


def test_gathered_parameters_between_and_around_forward():
    for r in run_on_ranks(gathered_around_forward):
        assert r["z3ext_norm_between"] == pytest.approx(r["true_norm"], rel=1e-6)
        assert r["extra_gathers_between"] == 0, "W was still claimed for backward: no all-gather expected"
        assert r["z3ext_status_after_backward"] == "NOT_AVAILABLE"
        assert r["z3ext_inside_error"] is None
        assert r["z3ext_norm_inside"] > 0 and r["z3ext_norm_inside"] == pytest.approx(r["z3ext_w_after"], rel=0.2)
        assert r["z3_gathered_after"] == []
        print("stock (2):", r["stock_norm_between"], "(3):", r.get("stock_norm_inside"), r["stock_inside_error"])


# --------------------------------------------------------------------------- (4): nesting, failures, modifier_rank
def gathered_nesting():
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from tests.models import build_engine, ds_config
    z3 = build_engine(ds_config(z3ext=True, persistence=0, ga=1))
    m = z3.module.blocks[0]
    out = {}
    with GatheredParameters([m.fc1.weight]):
        try:
            with GatheredParameters([m.fc2.weight, m.fc1.weight]):
                pass
            out["overlap_error"] = None
        except deepspeed_z3ext.ClaimError as e:
            out["overlap_error"] = str(e)
        with GatheredParameters([m.fc2.weight]):  # disjoint nesting is fine
            out["disjoint_ok"] = m.fc2.weight.shape == m.fc2.weight.ds_shape
        out["outer_still_gathered"] = m.fc1.weight.ds_status.name
    out["claims_after_overlap"] = deepspeed_z3ext.stats(z3).claims
    try:
        with GatheredParameters([m.qkv.weight]):
            raise ValueError("boom")
    except ValueError:
        pass
    out["claims_after_body_error"] = deepspeed_z3ext.stats(z3).claims
    out["qkv_status_after_error"] = m.qkv.weight.ds_status.name
    # modifier_rank: rank 0's edit reaches every rank's partition
    with GatheredParameters([m.proj.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            m.proj.weight.data.fill_(0.25)
    out["partition_after_modify"] = m.proj.weight.ds_tensor.float().unique().tolist()
    with GatheredParameters([m.proj.weight]):
        out["full_after_modify"] = m.proj.weight.float().unique().tolist()
    return out


def test_nested_blocks_failures_and_modifier_rank():
    for r in run_on_ranks(gathered_nesting):
        assert r["overlap_error"] and "blocks.0.fc1.weight" in r["overlap_error"]
        assert r["disjoint_ok"] and r["outer_still_gathered"] == "AVAILABLE"
        assert r["claims_after_overlap"] == {}, "a failed nested enter left a claim behind"
        assert r["claims_after_body_error"] == {} and r["qkv_status_after_error"] == "NOT_AVAILABLE"
        assert r["partition_after_modify"] == [0.25]
        assert r["full_after_modify"] == [0.25]


# --------------------------------------------------------------------------- (5) and (6): failures, abandoned forwards
class Boom(Exception):
    pass


def forward_failures():
    import torch
    import deepspeed_z3ext
    from deepspeed.runtime.zero import parameter_offload
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train
    out = {}
    for name in ("stock", "z3ext", "z3ext_clean"):
        eng = build_engine(ds_config(z3ext=name.startswith("z3ext"), persistence=0, ga=1))
        losses = []
        if name != "z3ext_clean":
            blk = eng.module.blocks[1]

            def explode(mod, args):
                raise Boom("inside forward")

            h = blk.fc2.register_forward_pre_hook(explode)
            try:
                eng(_batch(0))
            except Boom:
                pass
            h.remove()
            out[f"{name}_stack_after_error"] = len(parameter_offload.FWD_MODULE_STACK)
            eng(_batch(1))  # (6) abandoned loss: backward never runs
            with torch.no_grad():
                eng.eval()
                eng(_batch(2))  # (6) eval forward
                eng.train()
        try:
            train(eng, 3, lambda i: _batch(10 + i), losses=losses)  # losses so far kept if a step raises
            out[f"{name}_error"] = None
        except Exception as e:
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[f"{name}_losses"] = losses
        if name.startswith("z3ext"):
            out[f"{name}_gathered"] = deepspeed_z3ext.stats(eng).gathered
            out[f"{name}_params"] = full_params(eng)
        out[f"{name}_stack_end"] = len(parameter_offload.FWD_MODULE_STACK)
    out["params_equal"] = all(torch.equal(out["z3ext_params"][k], out["z3ext_clean_params"][k])
                              for k in out["z3ext_params"])
    del out["z3ext_params"], out["z3ext_clean_params"]
    return out


def test_exception_in_forward_and_abandoned_forwards_leave_nothing_behind():
    for r in run_on_ranks(forward_failures):
        assert r["z3ext_error"] is None, r["z3ext_error"]
        assert r["z3ext_losses"] == r["z3ext_clean_losses"], "the failed/abandoned forwards changed training"
        assert r["params_equal"]
        assert r["z3ext_gathered"] == []
        print("stock after a failed forward:", r["stock_error"], r["stock_losses"])


# --------------------------------------------------------------------------- (7): shared loss
def shared_loss():
    import torch
    from tests.models import full_params
    from tests.training import train
    stock, z3 = _stock_and_z3(ga=2)
    res = {}

    def two_forwards_one_loss(eng, i):
        return eng(_batch(2 * i)) + eng.module(_batch(2 * i + 1))

    for name, eng in (("stock", stock), ("z3ext", z3)):
        losses = train(eng, 4, forward=two_forwards_one_loss)
        res[name] = (losses, full_params(eng))
    return dict(losses_equal=res["stock"][0] == res["z3ext"][0],
                params_equal=all(torch.equal(res["stock"][1][k], res["z3ext"][1][k]) for k in res["stock"][1]))


def test_shared_loss_under_gradient_accumulation():
    for r in run_on_ranks(shared_loss):
        assert r["losses_equal"] and r["params_equal"]


# --------------------------------------------------------------------------- (8): two engines
def two_engines():
    import torch
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train as train_steps

    def train(eng, i):  # one step on _batch(i)
        return train_steps(eng, 1, _batch, first_step=i)[0]

    cfg = ds_config(z3ext=True, persistence=0, ga=1)
    alone_a = build_engine(cfg, seed=1)
    la = train_steps(alone_a, 3, _batch)
    pa = full_params(alone_a)
    alone_a.destroy()
    alone_b = build_engine(cfg, seed=2)
    lb = train_steps(alone_b, 3, _batch, first_step=100)
    pb = full_params(alone_b)
    alone_b.destroy()

    a, b = build_engine(cfg, seed=1), build_engine(cfg, seed=2)
    la2, lb2 = [], []
    for i in range(3):  # alternate
        la2.append(train(a, i))
        lb2.append(train(b, 100 + i))
    pa2, pb2 = full_params(a), full_params(b)
    a.destroy()
    sb = deepspeed_z3ext.stats(b)
    lb2.append(train(b, 999))  # b is untouched by a's destruction
    return dict(a_equal=la == la2 and all(torch.equal(pa[k], pa2[k]) for k in pa),
                b_equal=lb == lb2[:3] and all(torch.equal(pb[k], pb2[k]) for k in pb),
                b_claims_intact=sb.gathered == [], b_trains=lb2[3] > 0)


def test_two_engines_alternate_and_destroy_independently():
    for r in run_on_ranks(two_engines):
        assert r["a_equal"] and r["b_equal"] and r["b_claims_intact"] and r["b_trains"]


# --------------------------------------------------------------------------- (9): leak check
def leak_check():
    import deepspeed
    from tests.models import build_engine, ds_config
    eng = build_engine(ds_config(z3ext={"enabled": True, "leak_check": True}, persistence=0, ga=1))
    loss = eng(_batch(0))
    eng.backward(loss)
    eng.step()  # clean step: no error
    w = eng.module.blocks[1].fc2.weight
    with deepspeed.zero.GatheredParameters([w]):
        kept = w.detach()  # outlives the block: the full tensor leaks into the next step
    loss = eng(_batch(1))
    eng.backward(loss)
    try:
        eng.step()
        return None
    except RuntimeError as e:
        return str(e) + f" | kept {tuple(kept.shape)}"


def test_leak_check_names_the_leaked_parameter():
    for msg in run_on_ranks(leak_check):
        assert msg is not None and "blocks.1.fc2.weight" in msg and "leak check" in msg
