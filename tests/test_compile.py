"""DeepCompile's eager fallback on z3ext claims (fallback.py).

CPU (2 gloo ranks, real ZeRO-3 engines): DeepCompile itself needs CUDA, so `_as_if_deepcompiled`
puts a real engine in the state `engine.compile()` leaves it in for gather/release (DeepSpeed's module
and gradient hooks removed, the eager fallback built through DeepCompile's own constructor and
post-backward hook, the engine marked DeepCompile-active) and runs the model eagerly: every frame is
then a frame Dynamo skipped, and `engine.forward`/`engine.backward` drive the fallback exactly as they
do under DeepCompile. Results are compared with stock eager ZeRO-3 from the same seed.

GPU (`-m gpu`, 2 GPUs, NCCL): DeepCompile actually enabled, a `torch.compiler.disable`d submodule,
persistence off and every parameter above the default persistence threshold.
"""
import pytest
import torch

from tests.harness import run_on_ranks, skip_on_one_gpu


def _batch(i):
    import torch.distributed as dist
    from tests.models import batch
    return batch(i, dist.get_rank())


class _NoNativeHandle:
    """DeepCompile's native op (CUDA only) is asked to start a backward for its compiled graphs;
    there are none here."""

    def start_backward(self, update):
        pass


def _as_if_deepcompiled(engine):
    """What `engine.compile()` with DeepCompile changes about gather and release, without compiling.
    (init_z3 also un-patches DeepSpeed's memory-efficient F.linear: the CPU engines never patch it.)"""
    from deepspeed.compile import util as dc_util
    from deepspeed.compile.z3_eager_fallback import DeepCompileZ3EagerFallback
    dc_util.get_deepcompile_handle = _NoNativeHandle
    opt = engine.optimizer
    fallback = DeepCompileZ3EagerFallback(engine)  # as init_z3 builds it
    engine._deepcompile_z3_eager_fallback = fallback
    dc_util.add_post_backward_hook(fallback.complete_backward)
    opt.parameter_offload._remove_module_hooks()
    for hook in opt._grad_acc_hooks:
        hook.remove()
    opt._grad_acc_hooks.clear()
    partitions = getattr(opt, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")

    def optimizer_reads_partitions(_boundary):  # DeepCompile's pre-backward hook does this
        for i, group in enumerate(opt.fp16_groups):
            opt.averaged_gradients[i] = [partitions[p.ds_id] for p in group]

    dc_util.add_pre_backward_hook(optimizer_reads_partitions)
    for p in engine.module.parameters():
        p.ds_persist = False
    import torch._inductor.config
    torch._inductor.config.size_asserts = False  # init_z3 sets it for the whole process
    engine._set_deepcompile_active(True)
    return fallback


def _claims(engine, name):
    import deepspeed_z3ext
    return sorted(deepspeed_z3ext.stats(engine).claims.get(name, []))


def _fallback_claimed(engine):
    import deepspeed_z3ext
    return {n: c for n, c in deepspeed_z3ext.stats(engine).claims.items() if any(k == "fallback" for k, _ in c)}


# --------------------------------------------------------------------------- (1)-(5) bookkeeping
def bookkeeping():
    import types
    import torch
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from deepspeed_z3ext.fallback import Z3extEagerFallback
    from tests.models import build_engine, ds_config, full_params
    eng = build_engine(ds_config(z3ext=True, persistence=100, mel=False, ga=1))
    fb = _as_if_deepcompiled(eng)
    out = {"is_z3ext_fallback": isinstance(fb, Z3extEagerFallback)}
    m = eng.module
    W, W_name = m.blocks[0].fc1.weight, "blocks.0.fc1.weight"
    at_forward_start = []
    m.register_forward_pre_hook(lambda mod, args: at_forward_start.append(_fallback_claimed(eng)))

    # (1) a parameter read by the skipped frame: fallback claim of this graph, held through backward
    loss = eng(_batch(0))
    out["fwd_claims"] = _claims(eng, W_name)
    out["fwd_graphs"] = fb.stats().graphs
    during = []
    h = W.register_hook(lambda g: during.append((W.ds_status.name, tuple(W.shape))))
    eng.backward(loss)
    h.remove()
    out["during_backward"] = during
    out["after_backward"] = (W.ds_status.name, _claims(eng, W_name), W.grad is None)
    out["after_backward_fallback_claimed"] = _fallback_claimed(eng)
    out["stats_after_first"] = fb.stats()._asdict()
    eng.step()

    # (2) a lookup by Dynamo's guard evaluation (a frame of torch._dynamo.guards) does not gather
    fc2 = m.blocks[0].fc2
    guard_lookup = types.FunctionType(compile("mod._parameters['weight']", "<guard>", "eval"), {
        "__name__": "torch._dynamo.guards",
        "mod": fc2
    })
    seen = []

    def probe(mod, args):
        before = fb.stats().guard_lookups
        p = guard_lookup()
        status, n = p.ds_status.name, fb.stats().guard_lookups - before
        seen.append((p is fc2.weight, status, n))  # fc2.weight here is an eager read: it gathers

    hp = fc2.register_forward_pre_hook(probe)
    loss = eng(_batch(1))
    hp.remove()
    out["guard"] = seen
    out["fc2_after_real_read"] = fc2.weight.ds_status.name
    eng.backward(loss)
    eng.step()

    # (3) eval forward and an abandoned loss: released before the next outermost forward
    at_forward_start.clear()
    with torch.no_grad():
        eng.eval()
        eng(_batch(2))
        eng.train()
    out["eval_left"] = _claims(eng, W_name)
    eng(_batch(3))  # abandoned: grad-bearing, backward never runs
    out["abandoned_graphs"] = fb.stats().graphs
    loss = eng(_batch(4))
    out["at_forward_start"] = at_forward_start[1:]  # before the abandoned one and before the last one
    eng.backward(loss)
    eng.step()
    out["after_abandon_cycle"] = _fallback_claimed(eng)

    # two forwards, one loss: the first graph's claims were dropped by the second forward; its
    # backward gathers them again before any eager node reads them
    before = fb.stats().regathered_params
    m.skip = (1, )  # the first forward reads block 0, the second block 1: block 0 is released between
    first = eng(_batch(5))
    m.skip = (0, )
    loss = first + eng(_batch(6))
    m.skip = ()
    eng.backward(loss)
    eng.step()
    out["shared_regathered"] = fb.stats().regathered_params - before
    out["shared_left"] = _fallback_claimed(eng)

    # (4) GatheredParameters between forward and backward: claims, not ownership transfer
    truth = full_params(eng)
    loss = eng(_batch(7))
    with GatheredParameters([W]):
        out["gp_inside"] = _claims(eng, W_name)
        out["gp_norm"] = W.detach().float().norm().item()
    out["gp_after_exit"] = (W.ds_status.name, _claims(eng, W_name))
    eng.backward(loss)
    out["gp_after_backward"] = (W.ds_status.name, _claims(eng, W_name))
    out["true_norm"] = truth[W_name].float().norm().item()
    # ... and a block around the forward: the frame's claim outlives the block, until backward
    with GatheredParameters([W]):
        loss = eng(_batch(8))
    out["gp_around_after_exit"] = (W.ds_status.name, _claims(eng, W_name))
    eng.backward(loss)
    out["gp_around_after_backward"] = W.ds_status.name
    eng.step()

    # (5) parameters others keep gathered: a direct all_gather of a parameter the frame never reads,
    # persistent parameters (re-gathered by the optimizer after its step)
    m.skip = (1, )
    W2, W2_name = m.blocks[1].fc2.weight, "blocks.1.fc2.weight"
    W2.all_gather()
    for i in range(2):
        loss = eng(_batch(9 + i))
        eng.backward(loss)
    out["direct_kept"] = (W2.ds_status.name, _claims(eng, W2_name))
    persistent = [n for n, p in m.named_parameters() if p.ds_numel < 100]
    out["persistent_states"] = sorted({dict(m.named_parameters())[n].ds_status.name for n in persistent})
    out["persistent_claim_kinds"] = sorted({k for n in persistent for k, _ in _claims(eng, n)})
    W2.partition()
    eng.step()
    m.skip = ()
    out["final_fallback_claimed"] = _fallback_claimed(eng)
    out["final_stats"] = fb.stats()._asdict()

    # (3) a backward that raises never completes: its claims go at the next outermost forward
    loss = eng(_batch(11))
    h = W.register_hook(_raise_boom)
    try:
        eng.backward(loss)
    except Boom:
        pass
    h.remove()
    out["after_failed_backward"] = (fb.stats().graphs, bool(_fallback_claimed(eng)))
    at_forward_start.clear()
    with torch.no_grad():
        eng(_batch(12))
    out["failed_backward_next_forward"] = at_forward_start
    return out


class Boom(Exception):
    pass


def _raise_boom(grad):
    raise Boom("inside backward")


def test_fallback_claims_live_from_skipped_frame_to_backward_end():
    for r in run_on_ranks(bookkeeping):
        assert r["is_z3ext_fallback"]
        # (1)
        assert r["fwd_claims"] == [("fallback", 0)], r["fwd_claims"]
        assert r["fwd_graphs"] == {0: "AWAITING_BACKWARD"}
        assert r["during_backward"] == [("AVAILABLE", (128, 32))], r["during_backward"]
        assert r["after_backward"] == ("NOT_AVAILABLE", [], True), r["after_backward"]
        assert r["after_backward_fallback_claimed"] == {}
        s = r["stats_after_first"]
        assert s["gathered_params"] > 0 and s["reduced_grads"] > 0 and s["graphs"] == {}
        # (2)
        assert r["guard"] == [(True, "NOT_AVAILABLE", 1)], r["guard"]
        assert r["fc2_after_real_read"] == "AVAILABLE"
        # (3)
        assert r["eval_left"] and r["eval_left"][0][0] == "fallback"  # held until the next forward ...
        assert r["at_forward_start"] == [{}, {}], r["at_forward_start"]  # ... released before it runs
        assert list(r["abandoned_graphs"].values())[-1] == "AWAITING_BACKWARD"
        assert r["after_abandon_cycle"] == {}
        assert r["shared_regathered"] > 0 and r["shared_left"] == {}
        # (4)
        assert sorted(k for k, _ in r["gp_inside"]) == ["fallback", "gathered"]
        assert r["gp_norm"] == pytest.approx(r["true_norm"], rel=1e-6)
        assert r["gp_after_exit"][0] == "AVAILABLE" and [k for k, _ in r["gp_after_exit"][1]] == ["fallback"]
        assert r["gp_after_backward"] == ("NOT_AVAILABLE", [])
        assert r["gp_around_after_exit"][0] == "AVAILABLE"
        assert [k for k, _ in r["gp_around_after_exit"][1]] == ["fallback"]
        assert r["gp_around_after_backward"] == "NOT_AVAILABLE"
        # (5)
        assert r["direct_kept"] == ("AVAILABLE", [("direct", 0)]), r["direct_kept"]
        assert r["persistent_states"] == ["AVAILABLE"], r["persistent_states"]
        assert "fallback" not in r["persistent_claim_kinds"] and "persist" in r["persistent_claim_kinds"]
        assert r["final_fallback_claimed"] == {}
        assert r["final_stats"]["guard_lookups"] == 1
        assert list(r["after_failed_backward"][0].values()) == ["IN_BACKWARD"] and r["after_failed_backward"][1]
        assert r["failed_backward_next_forward"] == [{}], r["failed_backward_next_forward"]


# --------------------------------------------------------------------------- training equals stock
def train_equivalence():
    import torch
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train as train_steps

    def two_forwards_one_loss(eng, micro):
        # two forwards, one loss (the first graph's claims are re-taken at its backward)
        eng.module.skip = (1, )  # the two forwards read different blocks
        first = eng(_batch(100 + 2 * micro))
        eng.module.skip = (0, )
        loss = first + eng(_batch(101 + 2 * micro))
        eng.module.skip = ()
        return loss

    def train(eng, steps=3, ga=2):
        losses = train_steps(eng, steps, _batch, ga=ga)
        return train_steps(eng, 1, ga=ga, forward=two_forwards_one_loss, losses=losses)

    out = {}
    stock = build_engine(ds_config(persistence=0, mel=False))
    out["stock_losses"] = train(stock)
    stock_params = full_params(stock)
    z3 = build_engine(ds_config(z3ext=True, persistence=0, mel=False))
    fb = _as_if_deepcompiled(z3)
    out["z3_losses"] = train(z3)
    z3_params = full_params(z3)
    out["params_equal"] = [n for n in stock_params if not torch.equal(stock_params[n], z3_params[n])] or True
    out["max_diff"] = max((stock_params[n] - z3_params[n]).abs().max().item() for n in stock_params)
    out["stats"] = fb.stats()._asdict()

    # the same run with the fallback off fails in the first forward
    off = build_engine(ds_config(z3ext={"enabled": True, "compile_fallback": False}, persistence=0, mel=False))
    off_fb = _as_if_deepcompiled(off)
    try:
        off(_batch(0))
        out["off_error"] = None
    except Exception as e:
        out["off_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    out["off_stats"] = off_fb.stats()._asdict()
    return out


def test_training_through_the_fallback_equals_stock_zero3_and_fails_without_it():
    for r in run_on_ranks(train_equivalence):
        assert r["stats"]["gathered_params"] > 0 and r["stats"]["reduced_grads"] > 0
        assert r["stats"]["regathered_params"] > 0
        assert r["z3_losses"] == r["stock_losses"], (r["z3_losses"], r["stock_losses"])
        assert r["params_equal"] is True, (r["params_equal"], r["max_diff"])
        assert r["off_error"] is not None and r["off_stats"]["gathered_params"] == 0
        assert any(s in r["off_error"] for s in ("must be 2-D", "size", "shape")), r["off_error"]


# --------------------------------------------------------------------------- (6) per-engine state
def two_engines():
    import torch
    from deepspeed.compile import util as dc_util
    from deepspeed.compile import z3_eager_fallback as ds_fallback
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train as train_steps

    def train(eng, first, n=2):
        return train_steps(eng, n, _batch, first_step=first)

    cfg = ds_config(z3ext=True, persistence=0, mel=False, ga=1)
    solo = {}
    for name, seed, compiled in (("a", 1, True), ("b", 2, True), ("c", 3, False)):
        e = build_engine(cfg, seed=seed)
        if compiled:
            _as_if_deepcompiled(e)
        solo[name] = (train(e, 10 * seed, 4), full_params(e))
        e.destroy()
    import torch._inductor.config as inductor_config
    hooks_before = (len(dc_util.post_backward_hooks), len(dc_util.pre_backward_hooks))
    size_asserts_before = inductor_config.size_asserts
    engines = {"a": build_engine(cfg, seed=1), "b": build_engine(cfg, seed=2), "c": build_engine(cfg, seed=3)}
    fbs = {k: _as_if_deepcompiled(engines[k]) for k in ("a", "b")}
    losses = {k: [] for k in engines}
    for i in range(2):  # interleaved: each engine's forward, then each backward
        outs = {k: e(_batch(10 * (1 + "abc".index(k)) + i)) for k, e in engines.items()}
        for k, e in engines.items():
            e.backward(outs[k])
            e.step()
            losses[k].append(outs[k].item())
    out = {"active_after_forwards": ds_fallback._ACTIVE_FALLBACK is None}
    engines["a"].destroy()
    out["a_hook_gone"] = all(getattr(h, "__self__", None) is not fbs["a"] for h in dc_util.post_backward_hooks)
    out["b_hook_kept"] = any(getattr(h, "__self__", None) is fbs["b"] for h in dc_util.post_backward_hooks)
    out["size_asserts"] = [size_asserts_before, inductor_config.size_asserts]  # b still owns it
    for k in ("b", "c"):
        losses[k] += train(engines[k], 10 * (1 + "abc".index(k)) + 2)
    out["b_claims_after"] = _fallback_claimed(engines["b"])
    params = {k: full_params(engines[k]) for k in ("b", "c")}
    engines["b"].destroy()
    out["size_asserts"].append(inductor_config.size_asserts)  # the last owner is gone
    out["hooks_left"] = (len(dc_util.post_backward_hooks) - hooks_before[0],
                         len(dc_util.pre_backward_hooks) - hooks_before[1])
    out["equal"] = {
        "a": losses["a"] == solo["a"][0][:2],
        "b": losses["b"] == solo["b"][0] and all(torch.equal(params["b"][n], solo["b"][1][n]) for n in params["b"]),
        "c": losses["c"] == solo["c"][0] and all(torch.equal(params["c"][n], solo["c"][1][n]) for n in params["c"]),
    }
    out["c_gathered"] = deepspeed_z3ext.stats(engines["c"]).gathered
    return out


def test_two_engines_keep_their_own_fallback_state():
    for r in run_on_ranks(two_engines):
        assert r["equal"] == {"a": True, "b": True, "c": True}, r["equal"]
        assert r["active_after_forwards"]
        assert r["a_hook_gone"] and r["b_hook_kept"]
        assert r["b_claims_after"] == {} and r["c_gathered"] == []
        assert r["hooks_left"] == (0, 0), "a destroyed engine is still in DeepCompile's backward hooks"
        assert r["size_asserts"] == [True, False, True], r["size_asserts"]


# --------------------------------------------------------------------------- config
def torch_compiled():
    """A z3ext engine under `engine.compile()` (torch.compile of the module, z3ext's hooks on it; Dynamo's
    eager backend, which runs the traced graphs as they are) against stock eager ZeRO-3."""
    import torch
    from tests.models import build_engine, ds_config, full_params
    from tests.training import train as train_steps
    out = {}
    stock = build_engine(ds_config(persistence=0, mel=False))
    out["stock_losses"] = train_steps(stock, 3, _batch, ga=2)
    stock_params = full_params(stock)
    stock.destroy()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    z3 = build_engine(ds_config(z3ext=True, persistence=0, mel=False))
    z3.compile(backend="eager")
    out["z3_losses"] = train_steps(z3, 3, _batch, ga=2)
    z3_params = full_params(z3)
    out["params_equal"] = [n for n in stock_params if not torch.equal(stock_params[n], z3_params[n])] or True
    counters = torch._dynamo.utils.counters
    out["graphs"] = counters["stats"].get("unique_graphs", 0)
    out["breaks"] = [str(k)[:300] for k in counters["graph_break"]]
    import deepspeed_z3ext
    out["collectives"] = deepspeed_z3ext.stats(z3).collectives
    z3.destroy()
    return out


def test_torch_compiled_engine_trains_like_stock_and_never_traces_the_hooks():
    """[Note: eager hooks]: the hooks run outside Dynamo's graphs (a graph break at each, as disabled
    functions), never as frames of their own."""
    for r in run_on_ranks(torch_compiled):
        assert r["graphs"] > 0 and r["collectives"] > 0, r
        assert r["z3_losses"] == r["stock_losses"], (r["z3_losses"], r["stock_losses"])
        assert r["params_equal"] is True, r["params_equal"]
        assert not [b for b in r["breaks"] if "eval_frame" in b or "deepspeed_z3ext" in b], r["breaks"]


def test_config_refuses_untested_deepcompile_options_and_validates_the_key():
    import deepspeed_z3ext
    from deepspeed_z3ext.config import parse_section
    assert parse_section({"z3ext": {"enabled": True}}).compile_fallback is True
    with pytest.raises(deepspeed_z3ext.Z3extConfigError, match="compile_fallback"):
        parse_section({"z3ext": {"enabled": True, "compile_fallback": "maybe"}})

    class Cfg:  # the two fields unsupported_options reads, as DeepSpeedConfig holds them
        pass

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed_z3ext.config import unsupported_options
    cfg = Cfg()
    cfg.zero_config = DeepSpeedZeroConfig(stage=3)
    cfg.compile_config = CompileConfig(deepcompile=True)
    assert unsupported_options(cfg) == []
    cfg.compile_config = CompileConfig(deepcompile=True, offload_parameters=True)
    assert unsupported_options(cfg) == ["compile.offload_parameters with compile.deepcompile"]


# --------------------------------------------------------------------------- GPU: DeepCompile for real
class DisabledLayers(torch.nn.Module):
    """Runs eagerly under DeepCompile: Dynamo skips a `torch.compiler.disable`d frame."""

    def __init__(self, hidden, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers))
        self.eager_calls = 0

    @torch.compiler.disable
    def forward(self, h):
        self.eager_calls += 1  # Python that runs only when the frame runs eagerly
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h


class SkippedFrameModel(torch.nn.Module):
    """Every parameter has 147456 elements (above the default persistence threshold of 100000). The
    embedding, `first` and `head` run in DeepCompile's graphs; the middle layers in a skipped frame."""

    def __init__(self, vocab=384, hidden=384, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.first = torch.nn.Linear(hidden, hidden, bias=False)
        self.skipped = DisabledLayers(hidden, layers)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        h = torch.relu(self.first(self.embed(tokens)))
        h = self.skipped(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, dims=1).flatten())


def _gpu_config(z3ext=None, deepcompile=False):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        # memory_efficient_linear patches F.linear for the process and DeepCompile un-patches it:
        # off, every engine runs the same kernels whatever the other engines did
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False},
        "steps_per_print": 10**9,
    }
    if z3ext:
        cfg["z3ext"] = z3ext
    if deepcompile:
        cfg["compile"] = {"deepcompile": True}
    return cfg


