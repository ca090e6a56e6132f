"""A bf16 or fp16 parameter's partition is its fp32 master ([Note: partition is the master] in master.py), on
real gloo ranks against stock ZeRO-3 on the same seed:
- bf16 and fp16 (with gradient accumulation; fp16 also on 4 ranks), and bf16 with ZeRO++ hpZ on 4 ranks as 2
  nodes: losses, gathered parameters and fp32 masters bitwise stock's; every trainable partition is its master
  and stock's low-precision buffer is gone;
- what a rank holds: glibc's in-use bytes after `deepspeed.initialize`, the same model and data, z3ext with
  and without `partition_from_master`: 2 bytes per trainable element and rank less;
- a weight written in a GatheredParameters block with `modifier_rank` after initialization trains from the
  written value, as the unsharded model would (stock's next step puts its old master back);
- `offload_states` of `lp_params` and `reload_states` in the middle of training: stock's numbers after;
- a checkpoint saved after a step and loaded into a fresh engine: the saved masters, stock's numbers after;
- `destroy` gives every parameter a partition of its own dtype back."""
import pytest

from tests.harness import on_gpu, run_on_ranks

STEPS, GA = 3, 2


def _engine(dtype, z3ext, zero_extra=None, hidden=42, model=None, hpz_group=False):
    import torch
    import deepspeed
    from deepspeed.utils import groups
    from tests.models import TinyGPT, build_engine, ds_config
    cfg = ds_config(z3ext=z3ext, persistence=0, mel=False, ga=GA, extra={dtype: {"enabled": True}},
                    zero_extra=zero_extra)
    if model is None:
        torch.manual_seed(1234)
        kw = dict(zero_param_parallel_group=groups._get_zero_param_intra_parallel_group()) if hpz_group else {}
        with deepspeed.zero.Init(config_dict_or_path=cfg, **kw):
            model = TinyGPT(hidden=hidden, heads=3)
    return build_engine(cfg, model=model)


def _masters(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).cpu().numpy().copy() for n, p in engine.module.named_parameters()}


def _aliased(engine):
    """(trainable parameters whose partition is in the master's storage, trainable parameters, elements of
    stock's low-precision buffer)."""
    opt = engine.optimizer
    masters = {t.untyped_storage().data_ptr() for t in opt.fp32_partitioned_groups_flat}
    trainable = [p for g in opt.fp16_groups for p in g]
    views = sum(p.ds_tensor.untyped_storage().data_ptr() in masters for p in trainable)
    return views, len(trainable), opt.lp_param_buffer.numel()


def same_as_stock(dtype, hpz=False):
    import numpy as np
    import torch.distributed as dist
    from tests.models import batch, full_params
    from tests.training import train
    rank = dist.get_rank()
    zero_extra = {"zero_hpz_partition_size": 2} if hpz else None
    out = {}
    for name, z3ext in (("stock", False), ("z3ext", True)):
        engine = _engine(dtype, z3ext, zero_extra, hpz_group=hpz)
        aliased = _aliased(engine)
        losses = train(engine, STEPS, lambda i: batch(i, rank).cuda() if on_gpu() else batch(i, rank), ga=GA)
        params = {n: p.float().cpu().numpy() for n, p in full_params(engine).items()}
        out[name] = dict(losses=losses, params=params, masters=_masters(engine), aliased=aliased,
                         dtypes={str(p.dtype) for p in engine.module.parameters()})
        engine.destroy()
    s, z = out["stock"], out["z3ext"]
    return dict(losses=(s["losses"], z["losses"]), aliased=(s["aliased"], z["aliased"]), dtypes=z["dtypes"],
                params=[n for n in s["params"] if not np.array_equal(s["params"][n], z["params"][n])],
                masters=[n for n in s["masters"] if not np.array_equal(s["masters"][n], z["masters"][n])])


def _fp16_refused_on_cpu() -> bool:
    """DeepSpeed's CPU accelerator refuses an fp16 config where oneDNN has no fp16 (`is_fp16_supported`: AMD EPYC
    hosts, for one), at `deepspeed.initialize`, stock and z3ext alike."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    return acc.device_name() == "cpu" and not acc.is_fp16_supported()


_NO_FP16 = pytest.mark.skipif(_fp16_refused_on_cpu(), reason="DeepSpeed refuses fp16 on this CPU (oneDNN without fp16)")


@pytest.mark.parametrize("dtype,world", [("bf16", 2), pytest.param("fp16", 2, marks=_NO_FP16), ("bf16-hpz", 4)])
def test_partition_is_the_master_bitwise_equal_to_stock(dtype, world):
    hpz = dtype.endswith("-hpz")
    results = run_on_ranks(same_as_stock, world_size=world, timeout=420, dtype=dtype.split("-")[0], hpz=hpz)
    for rank, r in enumerate(results):
        assert r["losses"][0] == r["losses"][1], (rank, r["losses"])
        assert not r["params"] and not r["masters"], (rank, r["params"], r["masters"])
        (stock_views, n, stock_lp), (views, n_z3, lp) = r["aliased"]
        assert stock_views == 0 and stock_lp > 0, r["aliased"]  # stock: its own bf16 partitions
        assert views == n == n_z3 and lp == 0, r["aliased"]
        assert r["dtypes"] == {"torch.bfloat16" if dtype.startswith("bf16") else "torch.float16"}, r["dtypes"]


def allow_fp16_on_cpu():
    """Where DeepSpeed's CPU accelerator refuses fp16 at `deepspeed.initialize` (oneDNN without fp16), only that
    check is passed over, in this process; torch's CPU fp16 arithmetic is the same for stock and z3ext."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if acc.device_name() == "cpu" and not acc.is_fp16_supported():
        type(acc).is_fp16_supported = lambda self: True


