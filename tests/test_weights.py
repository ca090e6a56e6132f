"""`full_weights` (weights.py) on 2 real gloo ranks, for a z3ext and a stock ZeRO-3 engine (persistent and
partitioned parameters) after training steps: every (name, tensor) is bitwise GatheredParameters' for that
parameter, in module order; buckets stay within `bucket_bytes` (or are one oversized parameter); DeepSpeed's
comms logger records one all-gather per bucket and nothing else; the tensors alive in the process (each
storage once) exceed what they were before by at most two buckets at every yield, and by nothing after;
streaming inside a GatheredParameters block or between a forward and its backward, breaking out, or
raising in the loop body leaves every parameter as gathered as it was, and the engine trains on bitwise
equal to a twin that never streamed. Without ranks: bad input, and modules that are not ZeRO-3 partitioned
(passed through)."""
import pytest
import torch

from tests.harness import on_gpu, run_on_ranks

BUDGETS = (4096, 20000, 1 << 30)  # TinyGPT: most parameters above, a few per bucket, one bucket


def _live_bytes():
    """Bytes of the storages of every floating-point tensor Python can reach now, each storage once. Not integer
    tensors: the descriptors exchanged before each collective ([Note: agree before the collective]) are int64, and
    gloo's finished async work may still hold one for a moment (80 bytes at a yield, seen once on a loaded machine)."""
    import gc
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.is_floating_point():  # type(): isinstance reads deprecated proxies
            try:
                s = o.untyped_storage()
                if s.nbytes():
                    storages[s.data_ptr()] = max(s.nbytes(), storages.get(s.data_ptr(), 0))
            except Exception:  # a released z3ext storage raises on access: it holds no memory
                pass
    return sum(storages.values())


def _collectives():
    """Records of DeepSpeed's comms logger so far, by op."""
    from deepspeed import comm
    return {op: sum(r[0] for r in sizes.values()) for op, sizes in comm.comms_logger.comms_dict.items()}


def _held(engine, z3ext):
    """What is gathered now: z3ext's live bytes and gathered names, or stock's per-parameter status."""
    if z3ext:
        import deepspeed_z3ext
        s = deepspeed_z3ext.stats(engine)
        return (s.live_bytes, sorted(s.gathered), s.collectives)
    return [str(p.ds_status) for p in engine.module.parameters()]


def _reference(engine):
    """Every parameter's full value through its own GatheredParameters block."""
    import deepspeed
    ref = {}
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters(p):
            ref[n] = p.detach().clone()
    return ref


def _check_bucket(bucket, ref):
    """(names, names whose tensor is not GatheredParameters', bytes) of one bucket; keeps none of its tensors."""
    wrong = [w.name for w in bucket if not (w.tensor.dtype == ref[w.name].dtype and w.tensor.shape == ref[w.name].shape
                                            and torch.equal(w.tensor, ref[w.name]))]
    nbytes = sum(w.tensor.numel() * w.tensor.element_size() for w in bucket)
    return [w.name for w in bucket], wrong, nbytes


def _stream(engine, ref, budget, names=None, stop_after=None, raise_after=None):
    """Streams once; returns what it saw, the comms logged and the extra live bytes at each yield."""
    import deepspeed_z3ext
    before, baseline = _collectives(), _live_bytes()
    seen, extra = [], []
    try:
        for i, bucket in enumerate(deepspeed_z3ext.full_weights(engine, bucket_bytes=budget, names=names)):
            seen.append(_check_bucket(bucket, ref))
            extra.append(_live_bytes() - baseline)
            if i + 1 == stop_after:
                break
            if i + 1 == raise_after:
                raise KeyError("consumer")
    except KeyError:
        pass
    after = _collectives()
    logged = {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}
    return dict(seen=seen, extra=extra, left=_live_bytes() - baseline, logged=logged)


def _padded(engine):
    """Each parameter's gathered bytes (its partition times the world): what its bucket's buffers hold of it."""
    import deepspeed
    world = deepspeed.comm.get_world_size()
    return {n: world * p.ds_tensor.ds_numel * p.ds_tensor.element_size() for n, p in engine.module.named_parameters()}


def _model():
    """TinyGPT with odd sizes (hidden 33: 99x33 qkv, 33-element norms): partitions padded on 2 ranks."""
    from tests.models import TinyGPT
    return TinyGPT(hidden=33, heads=3)


def _tokens(i, rank):
    from tests.models import batch
    b = batch(i, rank)
    return b.cuda() if on_gpu() else b


def stream_checks(kinds):
    import contextlib
    ctx = contextlib.nullcontext()
    if on_gpu():  # deterministic attention backward on GPU: the twin's bits
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(SDPBackend.MATH)
    with ctx:
        return _stream_checks(kinds)


