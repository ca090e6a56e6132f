"""z3ext's gradient path ([Note: gradient path] in grads.py, csrc/reduce.h) against stock ZeRO-3 on 2
real gloo ranks: after every backward the optimizer's gradient partitions, and at the end the losses
and parameters, are bitwise equal (torch.equal), with gradient accumulation on and off, several
flushes per backward, clipping, fp32 communication of bf16 gradients, fp16 loss scaling (GPU), and the
configurations that keep DeepSpeed's path. The model's ops save the parameter itself (addmm, bmm, conv1d,
an LSTM, a module applied twice: tests/test_backward_integrity.py's Net)."""
import pytest

from tests.harness import on_gpu, run_on_ranks
from tests.test_backward_integrity import SEQ, VOCAB, _model

# name -> (DeepSpeed config additions, zero_optimization additions, z3ext options, gradient accumulation)
CASES = {
    "ga1": ({}, {}, {}, 1),
    "ga3": ({}, {}, {}, 3),
    "small-bucket": ({}, {"reduce_bucket_size": 300}, {}, 2),  # slices of 75: direct ones and laid-out ones
    "small-bucket-bf16-fp32-comm": ({"bf16": {"enabled": True}, "communication_data_type": "fp32"},
                                    {"reduce_bucket_size": 300}, {}, 1),  # direct slices converted first
    "clip": ({"gradient_clipping": 1e-3}, {}, {}, 2),  # triggered at every step: a scaled copy ([Note: fused unscale])
    "bf16-clip": ({"bf16": {"enabled": True}, "gradient_clipping": 1e-3}, {}, {}, 2),  # converted and scaled in one
    "clip-untriggered": ({"gradient_clipping": 1e6}, {}, {}, 2),  # never triggered: the step's view
    "clip-exact-norm": ({"gradient_clipping": 1e-3}, {}, {"exact_grad_norm": True}, 2),  # stock's norm loop
    "bf16-fp32-comm": ({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, {}, {}, 2),
    # [Note: gradient partitions between steps]: freed by default; kept (stock's) with the opt-out
    "keep-grad-partitions": ({}, {}, {"free_grad_partitions": False}, 2),
    "keep-grad-partitions-clip": ({"gradient_clipping": 1e-3}, {}, {"free_grad_partitions": False}, 1),
    "stock-path": ({}, {}, {"reduce_gradients": False}, 2),
    "reduce-scatter-off": ({}, {"reduce_scatter": False}, {}, 2),  # stock's all-reduce path: kept
    # DeepSpeed refuses fp16 on CPU: GPU only (test_gradient_path_on_gpu).
    "fp16-loss-scale": ({"fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2}}, {}, {}, 2),
}
STOCK_PATH = ("stock-path", "reduce-scatter-off")


def _config(z3ext, extra, zero_extra, options, ga):
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **zero_extra}
    # DeepSpeed 0.19.8 clips at 1.0 by default; 0 unless a case says otherwise, so each case knows whether
    # the step's unscale multiplies ([Note: step gradient view]).
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}, "zero_optimization": zero,
           "gradient_clipping": 0.0, **extra}
    if z3ext:
        cfg["z3ext"] = {"enabled": True, **options}
    return cfg


def _tokens(i, rank):
    import torch
    g = torch.Generator().manual_seed(1000 * i + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return tokens.cuda() if on_gpu() else tokens


def same(a, b):
    """Bitwise equal values, NaN where the other has NaN (an fp16 overflow writes NaN into both)."""
    import torch
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))


