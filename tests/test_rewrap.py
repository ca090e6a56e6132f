"""An engine kept alive after a later engine wrapped its module ([Note: re-wrapped parameters] in state.py), as TRL's
DPO keeps the engine that precomputed the reference log-probs: on 2 gloo ranks, an inference engine whose threshold
makes every parameter persistent runs three forwards, then a training engine (threshold 0) over the same module
trains. Losses and a later forward of the old engine are bitwise stock's; once the new engine adopted the
parameters, the old one gathers and holds nothing, and after every step no parameter is gathered, as in stock
(whose `ds_persist` flags, left set by the old engine, make z3ext keep nothing resident either)."""
from tests.harness import run_on_ranks

STEPS = 3


def _run(z3ext):
    import copy
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext
    from tests.models import TinyGPT, batch, ds_config
    rank = dist.get_rank()
    cfg = ds_config(z3ext=z3ext, persistence=0, ga=1)
    torch.manual_seed(1)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyGPT()
    old_cfg = copy.deepcopy(cfg)
    del old_cfg["optimizer"]
    old_cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**6
    old, *_ = deepspeed.initialize(model=model, config=old_cfg)
    with torch.no_grad():  # stock's trace needs more than one forward before another engine's hooks join
        before = [old(batch(100 + i, rank)).item() for i in range(3)]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    old_collectives = deepspeed_z3ext.stats(old).collectives if z3ext else 0
    losses, gathered_after_step, old_held = [], [], []
    for step in range(STEPS):
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        gathered_after_step.append(sorted(n for n, p in model.named_parameters() if p.numel() > 0))
        if z3ext:
            s = deepspeed_z3ext.stats(old)
            old_held.append((s.gathered, s.claims, s.collectives - old_collectives))
    with torch.no_grad():
        after = old(batch(9, rank)).item()
    persist = sum(1 for p in model.parameters() if p.ds_persist)
    engine.destroy()
    old.destroy()
    return dict(before=before, losses=losses, after=after, gathered_after_step=gathered_after_step, old_held=old_held,
                persist=persist, n=len(list(model.parameters())))


def both():
    return {"stock": _run(False), "z3ext": _run(True)}


def test_old_engine_kept_alive_holds_nothing_and_persistence_follows_the_new_engine():
    for rank, r in enumerate(run_on_ranks(both, timeout=240)):
        stock, z3 = r["stock"], r["z3ext"]
        assert stock["persist"] == z3["persist"] == z3["n"], "the old engine marked every parameter ds_persist"
        for key in ("before", "losses", "after"):
            assert stock[key] == z3[key], f"rank {rank}: {key}: stock {stock[key]} z3ext {z3[key]}"
        assert stock["gathered_after_step"] == z3["gathered_after_step"] == [[]] * STEPS, (stock, z3)
        assert z3["old_held"] == [([], {}, 0)] * STEPS, f"rank {rank}: the old engine still gathers: {z3['old_held']}"