def _stream_checks(kinds):
    import deepspeed
    import deepspeed.comm as dist
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train
    rank = dist.get_rank()
    dist.configure(enabled=True, prof_all=True)
    out = {}
    for z3ext in kinds:
        config = ds_config(z3ext=z3ext, persistence=100, ga=1)  # biases and norms persistent, weights partitioned
        engine, twin = build_engine(config, _model), build_engine(config, _model)
        res = dict(losses=[], twin=[], order=[n for n, _ in engine.module.named_parameters()], padded=_padded(engine),
                   padding=[n for n, p in engine.module.named_parameters() if 2 * p.ds_tensor.ds_numel != p.ds_numel])
        for e, key in ((engine, "losses"), (twin, "twin")):
            res[key] += train(e, 2, lambda i: _tokens(i, rank))
        ref = _reference(engine)
        held = _held(engine, z3ext)
        for budget in BUDGETS:
            res[budget] = _stream(engine, ref, budget)
        some = res["order"][1::3]
        res["names"] = (some, _stream(engine, ref, 20000, names=reversed(some)))
        res["held_after"] = (held, _held(engine, z3ext))
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())[:3]):
            held = _held(engine, z3ext)
            res["in_block"] = _stream(engine, ref, 20000)
            res["held_in_block"] = (held, _held(engine, z3ext))
        # Between a forward and its backward (z3ext holds the forward's parameters for it), broken out of
        # and raised out of: nothing changes, and training goes on as the twin's.
        loss, twin_loss = engine(_tokens(2, rank)), twin(_tokens(2, rank))
        held = _held(engine, z3ext)
        res["mid_step"] = _stream(engine, ref, 20000)
        res["break"] = _stream(engine, ref, 4096, stop_after=2)
        res["raise"] = _stream(engine, ref, 20000, raise_after=1)
        res["held_mid_step"] = (held, _held(engine, z3ext))
        for e, loss_, key in ((engine, loss, "losses"), (twin, twin_loss, "twin")):
            e.backward(loss_)
            e.step()
            res[key].append(loss_.item())
            res[key] += train(e, 1, lambda i: _tokens(i, rank), first_step=3)
        mine, theirs = full_params(engine), full_params(twin)
        res["params_differ"] = [n for n in mine if not torch.equal(mine[n], theirs[n])]
        out[z3ext] = res
        engine.destroy()
        twin.destroy()
    return out


def _assert_stream(where, r, budget, padded, order, stop=None):
    """`stop`: the consumer left after that many buckets, the next one's gather in flight."""
    buckets, full = [s[0] for s in r["seen"]], [s[2] for s in r["seen"]]
    held = [sum(padded[n] for n in b) for b in buckets]
    assert not [n for s in r["seen"] for n in s[1]], f"{where}: not GatheredParameters' values: {r['seen']}"
    names = [n for b in buckets for n in b]
    assert names == (order if stop is None else order[:len(names)]) and (stop is None or len(buckets) == stop), \
        f"{where}: order {names}"
    over = [(b, f, h) for b, f, h in zip(buckets, full, held) if max(f, h) > budget and len(b) > 1]
    assert not over, f"{where}: buckets over {budget} bytes: {over}"
    assert r["logged"] == {"all_gather_into_tensor": len(buckets) + (stop is not None)}, \
        f"{where}: {len(buckets)} buckets, logged {r['logged']}"
    # At each yield the process holds the bucket yielded and the next one's gather buffer (gathered
    # ahead), no more: two buckets.
    for k, extra in enumerate(r["extra"]):
        if k + 1 < len(buckets) or stop is None:
            low, high = full[k] + sum(full[k + 1:k + 2]), held[k] + sum(held[k + 1:k + 2])
        else:  # the next bucket is in flight but was not seen: at most one budget or one parameter
            low, high = full[k] + 1, held[k] + max(budget, max(padded.values()))
        assert low <= extra <= high, f"{where}: {extra} bytes live at bucket {k}, not within [{low}, {high}]"
    assert r["left"] == 0, f"{where}: {r['left']} bytes left allocated"


def test_full_weights_on_two_ranks():
    _check_results(run_on_ranks(stream_checks, kinds=[True, False], timeout=600))


@pytest.mark.gpus(2)
def test_full_weights_on_two_gpus():
    """NCCL: the gather in place on its stream, a waited-for buffer freed while its work may still hold it."""
    _check_results(run_on_ranks(stream_checks, backend="nccl", kinds=[True, False], timeout=600))


def _check_results(results):
    for rank, out in enumerate(results):
        for z3ext, r in out.items():
            where = f"rank {rank}, {'z3ext' if z3ext else 'stock'}"
            order, padded = r["order"], r["padded"]
            assert r["padding"], f"{where}: no partition padded"
            for budget in BUDGETS:
                _assert_stream(f"{where}, {budget} bytes", r[budget], budget, padded, order)
            counts = [len(r[b]["seen"]) for b in BUDGETS]
            assert counts[0] > counts[1] > counts[2] == 1, f"{where}: buckets per budget {counts}"
            some, named = r["names"]
            _assert_stream(f"{where}, names", named, 20000, padded, some)
            _assert_stream(f"{where}, in a GatheredParameters block", r["in_block"], 20000, padded, order)
            _assert_stream(f"{where}, between forward and backward", r["mid_step"], 20000, padded, order)
            # Broken out after 2 buckets: the third's gather was in flight (logged), and is waited for.
            _assert_stream(f"{where}, broken out", r["break"], 4096, padded, order, stop=2)
            _assert_stream(f"{where}, raised out", r["raise"], 20000, padded, order, stop=1)
            assert r["held_after"][0] == r["held_after"][1], f"{where}: gathered state changed: {r['held_after']}"
            for when in ("held_in_block", "held_mid_step"):
                assert r[when][0] == r[when][1], f"{where}: gathered state changed ({when}): {r[when]}"
            assert r["losses"] == r["twin"] and not r["params_differ"], \
                f"{where}: differs from a twin that never streamed: {r['losses']} vs {r['twin']}, {r['params_differ']}"
            if not z3ext:  # stock: partitioned parameters stayed NOT_AVAILABLE, persistent ones AVAILABLE
                assert "ZeroParamStatus.NOT_AVAILABLE" in r["held_after"][1]