def train_both(case, steps=4):
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext  # noqa: F401
    from deepspeed_z3ext import deepspeed_private
    from deepspeed_z3ext.state import of_optimizer
    from tests.models import full_params
    from tests.programs import check_gradient_runs

    extra, zero_extra, options, ga = CASES[case]
    rank = dist.get_rank()
    torch.backends.cudnn.deterministic = True  # GPU: conv and LSTM kernels
    runs = {}
    for name in ("stock", "z3ext"):
        cfg = _config(name == "z3ext", extra, zero_extra, options, ga)
        torch.manual_seed(11)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = _model()()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        dtype = next(engine.module.parameters()).dtype
        losses, partitions, norms, between = [], [], [], []
        for i in range(steps * ga):
            loss = -engine(_tokens(i, rank)).float().mean()  # engine.forward every micro-step: accumulation runs
            engine.backward(loss)
            if name == "z3ext":
                check_gradient_runs(engine.optimizer)
            parts = deepspeed_private.grad_partitions(engine.optimizer)
            partitions.append([parts[k].detach().clone() for k in sorted(parts)])  # ds_id order: the model's
            engine.step()
            losses.append(loss.item())
            if (i + 1) % ga == 0:
                between.append(engine.optimizer.grad_partitions_flat_buffer.untyped_storage().nbytes())
                norm = engine.get_global_grad_norm()
                norms.append(float(norm) if norm is not None else None)
        state = of_optimizer(engine.optimizer)
        reducer = state.grad_reducer if state is not None else None
        hooks = [h.hooks_dict_ref()[h.id] for h in engine.optimizer._grad_acc_hooks]
        runs[name] = dict(hooks=sorted({getattr(f, "__name__", "?") for f in hooks}), n_hooks=len(hooks),
                          trainable=sum(p.requires_grad for p in engine.module.parameters()),
                          losses=losses, partitions=partitions, norms=norms, params=full_params(engine), between=between,
                          stats=reducer.stats()._asdict() if reducer else None,
                          bucket_numel=[b.buffer.numel() for b in engine.optimizer.ipg_buckets.values()
                                        if b.buffer is not None],
                          skipped=getattr(engine, "skipped_steps", 0), dtype=str(dtype),
                          converted=engine.optimizer.grad_partitions_flat_buffer.dtype
                          != engine.optimizer.fp32_partitioned_groups_flat[0].dtype)
        engine.destroy()
    stock, z3 = runs["stock"], runs["z3ext"]
    partition_diffs = [(i, k) for i, (a, b) in enumerate(zip(stock["partitions"], z3["partitions"]))
                       for k in range(max(len(a), len(b))) if len(a) != len(b) or not same(a[k], b[k])]
    mismatched = [n for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])]
    return dict(stock_losses=stock["losses"], z3_losses=z3["losses"], stock_norms=stock["norms"], z3_norms=z3["norms"], partition_diffs=partition_diffs,
                n_partitions=sum(len(p) for p in z3["partitions"]), mismatched=mismatched, stats=z3["stats"],
                stock_bucket=stock["bucket_numel"], z3_bucket=z3["bucket_numel"], skipped=(stock["skipped"], z3["skipped"]),
                dtype=z3["dtype"], converted=z3["converted"], backend=dist.get_backend(), stock_between=stock["between"], z3_between=z3["between"],
                hooks=(stock["hooks"], z3["hooks"]), n_hooks=(stock["n_hooks"], z3["n_hooks"], z3["trainable"]))


def norms_agree(stock, z3, rtol):
    """Bitwise (rtol 0), or within `rtol` relative: CUDA's fused `_foreach_norm` may add in another order."""
    if rtol == 0 or len(stock) != len(z3):
        return stock == z3
    return all(a == b or (a is not None and b is not None and abs(a - b) <= rtol * abs(a)) for a, b in zip(stock, z3))