def fp16_past_the_cpu_check():
    """`same_as_stock` in fp16 on any CPU (`allow_fp16_on_cpu`)."""
    allow_fp16_on_cpu()
    return same_as_stock("fp16")


def test_fp16_partition_is_the_master_on_four_ranks():
    """fp16 with loss scaling and gradient accumulation as 4 gloo ranks: losses, gathered parameters and fp32
    masters stock's bits, every trainable partition its master (4 ranks sum in an order 2 ranks do not show)."""
    for rank, r in enumerate(run_on_ranks(fp16_past_the_cpu_check, world_size=4, timeout=420)):
        assert r["losses"][0] == r["losses"][1], (rank, r["losses"])
        assert not r["params"] and not r["masters"], (rank, r["params"], r["masters"])
        assert r["aliased"][1][0] == r["aliased"][1][1] and r["aliased"][1][2] == 0, r["aliased"]
        assert r["dtypes"] == {"torch.float16"}, r["dtypes"]


@pytest.mark.gpus(2)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_partition_is_the_master_on_gpu(dtype):
    """The CUDA cast of a bucket's master slices (one multi-tensor copy) and NCCL: stock's bits."""
    results = run_on_ranks(same_as_stock, world_size=2, backend="nccl", timeout=420, dtype=dtype)
    for rank, r in enumerate(results):
        assert r["losses"][0] == r["losses"][1], (rank, r["losses"])
        assert not r["params"] and not r["masters"], (rank, r["params"], r["masters"])
        assert r["aliased"][1][0] == r["aliased"][1][1] and r["aliased"][1][2] == 0, r["aliased"]


def held_after_initialize(width=1024, layers=8):
    """glibc in-use bytes a rank holds after deepspeed.initialize (model built under zero.Init first), for z3ext
    with and without partition_from_master, each engine destroyed before the next is built; a first engine
    warms up what a process allocates once."""
    import gc
    import torch
    import deepspeed
    from tests.models import build_engine, ds_config
    from tests.test_true_release import _in_use_bytes
    out = {}
    for name in ("warm-up", "lp-kept", "from-master"):
        cfg = ds_config(z3ext={"enabled": True, "partition_from_master": name == "from-master"}, persistence=0,
                        ga=1, extra={"bf16": {"enabled": True}}, zero_extra={"reduce_bucket_size": 10**6})
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        gc.collect()
        before = _in_use_bytes()
        engine = build_engine(cfg, model=model)
        gc.collect()
        out[name] = _in_use_bytes() - before
        trainable = sum(p.ds_tensor.ds_numel for p in engine.module.parameters())
        engine.destroy()
        del engine, model
        gc.collect()
    return out, trainable


def test_a_rank_holds_two_bytes_less_per_element():
    for rank, (held, partition) in enumerate(run_on_ranks(held_after_initialize, world_size=2, timeout=300)):
        saved = held["lp-kept"] - held["from-master"]
        # 2 bytes per element of this rank's partitions (4.2M elements: 8.4 MB), within 5 %.
        assert abs(saved - 2 * partition) < 0.05 * 2 * partition, (rank, held, partition)


def written_weight_trains(z3ext):
    """Halves every weight in a GatheredParameters block (rank 0 writes) after the first step, then trains
    with lr 0: the unsharded model keeps the halved weights."""
    import torch
    import deepspeed
    import torch.distributed as dist
    from tests.models import batch, full_params
    from tests.training import train
    rank = dist.get_rank()
    engine = _engine("bf16", z3ext)
    train(engine, 1, lambda i: batch(i, rank), ga=GA)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            for p in params:
                p.data.mul_(0.5)
    written = {n: p.float().numpy() for n, p in full_params(engine).items()}
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    train(engine, 1, lambda i: batch(i, rank), ga=GA, first_step=1)
    after = {n: p.float().numpy() for n, p in full_params(engine).items()}
    masters = _masters(engine)
    engine.destroy()
    import numpy as np
    return ([n for n in written if not np.array_equal(written[n], after[n])],
            [n for n in written if not np.array_equal(written[n], masters[n])])


def test_a_written_weight_trains_from_the_written_value():
    for rank, (changed, masters) in enumerate(run_on_ranks(written_weight_trains, world_size=2, timeout=300,
                                                           z3ext=True)):
        assert not changed and not masters, (rank, changed, masters)


