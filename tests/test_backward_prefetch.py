"""Backward prefetch on 2 real gloo ranks ([Note: backward prefetch] in window.py): modules released
after their forward (the hold off, or past a small live budget) are gathered ahead of their backward,
several per collective, within stage3_prefetch_bucket_size; training stays bitwise equal to stock;
a module whose backward never runs on any rank (a branch without gradient) is passed over, not gathered
([Note: presence agreed] in grads.py); nothing stays gathered after backward; `hold_max_numel` bounds what a forward holds."""
import pytest

from tests.harness import on_gpu, run_on_ranks

LAYERS, WIDTH = 8, 32
UNIT = WIDTH * WIDTH + WIDTH          # one nn.Linear's elements
BUCKET = 3 * UNIT                     # three layers ahead at most


def _stack():
    import torch.nn as nn

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
            self.side = nn.Linear(WIDTH, WIDTH)  # its output never reaches the loss: no backward

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x).tanh()
                if i == LAYERS // 2:
                    self.side(x)
            return x.square().mean()

    return Stack


def prefetch_next_to_stock(steps=3):
    import torch
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train
    rank = dist.get_rank()
    stack = _stack()

    def inputs(i):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * i + rank))
        return (x.cuda() if on_gpu() else x).requires_grad_()

    stock = build_engine(ds_config(persistence=0, mel=False, ga=1), model_fn=stack)
    ref_losses = train(stock, steps, inputs)
    ref = full_params(stock)
    stock.destroy()
    cases = {  # z3ext options, zero_optimization extras
        "nohold": ({"hold_for_backward": False}, {"stage3_prefetch_bucket_size": BUCKET}),
        "nohold-no-prefetch": ({"hold_for_backward": False}, {"stage3_prefetch_bucket_size": 0}),
        "partial": ({}, {"stage3_prefetch_bucket_size": BUCKET, "stage3_max_live_parameters": 6 * UNIT}),
        "hold-budget": ({"hold_max_numel": 3 * UNIT}, {"stage3_prefetch_bucket_size": BUCKET}),
    }
    # gloo on CUDA tensors gathers per tensor ([Note: gloo on CUDA tensors] in csrc/collectives.h): 2 per layer.
    out = {"_per_unit": 2 if on_gpu() and dist.get_backend() == "gloo" else 1}
    for case, (options, zero_extra) in cases.items():
        eng = build_engine(ds_config(z3ext={"enabled": True, **options}, persistence=0, mel=False, ga=1,
                                     zero_extra=zero_extra), model_fn=stack)
        record = {"backward_live": [], "backward_collectives": [], "after_backward": [], "held_after_forward": []}

        def probe(grad):
            record["backward_live"].append(deepspeed_z3ext.stats(eng).live_bytes)

        losses = []
        for i in range(steps):  # train()'s loop, with the backward measured
            hooks = [layer.register_forward_hook(lambda m, a, y: y.register_hook(probe) and None)
                     for layer in eng.module.layers]
            loss = eng(inputs(i))
            for h in hooks:
                h.remove()
            claims = deepspeed_z3ext.stats(eng).claims
            record["held_after_forward"].append(sorted({n.rsplit(".", 1)[0] for n, cs in claims.items()
                                                        if any(kind == "backward" for kind, _ in cs)}))
            before = deepspeed_z3ext.stats(eng).collectives
            eng.backward(loss)
            st = deepspeed_z3ext.stats(eng)
            record["backward_collectives"].append(st.collectives - before)
            record["after_backward"].append((st.live_bytes, sorted(st.claims)))
            eng.step()
            losses.append(loss.item())
        params = full_params(eng)
        out[case] = dict(losses_equal=losses == ref_losses, losses=losses, ref_losses=ref_losses,
                         mismatched=[n for n in ref if not torch.equal(ref[n], params[n])],
                         gathered_ahead=deepspeed_z3ext.stats(eng).backward_prefetched, **record)
        eng.destroy()
    return out


def test_backward_prefetch_gathers_ahead_within_the_window_bitwise_equal_to_stock():
    _check_prefetch(run_on_ranks(prefetch_next_to_stock, timeout=600))


@pytest.mark.gpus(2)
def test_backward_prefetch_on_gpu_bitwise_equal_to_stock():
    """The CUDA path: gathers ahead on the side stream, the compute stream waiting on their events."""
    _check_prefetch(run_on_ranks(prefetch_next_to_stock, backend="nccl", timeout=600))


def _check_prefetch(results):
    padded_unit_bytes = 4 * (WIDTH * WIDTH + WIDTH)  # fp32; both shapes split evenly over 2 ranks
    for rank, res in enumerate(results):
        per_unit = res.pop("_per_unit")
        for case, r in res.items():
            assert r["losses_equal"], f"rank {rank} {case}: losses differ:\n{r['losses']}\n{r['ref_losses']}"
            assert not r["mismatched"], f"rank {rank} {case}: parameters differ: {r['mismatched']}"
            # Nothing outlives the backward pass.
            assert all(live == 0 and not claimed for live, claimed in r["after_backward"]), (rank, case, r["after_backward"])
        on, off = res["nohold"], res["nohold-no-prefetch"]
        print(f"rank {rank}: " + "; ".join(f"{c}: {r['gathered_ahead']} units ahead, collectives per backward "
                                           f"{r['backward_collectives']}, peak live in backward {max(r['backward_live'])} B"
                                           for c, r in res.items()))
        assert on["gathered_ahead"] > 0 and off["gathered_ahead"] == 0, (on["gathered_ahead"], off["gathered_ahead"])
        # hold_max_numel: the forward's graph holds the first three layers, the rest are gathered ahead.
        held = res["hold-budget"]["held_after_forward"]
        assert held == [[f"layers.{i}" for i in range(3)]] * len(held), held
        assert res["hold-budget"]["gathered_ahead"] > 0
        # The hold partial: held, gathered ahead and current stay within the live budget plus the module
        # running its backward and the one whose claim is ending.
        live_bound = 4 * (6 * UNIT) + 2 * padded_unit_bytes
        assert max(res["partial"]["backward_live"]) <= live_bound, (rank, res["partial"]["backward_live"], live_bound)
        # Without prefetch every layer's backward gathers its own unit; with it, several per collective.
        later = slice(1, None)  # the first step records the forward plan
        assert off["backward_collectives"][later] == [LAYERS * per_unit] * 2, off["backward_collectives"]
        if per_unit == 1:
            assert max(on["backward_collectives"][later]) < LAYERS, on["backward_collectives"]
        else:  # a gather per tensor coalesces nothing: the layers ahead; the side branch, needed by no rank, passed over
            assert on["backward_collectives"][later] == [LAYERS * per_unit] * 2, on["backward_collectives"]
        # Within the window: what is ahead, the module running its backward, and the one after it whose
        # claim ends once its input's gradient is complete.
        bound = BUCKET * 4 + 2 * padded_unit_bytes
        assert max(on["backward_live"]) <= bound, (rank, max(on["backward_live"]), bound)
        assert max(on["backward_live"]) > max(off["backward_live"]), (on["backward_live"], off["backward_live"])