def check(results, case, norm_rtol=0.0):
    extra, zero_extra, options, ga = CASES[case]
    for rank, r in enumerate(results):
        assert r["stock_losses"] == r["z3_losses"], f"rank {rank}: losses differ:\n{r['stock_losses']}\n{r['z3_losses']}"
        assert r["n_partitions"] > 0
        # [Note: gradient norm]: on CPU the multi-tensor norm is stock's bit for bit.
        assert norms_agree(r["stock_norms"], r["z3_norms"], norm_rtol), f"rank {rank}: gradient norms differ:\n{r['stock_norms']}\n{r['z3_norms']}"
        assert not r["partition_diffs"], f"rank {rank}: gradient partitions differ at (backward, parameter index) {r['partition_diffs'][:8]}"
        assert not r["mismatched"], f"rank {rank}: parameters differ: {r['mismatched']}"
        assert r["skipped"][0] == r["skipped"][1]
        # [Note: lean gradient hook]: every trainable parameter's hook is z3ext's (whichever path reduces), the
        # stock engine's are stock's.
        assert r["hooks"] == (["wrapped_fn"], ["z3ext_reduce_partition_and_remove_grads"]), r["hooks"]
        assert r["n_hooks"][0] == r["n_hooks"][1] == r["n_hooks"][2], r["n_hooks"]
        if case in STOCK_PATH:
            assert r["stats"] is None, f"z3ext reduced gradients although {case} keeps DeepSpeed's path"
            assert r["z3_bucket"] == r["stock_bucket"]
            continue
        # z3ext's path ran, and ran what the case is about.
        st = r["stats"]
        assert st is not None and st["flushes"] > 0 and st["reduced_params"] > 0 and st["bucket_elements"] == 0, st
        backwards = len(r["z3_losses"])
        if ga > 1:
            assert st["accumulating_flushes"] > 0, f"no flush accumulated into the partitions: {st}"
        else:
            assert st["accumulating_flushes"] == 0, st
        if "reduce_bucket_size" in zero_extra:
            assert st["flushes"] > 2 * backwards, f"expected several flushes per backward: {st}"
            # [Note: flush slices]: a flush reduce-scatters in slices of a quarter of the bucket; a gradient of an
            # eighth of a slice or more, even over the ranks, alone and without a layout ([Note: direct slices]).
            if len(results) > 1:  # (one rank: no collective)
                assert st["reduce_scatters"] > st["flushes"], st
                assert st["direct_reduce_scatters"] > 0, st  # (the default bucket: laid-out slices only)
        else:
            assert st["flushes"] == backwards, f"expected one flush per backward: {st}"
            assert st["direct_reduce_scatters"] == 0, st
        # [Note: divide after the reduce]: at a power-of-two world of two or more the shard is divided after the
        # collective, on any backend, unless the reduction is in fp16 (stock's pre-divide).
        fp16_comm = "fp16" in case and "fp32-comm" not in case
        expected = 0 if fp16_comm or options.get("divide_after_reduce") is False else st["reduce_scatters"]
        assert st["divided_after_reduce"] == expected, st
        # [Note: partition runs]: partitions that lie back to back are written as one run (one rank: one each;
        # the small buckets' slices hold one or two parameters).
        if len(results) > 1 and "reduce_bucket_size" not in zero_extra:
            assert 0 < st["partition_writes"] < st["reduced_params"], st
        elif len(results) > 1:
            assert 0 < st["partition_writes"] <= st["reduced_params"], st
        else:
            assert st["partition_writes"] == st["reduced_params"], st
        # [Note: step gradient view]: the optimizer stepped on the gradient buffer (a view, or its conversion
        # to the master dtype) unless a view's unscale would multiply (triggered clipping, a loss scale).
        steps_taken = len(r["z3_losses"]) // ga - r["skipped"][1]  # an overflow skips the step
        # [Note: fused unscale]: where the unscale multiplies, that copy is also the unscale, which is not run.
        clipped = ("clip", "bf16-clip", "clip-exact-norm", "fp16-loss-scale", "keep-grad-partitions-clip")
        assert st["step_views"] == steps_taken, st
        # The unscale is skipped exactly when it would multiply by 1: no loss scale, clipping off or untriggered.
        if case in clipped:
            assert st["unscales_skipped"] == 0 and st["unscales_fused"] == steps_taken, st
        else:
            assert st["unscales_skipped"] == steps_taken and st["unscales_fused"] == 0, st
        # The step's norm was z3ext's multi-tensor pass, unless the case asks for stock's loop.
        assert st["fast_norms"] == (0 if options.get("exact_grad_norm") else steps_taken), st
        # The gradient partitions between steps: freed (the default), or kept as stock keeps them (the opt-out).
        assert all(n > 0 for n in r["stock_between"]), r["stock_between"]
        if options.get("free_grad_partitions", True):
            # after every step, and after every step an fp16 overflow skipped
            assert r["z3_between"] == [0] * len(r["z3_between"]) and st["partitions_freed"] == len(r["z3_losses"]) // ga, \
                (r["z3_between"], st)
            # [Note: partitions as they reduce]: every window after the first (the buffer is freed after its step)
            assert st["partition_pieces"] >= st["partitions_freed"] - 1, st
        else:
            assert r["z3_between"] == r["stock_between"] and st["partitions_freed"] == 0, (r["z3_between"], st)
            assert st["partition_pieces"] == 0, st
        # DeepSpeed's bucket buffer (reduce_bucket_size elements) is freed.
        assert r["stock_bucket"] and all(n > 0 for n in r["stock_bucket"]) and all(n == 0 for n in r["z3_bucket"])
    if "fp16" in case:
        assert results[0]["skipped"][1] > 0, "the loss scale never overflowed: the overflow path was not exercised"
    if "bf16" in case or "fp16" in case:
        assert results[0]["dtype"] != "torch.float32"
    assert results[0]["z3_losses"][0] != results[0]["z3_losses"][-1]  # it trained