def world_one_checks():
    """One rank: partitions are the whole parameters, still gathered (over a group of one) per bucket."""
    import deepspeed.comm as dist
    from tests.models import batch, build_engine, ds_config
    from tests.training import train
    dist.configure(enabled=True, prof_all=True)
    engine = build_engine(ds_config(z3ext=True, persistence=100, ga=1), _model)
    train(engine, 1, lambda i: batch(i, 0))
    ref = _reference(engine)
    out = {budget: _stream(engine, ref, budget) for budget in (4096, 1 << 30)}
    out.update(order=[n for n, _ in engine.module.named_parameters()], padded=_padded(engine))
    return out


def test_full_weights_on_one_rank():
    r = run_on_ranks(world_one_checks, world_size=1, timeout=300)[0]
    for budget in (4096, 1 << 30):
        _assert_stream(f"one rank, {budget} bytes", r[budget], budget, r["padded"], r["order"])


# ------------------------------------------------------------------------------------- without ranks
@pytest.mark.parametrize("bad", [0, -1, 0.0, True, None, "1e6"])
def test_bucket_bytes_must_be_positive(bad):
    import deepspeed_z3ext
    with pytest.raises(ValueError, match="bucket_bytes") as e:
        deepspeed_z3ext.full_weights(torch.nn.Linear(2, 2), bucket_bytes=bad)
    assert isinstance(e.value, deepspeed_z3ext.WeightsError) and isinstance(e.value, deepspeed_z3ext.Z3extError)


def test_bad_names_and_inputs():
    import deepspeed_z3ext
    with pytest.raises(ValueError, match="nope"):
        deepspeed_z3ext.full_weights(torch.nn.Linear(2, 2), bucket_bytes=100, names=["weight", "nope"])
    with pytest.raises(ValueError, match="torch.nn.Module"):
        deepspeed_z3ext.full_weights({"weight": torch.ones(2)}, bucket_bytes=100)


def test_module_not_partitioned_passes_through():
    """A module of no ZeRO-3 engine: its parameters themselves, in buckets of one dtype within the budget
    (a larger parameter alone); a bucket's list is emptied when the next one is requested."""
    import deepspeed_z3ext
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16), torch.nn.Linear(4, 4))
    params = dict(m.named_parameters())
    buckets = [list(b) for b in deepspeed_z3ext.full_weights(m, bucket_bytes=100)]
    # 0.weight 256 bytes alone, 0.bias 32; bf16 1.* 64 + 8; fp32 2.* 64 + 16
    assert [[w.name for w in b] for b in buckets] == [["0.weight"], ["0.bias"], ["1.weight", "1.bias"],
                                                       ["2.weight", "2.bias"]]
    for b in buckets:
        for w in b:
            assert w.tensor.data_ptr() == params[w.name].data_ptr() and w.tensor.dtype == params[w.name].dtype
            assert not w.tensor.requires_grad
    stream = deepspeed_z3ext.full_weights(m, bucket_bytes=40, names=["2.bias", "0.bias"])
    first = next(stream)
    assert [w.name for w in first] == ["0.bias"]
    second = next(stream)
    assert first == [] and [w.name for w in second] == ["2.bias"]
    assert list(stream) == [] and second == []


def rank_zero_only_export():
    """A step, then rank 0 streams full_weights while rank 1 trains on ([Note: full_weights is a z3ext collective]
    in weights.py): every rank must raise a z3ext error naming full_weights."""
    import deepspeed
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import TinyGPT
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "z3ext": True,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = TinyGPT()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(tokens))
    engine.step()
    try:
        if dist.get_rank() == 0:
            for bucket in deepspeed_z3ext.full_weights(engine, bucket_bytes=1 << 20):
                bucket.clear()
        else:
            engine.backward(engine(tokens))
            engine.step()
    except deepspeed_z3ext.Z3extError as e:
        return type(e).__name__, str(e).splitlines()[0]
    return None


def test_full_weights_on_rank_zero_alone_raises_on_every_rank():
    for rank, r in enumerate(run_on_ranks(rank_zero_only_export, timeout=300)):
        assert r is not None, f"rank {rank}: no z3ext error"
        assert r[0] == "ScheduleMismatchError" and "full_weights" in r[1], f"rank {rank}: {r}"