def _gpu_build(config, seed=1234):
    import deepspeed
    import deepspeed_z3ext  # noqa: F401  (the "z3ext" section is read only with it imported)
    torch.manual_seed(seed)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = SkippedFrameModel()
    assert all(p.ds_numel > 100000 for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _gpu_train(engine, first_step, steps):
    import torch.distributed as dist
    from tests.training import train

    def inputs(step):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        return torch.randint(0, 384, (2, 16), generator=g).cuda()

    return train(engine, steps, inputs, first_step=first_step)


def deepcompile_on_gpu(fallback=True, steps=7):
    """Stock eager ZeRO-3, then z3ext with DeepCompile, same seed and data. 7 steps: DeepCompile's
    schedule adds prefetch and selective gather at step 5 (they re-plan with profiling)."""
    import deepspeed_z3ext
    from deepspeed_z3ext.fallback import fallback_of
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = {"torch": torch.__version__}
    import deepspeed
    out["deepspeed"] = deepspeed.__version__
    stock = _gpu_build(_gpu_config())
    out["stock_losses"] = _gpu_train(stock, 0, steps)
    stock.destroy()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eng = _gpu_build(_gpu_config({"enabled": True, "compile_fallback": fallback}, deepcompile=True))
    eng.compile()
    out["deepcompile_active"] = eng.is_deepcompile_active()
    try:
        out["losses"] = _gpu_train(eng, 0, steps)
        out["error"] = None
    except Exception as e:
        out["losses"], out["error"] = None, f"{type(e).__name__}: {str(e)[:400]}"
    counters = {str(k): dict(v) for k, v in torch._dynamo.utils.counters.items()}
    out["graphs_compiled"] = counters.get("stats", {}).get("unique_graphs", 0)
    out["graph_breaks"] = repr(counters.get("graph_break", {}))[:1500]
    out["eager_calls"] = eng.module.skipped.eager_calls
    fb = fallback_of(eng)
    out["fallback"] = fb.stats()._asdict() if fb is not None else None
    out["gathered_after"] = deepspeed_z3ext.stats(eng).gathered
    eng.destroy()
    return out


@pytest.mark.gpus(2)
def test_gpu_deepcompile_skipped_frame_trains_like_eager_zero3():
    skip_on_one_gpu("DeepCompile's graphs gather through its own NCCL communicator, one GPU per rank")
    for rank, r in enumerate(run_on_ranks(deepcompile_on_gpu, backend="nccl", timeout=600)):
        print(f"rank {rank}: torch {r['torch']} deepspeed {r['deepspeed']} fallback {r['fallback']}")
        assert r["deepcompile_active"], r
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["graphs_compiled"] > 0, r
        assert r["eager_calls"] == len(r["stock_losses"]), f"the disabled frame did not run eagerly: {r}"
        fb = r["fallback"]
        assert fb is not None and fb["gathered_params"] > 0 and fb["reduced_grads"] > 0, fb
        assert fb["claimed"] == {} and r["gathered_after"] == [], (fb, r["gathered_after"])
        assert r["losses"] == pytest.approx(r["stock_losses"], rel=1e-3, abs=1e-4), (r["losses"], r["stock_losses"])


@pytest.mark.gpus(2)
def test_gpu_deepcompile_skipped_frame_fails_with_the_fallback_off():
    skip_on_one_gpu("DeepCompile's graphs gather through its own NCCL communicator, one GPU per rank")
    for rank, r in enumerate(run_on_ranks(deepcompile_on_gpu, backend="nccl", timeout=600, fallback=False, steps=2)):
        assert r["deepcompile_active"], r
        assert r["fallback"] is not None and r["fallback"]["gathered_params"] == 0, r["fallback"]
        assert r["error"] is not None, f"rank {rank}: trained without a fallback: {r}"
        print(f"rank {rank}, fallback off: {r['error']}")


def two_engines_on_gpu(steps=3):
    """A compiled z3ext engine and an eager z3ext engine in one process, stepped alternately; the eager
    one trains exactly as alone; destroying the compiled one restores the process-wide settings."""
    import torch._inductor.config as inductor_config
    from deepspeed.compile import util as dc_util
    from deepspeed_z3ext.fallback import fallback_of
    torch.backends.cuda.matmul.allow_tf32 = False
    eager_cfg = _gpu_config({"enabled": True})
    alone = _gpu_build(eager_cfg, seed=2)
    alone_losses = _gpu_train(alone, 100, 2 * steps)
    alone.destroy()

    settings = lambda: (torch._dynamo.config.force_parameter_static_shapes, inductor_config.size_asserts)
    out = {"settings": [settings()]}
    torch._dynamo.reset()
    compiled = _gpu_build(_gpu_config({"enabled": True}, deepcompile=True), seed=1)
    eager = _gpu_build(eager_cfg, seed=2)
    compiled.compile()
    out["settings"].append(settings())
    fb = fallback_of(compiled)
    losses = {"compiled": [], "eager": []}
    for i in range(steps):
        losses["compiled"] += _gpu_train(compiled, i, 1)
        losses["eager"] += _gpu_train(eager, 100 + i, 1)
    out["fallback_gathered"] = fb.stats().gathered_params
    compiled.destroy()
    out["settings"].append(settings())
    out["hook_gone"] = all(getattr(h, "__self__", None) is not fb for h in dc_util.post_backward_hooks)
    losses["eager"] += _gpu_train(eager, 100 + steps, steps)
    out["eager_equal"] = losses["eager"] == alone_losses
    out["losses"] = losses
    out["alone"] = alone_losses
    return out


@pytest.mark.gpus(2)
def test_gpu_compiled_and_eager_engine_in_one_process():
    skip_on_one_gpu("DeepCompile's graphs gather through its own NCCL communicator, one GPU per rank")
    for rank, r in enumerate(run_on_ranks(two_engines_on_gpu, backend="nccl", timeout=600)):
        assert r["fallback_gathered"] > 0, r
        assert r["eager_equal"], (r["losses"]["eager"], r["alone"])
        before, during, after = r["settings"]
        assert during != before and after == before, r["settings"]
        assert r["hook_gone"]