def offload_round_trip():
    import numpy as np
    import torch.distributed as dist
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from tests.models import batch, full_params
    from tests.training import train
    rank = dist.get_rank()
    out = {}
    for name, z3ext in (("stock", False), ("z3ext", True)):
        engine = _engine("bf16", z3ext)
        losses = train(engine, 1, lambda i: batch(i, rank), ga=GA)
        engine.optimizer.offload_states(include=[OffloadStateTypeEnum.lp_params], device=OffloadDeviceEnum.cpu,
                                        pin_memory=False)
        offloaded = sorted(str(s) for s in engine.optimizer.offloaded_states)
        engine.optimizer.reload_states()
        losses += train(engine, 2, lambda i: batch(i, rank), ga=GA, first_step=1)
        out[name] = dict(losses=losses, offloaded=offloaded,
                         params={n: p.float().numpy() for n, p in full_params(engine).items()},
                         after=[str(p.ds_tensor.dtype) for p in engine.module.parameters()])
        engine.destroy()
        out[name]["given_back"] = sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()})
    s, z = out["stock"], out["z3ext"]
    return dict(losses=(s["losses"], z["losses"]), offloaded=(s["offloaded"], z["offloaded"]),
                params=[n for n in s["params"] if not np.array_equal(s["params"][n], z["params"][n])],
                given_back=z["given_back"], after=sorted(set(z["after"])))


def test_offload_states_of_lp_params_and_destroy():
    for rank, r in enumerate(run_on_ranks(offload_round_trip, world_size=2, timeout=300)):
        assert r["losses"][0] == r["losses"][1] and not r["params"], (rank, r)
        assert r["offloaded"][0] == r["offloaded"][1] == ["OffloadStateTypeEnum.lp_params"], r["offloaded"]
        assert r["after"] == ["torch.float32"], r["after"]  # the partitions view the masters again
        assert r["given_back"] == ["torch.bfloat16"], r["given_back"]


def checkpoint_round_trip(tmp):
    """bf16: 1 step, save, a fresh engine loads every state, 2 more steps; stock and z3ext."""
    import numpy as np
    import torch.distributed as dist
    from tests.models import batch, full_params
    from tests.training import train
    rank = dist.get_rank()
    out = {}
    for name, z3ext in (("stock", False), ("z3ext", True)):
        folder = f"{tmp}/{name}"
        engine = _engine("bf16", z3ext)
        losses = train(engine, 1, lambda i: batch(i, rank), ga=GA)
        engine.save_checkpoint(folder, tag="t")
        saved = _masters(engine)
        engine.destroy()
        engine = _engine("bf16", z3ext)  # the same seed: the same initial values as the first
        engine.load_checkpoint(folder, tag="t")
        loaded = _masters(engine)
        losses += train(engine, 2, lambda i: batch(i, rank), ga=GA, first_step=1)
        out[name] = dict(losses=losses, saved=saved, loaded=loaded, masters=_masters(engine),
                         params={n: p.float().numpy() for n, p in full_params(engine).items()})
        engine.destroy()
    s, z = out["stock"], out["z3ext"]
    differ = lambda a, b: [n for n in a if not np.array_equal(a[n], b[n])]  # noqa: E731
    return dict(losses=(s["losses"], z["losses"]), params=differ(s["params"], z["params"]),
                masters=differ(s["masters"], z["masters"]), z3ext_reloaded=differ(z["saved"], z["loaded"]),
                stock_reloaded=differ(s["saved"], s["loaded"]))


def test_checkpoint_round_trip_bitwise_equal_to_stock(tmp_path):
    for rank, r in enumerate(run_on_ranks(checkpoint_round_trip, world_size=2, timeout=300, tmp=str(tmp_path))):
        assert r["losses"][0] == r["losses"][1] and not r["params"] and not r["masters"], (rank, r)
        assert not r["z3ext_reloaded"] and not r["stock_reloaded"], r



def deepcompiled():
    import torch
    from tests.test_compile import _as_if_deepcompiled
    engine = _engine("bf16", True)
    before = _aliased(engine)
    _as_if_deepcompiled(engine)  # DeepCompile's init_z3 builds its fallback before it registers the partitions
    opt = engine.optimizer
    after = _aliased(engine)
    dtypes = sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()})
    cast = all(torch.equal(lp, hp.to(torch.bfloat16))
               for lp, hp in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat))
    engine.destroy()
    return before, after, dtypes, cast


def test_deepcompile_gets_low_precision_partitions_again():
    """DeepCompile's own gathers read `ds_tensor` as the parameter's dtype: taking the engine over casts the
    masters into low-precision flats again (on CPU: the engine put in the state `engine.compile()` leaves)."""
    for rank, (before, after, dtypes, cast) in enumerate(run_on_ranks(deepcompiled, world_size=2, timeout=300)):
        assert before[0] == before[1] > 0 and after[0] == 0, (rank, before, after)
        assert dtypes == ["torch.bfloat16"] and cast, (rank, dtypes, cast)