@pytest.mark.parametrize("case", [c for c in CASES if c != "fp16-loss-scale"])
def test_gradient_path_bitwise_equal_to_stock(case):
    check(run_on_ranks(train_both, case=case, timeout=400), case)


@pytest.mark.parametrize("case", ["ga3", "bf16-fp32-comm"])
def test_gradient_path_one_rank(case):
    """One rank: no collective; gradients go straight into the partitions ([Note: world of one] in
    csrc/reduce.h)."""
    check(run_on_ranks(train_both, world_size=1, case=case, timeout=400), case)


def _on_gpu(world):
    return [pytest.param(world, marks=pytest.mark.gpus(world))]


@pytest.mark.parametrize("world", _on_gpu(1) + _on_gpu(2))
@pytest.mark.parametrize("case", ["ga3", "bf16-fp32-comm", "bf16-clip", "fp16-loss-scale", "keep-grad-partitions",
                                  "small-bucket", "small-bucket-bf16-fp32-comm"])
def test_gradient_path_on_gpu(case, world):
    """NCCL, DeepSpeed's reduce stream and CUDA kernels: the same bits as stock (one rank: no collective,
    the same arithmetic; two: a two-operand sum, the same in any order)."""
    results = run_on_ranks(train_both, world_size=world, backend="nccl", case=case, timeout=400)
    worst = max((abs(a - b) / abs(a) for r in results for a, b in zip(r["stock_norms"], r["z3_norms"])
                 if a is not None and b is not None and a not in (0.0, b)), default=0.0)
    print(f"[{case}, {world} GPU] largest relative difference of the gradient norm from stock's: {worst:.3e}")
    check(results, case, norm_rtol=1e-9)


def held_in_backward(width=1024, layers=8, probe=5):
    """Bytes a rank holds (glibc's count, tests/test_true_release.py) when backward reaches layer `probe`'s
    output, over what it held as the step began, with the gradient partitions freed between steps (the
    default) and kept (stock's); the third step, so that a freed window follows a step."""
    import gc
    import torch
    import torch.nn as nn
    from tests.models import build_engine, ds_config
    from tests.test_true_release import _in_use_bytes
    from deepspeed_z3ext import grad_stats

    seen = []

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))

        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i == probe and x.requires_grad:
                    x.register_hook(lambda g: seen.append(_in_use_bytes()))
            return x.square().mean()

    out = {}
    for free in (True, False):
        z3ext = {"enabled": True, "free_grad_partitions": free}
        # one layer's gradient per bucket: a flush per layer as backward goes
        cfg = ds_config(z3ext=z3ext, persistence=0, mel=False, ga=1, zero_extra={"reduce_bucket_size": width * width})
        eng = build_engine(cfg, model_fn=Stack)
        deltas = []
        for step in range(3):
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
            gc.collect()
            before = _in_use_bytes()
            seen.clear()
            eng.backward(eng(x))
            deltas.append(seen[0] - before)
            eng.step()
        out[free] = dict(deltas=deltas, pieces=grad_stats(eng).partition_pieces,
                         buffer=eng.optimizer.grad_partitions_flat_buffer.numel() * 4)
        eng.destroy()
        gc.collect()
    return out


def test_gradient_partitions_held_in_backward_only_as_they_reduce():
    """[Note: partitions as they reduce]: between steps the partitions are freed; in the next backward a rank
    holds only those of the layers reduced so far, not the whole buffer (8 layers of 2 MiB per rank here, at most
    2 reduced when measured; glibc's count moves by about 1 MiB between steps of the same program)."""
    for rank, r in enumerate(run_on_ranks(held_in_backward, timeout=300)):
        layer = r[True]["buffer"] // 8
        extra = r[True]["deltas"][2] - r[False]["deltas"][2]  # freed minus kept, at the same point of backward
        assert r[True]["pieces"] > 0 and r[False]["pieces"] == 0, (rank, r)
        assert extra <= 3 * layer, (rank, extra, layer, r)  # the whole buffer would be 8 layers
