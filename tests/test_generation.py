"""Generation on 2 real gloo ranks ([Note: generation residency], [Note: resident fast path] in resident_set.py):
HF `generate` on a tiny Llama gives stock ZeRO-3's tokens and scores bitwise, with the whole model resident
(no gather after the prompt's forward, every later token on the fast path with the layers' hooks lifted and
put back in place when residency ends; evaluation and DPO's reference
forward keep nothing), within a budget of half the
model (what the ranks really hold stays within the budget, the window and one unit), with residency off,
and inside TRL's whole-model GatheredParameters; residency ends at `train()`, at a grad-enabled forward, at
the step, at `engine.backward`, at `release_resident` and at the end of a `resident` block; training after generation stays
bitwise equal to stock's."""
import pytest

from tests.harness import run_on_ranks

NEW_TOKENS = 6


def _llama():
    # Built outside zero.Init: with the `kernels` package installed, transformers' hub-kernel decorator on
    # LlamaAttention loses its per-instance state under zero.Init's constructor wrapping (stock fails too).
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _engine(z3ext):
    from tests.models import build_engine, ds_config
    cfg = ds_config(z3ext=z3ext, persistence=0, mel=False, ga=1,
                    zero_extra={"stage3_prefetch_bucket_size": 3000, "stage3_max_live_parameters": 10**9})
    return build_engine(cfg, model_fn=_llama, inside_init=False)  # (zero.Init: see _llama)


def _prompt(rank, i):
    import torch
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randint(3, 96, (2, 5), generator=g)


def _generate(engine, prompt):
    import torch
    with torch.no_grad():
        out = engine.module.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     synced_gpus=True, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=0)
    return out.sequences, [s.clone() for s in out.scores]


def _stored_bytes(engine):
    """Bytes the module's parameters really hold now: distinct storages of their full values."""
    storages = {}
    for p in engine.module.parameters():
        st = p.data.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _train(engine, steps, rank):
    import torch
    losses = []
    for i in range(steps):
        ids = _prompt(rank, 50 + i)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def generation_runs():
    import torch
    import torch.distributed as dist
    import deepspeed
    import deepspeed_z3ext
    from tests.models import full_params
    rank = dist.get_rank()
    out = {}
    for name in ("stock", "z3ext", "z3ext-half", "z3ext-off"):
        z3ext = False if name == "stock" else ({"enabled": True, "resident_numel": 0} if name == "z3ext-off" else True)
        engine = _engine(z3ext)
        total = sum(p.ds_numel for p in engine.module.parameters())
        r = {"tokens": [], "scores": []}
        budget = None
        if name == "z3ext-half":
            budget = total // 2
        lifted = getattr(engine.optimizer.parameter_offload, "z3ext_lifted", None)  # [Note: lifted hooks]
        for i in range(2):  # a generation, training, a generation again
            if name.startswith("z3ext"):
                before = deepspeed_z3ext.stats(engine)
            hook_ids = [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in engine.module.modules()]
            peak = [0]

            def sample(m, a, y):
                peak[0] = max(peak[0], _stored_bytes(engine))

            hooks = [m.register_forward_hook(sample) for m in engine.module.modules()]
            ends = []  # the engine's all-gathers so far at the end of each forward (one per token)
            if name.startswith("z3ext"):
                hooks.append(engine.module.register_forward_hook(
                    lambda m, a, y: ends.append(deepspeed_z3ext.stats(engine).collectives)))
            if budget is not None:
                with deepspeed_z3ext.resident(engine, budget):
                    tokens, scores = _generate(engine, _prompt(rank, i))
                    st = deepspeed_z3ext.stats(engine)
                r["after_block"] = deepspeed_z3ext.stats(engine).resident_numel
            else:
                tokens, scores = _generate(engine, _prompt(rank, i))
                st = deepspeed_z3ext.stats(engine) if name.startswith("z3ext") else None
            for h in hooks:
                h.remove()
            if lifted is not None:  # the layers' hooks are out while the whole model is resident, the root's in
                layer = engine.module.model.layers[0].mlp
                r.setdefault("lifted", []).append((lifted.active, not layer._forward_pre_hooks,
                                                   bool(engine.module._forward_pre_hooks)))
            r["tokens"].append(tokens)
            r["scores"].append(scores)
            r.setdefault("peak", []).append(peak[0])
            if st is not None:
                r.setdefault("collectives", []).append(st.collectives - before.collectives)
                r.setdefault("after_first_forward", []).append(st.collectives - ends[0])
                r.setdefault("fast", []).append(st.resident_forwards - before.resident_forwards)
                r.setdefault("resident", []).append(st.resident_numel)
                kinds = {k for cs in st.claims.values() for k, _ in cs}
                r.setdefault("kinds", []).append(sorted(kinds))
            if i == 0:
                if name == "z3ext":
                    engine.train()  # ends residency
                    r["after_train"] = (deepspeed_z3ext.stats(engine).resident_numel, deepspeed_z3ext.stats(engine).live_bytes)
                    r["hooks_back"] = hook_ids == [(list(m._forward_pre_hooks), list(m._forward_hooks))
                                                   for m in engine.module.modules()]  # in their places
                r["losses"] = _train(engine, 2, rank)
                if name.startswith("z3ext"):
                    r["after_step"] = deepspeed_z3ext.stats(engine).resident_numel
        engine.empty_partition_cache()  # stock's generate leaves prefetched parameters in flight
        r["params"] = {n: t.clone() for n, t in full_params(engine).items()}
        if name == "stock":  # (stock's own hooks release inside GatheredParameters: TRL removes them first)
            r["gathered_tokens"] = _generate(engine, _prompt(rank, 82))[0]
        if name == "z3ext":
            # A generation with no other hooks on the layers (z3ext's their only ones) and one registered on a layer
            # while its hooks are lifted: after the residency, z3ext's back in their places, the new one after them
            layer = engine.module.model.layers[0].mlp
            before = [list(d) for d in (layer._forward_pre_hooks, layer._forward_hooks,
                                        layer._forward_hooks_always_called)]
            added = []

            def add_during_the_lift(m, a, y):
                if lifted.active and not added:
                    added.append(layer.register_forward_hook(lambda *_: None))

            root_hook = engine.module.register_forward_hook(add_during_the_lift)
            _generate(engine, _prompt(rank, 83))
            root_hook.remove()
            deepspeed_z3ext.release_resident(engine)
            after = [list(d) for d in (layer._forward_pre_hooks, layer._forward_hooks,
                                       layer._forward_hooks_always_called)]
            r["hooks_back_alone"] = (bool(added), after == [before[0], before[1] + [added[0].id], before[2]]
                                     if added else after)
            for h in added:
                h.remove()
            # TRL's way: generation inside GatheredParameters over the whole model
            with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                r["gathered_tokens"] = _generate(engine, _prompt(rank, 82))[0]
            deepspeed_z3ext.release_resident(engine)
            # a grad-enabled forward ends residency before it gathers; release_resident ends it explicitly
            ids = _prompt(rank, 80)
            # Evaluation and DPO's reference forward keep nothing: no_grad forwards without a KV cache, one
            # between a forward and its backward; one after a generation ends its residency
            loss = engine(input_ids=ids, labels=ids).loss
            with torch.no_grad():
                engine(input_ids=ids)
                engine(input_ids=ids)
            pending = deepspeed_z3ext.stats(engine).resident_numel
            engine.backward(loss)
            engine.step()
            _generate(engine, _prompt(rank, 78))
            generated = deepspeed_z3ext.stats(engine).resident_numel
            with torch.no_grad():
                engine(input_ids=ids)
            r["single_no_grad"] = (pending, deepspeed_z3ext.stats(engine).resident_numel, generated > 0)
            _generate(engine, _prompt(rank, 79))
            resident_before = deepspeed_z3ext.stats(engine).resident_numel
            loss = engine(input_ids=ids, labels=ids).loss
            r["grad_forward"] = (resident_before, deepspeed_z3ext.stats(engine).resident_numel)
            engine.backward(loss)
            engine.step()
            _generate(engine, _prompt(rank, 81))
            resident_before = deepspeed_z3ext.stats(engine).resident_numel
            deepspeed_z3ext.release_resident(engine.module)
            r["release"] = (resident_before, deepspeed_z3ext.stats(engine).resident_numel,
                            deepspeed_z3ext.stats(engine).live_bytes)
        r["total_bytes"] = 4 * total
        # the largest fetch unit: a decoder layer (a fetch group) or the embedding / head
        r["unit_max_bytes"] = 4 * max(sum(p.ds_numel for p in m.parameters())
                                      for m in [*engine.module.model.layers, engine.module.lm_head])
        out[name] = r
        engine.destroy()
    stock = out.pop("stock")
    import torch
    result = {}
    for name, r in out.items():
        result[name] = dict(
            tokens=all(torch.equal(a, b) for a, b in zip(r["tokens"], stock["tokens"])),
            scores=all(torch.equal(a, b) for sa, sb in zip(r["scores"], stock["scores"]) for a, b in zip(sa, sb)),
            losses=(r["losses"], stock["losses"]),
            params=[n for n in stock["params"] if not torch.equal(stock["params"][n], r["params"][n])],
            **{k: r[k] for k in r if k not in ("tokens", "scores", "params", "losses", "gathered_tokens")})
        if "gathered_tokens" in r:
            result[name]["gathered_tokens"] = torch.equal(r["gathered_tokens"], stock["gathered_tokens"])
    result["stock_peak"] = stock["peak"]
    return result


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(generation_runs, timeout=600)


def test_generate_is_bitwise_equal_to_stock(runs):
    for rank, res in enumerate(runs):
        for name in ("z3ext", "z3ext-half", "z3ext-off"):
            r = res[name]
            assert r["tokens"] and r["scores"], (rank, name)
            assert r["losses"][0] == r["losses"][1], (rank, name, r["losses"])
            assert not r["params"], (rank, name, r["params"])
        assert res["z3ext"]["gathered_tokens"], rank


def test_the_whole_model_resident_gathers_once_per_generate(runs):
    for rank, res in enumerate(runs):
        r, off = res["z3ext"], res["z3ext-off"]
        # The prompt's forward keeps everything, every later token finds everything resident: no gather after it.
        assert r["fast"] == [NEW_TOKENS - 1] * 2, r["fast"]
        assert r["lifted"] == [(True, True, True)] * 2 and r["hooks_back"], (r["lifted"], r["hooks_back"])
        assert r["hooks_back_alone"] == (True, True), r["hooks_back_alone"]
        assert r["after_first_forward"] == [0, 0] and off["after_first_forward"][1] > 0, (
            r["after_first_forward"], off["after_first_forward"])
        assert r["single_no_grad"] == (0, 0, True), r["single_no_grad"]
        assert off["fast"] == [0, 0] and off["resident"] == [0, 0] and "resident" not in off["kinds"][0]
        assert r["resident"][0] * 4 == r["total_bytes"] and "resident" in r["kinds"][0]
        assert r["after_train"][0] == 0 and r["after_train"][1] == 0, r["after_train"]
        assert r["after_step"] == 0
        assert r["grad_forward"][0] > 0 and r["grad_forward"][1] == 0, r["grad_forward"]
        assert r["release"][0] > 0 and r["release"][1:] == (0, 0), r["release"]


def test_a_budget_bounds_what_the_ranks_hold(runs):
    for rank, res in enumerate(runs):
        r = res["z3ext-half"]
        budget = r["total_bytes"] // 2
        assert 0 < r["resident"][0] * 4 <= budget, (r["resident"], budget)
        assert r["after_block"] == 0
        # Resident, ahead (the window, or one unit larger than it gathered alone) and the running unit.
        bound = budget + max(4 * 3000, r["unit_max_bytes"]) + r["unit_max_bytes"]
        assert max(r["peak"]) <= bound, (r["peak"], budget, r["unit_max_bytes"])
        assert r["fast"] == [0, 0]  # part of the model is gathered for every token
        assert [lifted for lifted, _, _ in r["lifted"]] == [False, False], r["lifted"]
        # Fewer gathers than without residency, more than with the whole model resident.
        assert res["z3ext"]["collectives"][0] < r["collectives"][0] < res["z3ext-off"]["collectives"][0], (
            res["z3ext"]["collectives"], r["collectives"], res["z3ext-off"]["collectives"])


def mel_no_grad():
    """DeepSpeed's memory-efficient linear on, stock and z3ext engines: no_grad forwards and greedy tokens, two
    training steps, and how often the Function's setup_context ran ([Note: no_grad linear], [Note: grad-mode
    linear])."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3 as F
    from tests.models import build_engine, ds_config, full_params
    rank, out = dist.get_rank(), {}
    calls = [0]
    setup = F.__dict__["setup_context"]

    def counted(ctx, inputs, output):
        calls[0] += 1
        return setup.__func__(ctx, inputs, output)

    backward = F.__dict__["backward"]
    backward_calls = [0]

    def counted_backward(ctx, grad_output):
        backward_calls[0] += 1
        return backward.__func__(ctx, grad_output)

    forward = F.__dict__["forward"]  # the Function's forward, which z3ext's seam runs in C++ ([Note: linear in one call])
    forward_calls = [0]

    def counted_forward(*args, **kwargs):
        forward_calls[0] += 1
        return forward.__func__(*args, **kwargs)

    F.setup_context = staticmethod(counted)  # observes DeepSpeed's Function; z3ext's seam is on `apply`
    F.forward = staticmethod(counted_forward)
    F.backward = staticmethod(counted_backward)
    try:
        for name in ("stock", "z3ext"):
            cfg = ds_config(z3ext=name == "z3ext", persistence=0, mel=True, ga=1,
                            zero_extra={"stage3_prefetch_bucket_size": 3000, "stage3_max_live_parameters": 10**9})
            engine = build_engine(cfg, model_fn=_llama, inside_init=False)
            calls[0] = forward_calls[0] = 0
            with torch.no_grad():
                logits = engine(input_ids=_prompt(rank, 3)).logits
            no_grad_calls, no_grad_forwards = calls[0], forward_calls[0]
            tokens, scores = _generate(engine, _prompt(rank, 4))
            calls[0] = forward_calls[0] = 0
            losses = []
            for step in range(2):  # the second step's forward runs on weights the first step's gradients moved
                loss = engine(input_ids=_prompt(rank, 5 + step)).logits.float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
            grad_forwards = forward_calls[0]
            # A weight released by the time its node runs: stock's backward gathers it, computes, releases it.
            weight = engine.module.model.layers[0].mlp.gate_proj.weight
            x = torch.randn(3, weight.ds_shape[1], generator=torch.Generator().manual_seed(rank), requires_grad=True)
            with deepspeed.zero.GatheredParameters([weight]):
                y = F.apply(x, weight, None)
            released = weight.numel() == 0
            backward_calls[0] = 0
            grad_x, = torch.autograd.grad(y.pow(2).sum(), x)
            out[name] = dict(logits=logits, tokens=tokens, scores=scores, no_grad_calls=no_grad_calls,
                             grad_calls=calls[0], losses=losses, params=full_params(engine),
                             forwards=(no_grad_forwards, grad_forwards),
                             released=(released, weight.numel() == 0, backward_calls[0]), grad_x=grad_x)
            engine.destroy()
        # A plain model in the same process (F.linear is DeepSpeed's from here on): no_grad skips the Function, with
        # the bits of a grad-mode forward, which runs it.
        torch.manual_seed(0)
        plain = _llama()
        calls[0] = forward_calls[0] = 0
        with torch.no_grad():
            plain_no_grad = plain(input_ids=_prompt(rank, 3)).logits
        plain_calls, plain_forwards = [calls[0]], [forward_calls[0]]
        plain_grad = plain(input_ids=_prompt(rank, 3)).logits.detach()
        plain_calls.append(calls[0] - plain_calls[0])
        plain_forwards.append(forward_calls[0] - plain_forwards[0])
    finally:
        F.forward = forward
        F.setup_context = staticmethod(setup.__func__) if isinstance(setup, staticmethod) else setup
        F.backward = backward
    s, z = out["stock"], out["z3ext"]
    return dict(logits=torch.equal(s["logits"], z["logits"]), tokens=torch.equal(s["tokens"], z["tokens"]),
                scores=all(torch.equal(a, b) for a, b in zip(s["scores"], z["scores"])),
                losses=all(torch.equal(a, b) for a, b in zip(s["losses"], z["losses"])),
                released={n: r["released"] for n, r in out.items()}, grad_x=torch.equal(s["grad_x"], z["grad_x"]),
                params=s["params"].keys() == z["params"].keys() and all(
                    torch.equal(v, z["params"][k]) for k, v in s["params"].items()),
                calls={n: (r["no_grad_calls"], r["grad_calls"]) for n, r in out.items()},
                forwards={n: r["forwards"] for n, r in out.items()}, plain_forwards=plain_forwards,
                plain=torch.equal(plain_no_grad, plain_grad), plain_calls=plain_calls,
                linear_replaced=(torch.nn.functional.linear.__module__, torch.nn.functional.linear.__name__))


def test_memory_efficient_linear_is_stocks_bits_without_its_python_function():
    for rank, r in enumerate(run_on_ranks(mel_no_grad, timeout=300)):
        assert r["logits"] and r["tokens"] and r["scores"], (rank, r)
        assert r["losses"] and r["params"], (rank, r)  # grad mode: csrc/linear.h's node, stock's bits
        assert r["calls"]["z3ext"][0] == 0 and r["calls"]["stock"][0] > 0, r["calls"]  # no autograd in no_grad
        assert r["calls"]["z3ext"][1] == 0 and r["calls"]["stock"][1] > 0, r["calls"]  # nor DeepSpeed's Function
        # A weight released before its node's backward: stock's backward, which gathers and releases it, once.
        assert r["released"] == {"stock": (True, True, 1), "z3ext": (True, True, 1)} and r["grad_x"], r
        # [Note: linear in one call]: a z3ext weight's linear never runs the Function's Python forward, in either
        # mode; a stock engine's always does.
        assert r["forwards"]["z3ext"] == (0, 0) and min(r["forwards"]["stock"]) > 0, r["forwards"]
        # A plain model beside them: DeepSpeed's linear (F.linear replaced), no Function in no_grad (nor its Python
        # forward), the same bits; in grad mode DeepSpeed's Function (its graph names it).
        assert r["linear_replaced"] == ("deepspeed.runtime.zero.linear", "zero3_linear_wrap") and r["plain"], r
        assert r["plain_calls"][0] == 0 and r["plain_calls"][1] > 0, r["plain_calls"]
        assert r["plain_forwards"][0] == 0 and r["plain_forwards"][1] > 0, r["plain_forwards"]


def budget_from_memory(rank1_free=None):
    """[Note: resident budget]: no budget set, and a prefetch bucket that leaves the live budget's default room for 100
    elements: generation sizes its budget from memory. `rank1_free`: the free bytes rank 1's host reports (its
    process's psutil answer), so that the ranks measure different memory."""
    import psutil
    import torch.distributed as dist
    import deepspeed_z3ext
    from tests.models import build_engine, ds_config
    rank = dist.get_rank()
    if rank1_free is not None and rank == 1:
        real = psutil.virtual_memory
        psutil.virtual_memory = lambda: real()._replace(available=rank1_free)
    out = {}
    for name, zero_extra in (("sized", {}), ("live-set", {"stage3_max_live_parameters": 10**9})):
        cfg = ds_config(z3ext=True, persistence=0, mel=False, ga=1,
                        zero_extra={"stage3_prefetch_bucket_size": 10**9 - 100, **zero_extra})
        engine = build_engine(cfg, model_fn=_llama, inside_init=False)
        total = sum(p.ds_numel for p in engine.module.parameters())
        element = next(engine.module.parameters()).element_size()
        tokens, _ = _generate(engine, _prompt(rank, 1))
        kept = deepspeed_z3ext.stats(engine).resident_numel  # gathered and claimed Resident after the last token
        held = _stored_bytes(engine) // element  # what the parameters really hold now
        with deepspeed_z3ext.resident(engine):  # no numel: the same default
            _generate(engine, _prompt(rank, 2))
            in_block = deepspeed_z3ext.stats(engine).resident_numel
        out[name] = dict(total=total, kept=kept, held=held, in_block=in_block, tokens=tokens.tolist())
        engine.destroy()
    return out


def test_generation_budget_sized_from_memory_when_none_is_set():
    """The whole model stays gathered where nothing bounds it and memory allows; a live budget set by hand bounds it
    as before (100 elements here: the norms' weights)."""
    for rank, r in enumerate(run_on_ranks(budget_from_memory, timeout=300)):
        sized, live = r["sized"], r["live-set"]
        assert sized["kept"] == sized["in_block"] == sized["total"] and sized["held"] >= sized["total"], (rank, r)
        assert live["kept"] <= 100 and live["in_block"] <= 100, (rank, r)


def test_generation_budget_from_memory_is_the_ranks_smallest():
    """Rank 1 reports free memory for a third of the model (half of it is the budget): both ranks keep the same units,
    within that budget."""
    total = sum(p.numel() for p in _llama().parameters())
    results = run_on_ranks(budget_from_memory, rank1_free=total * 4 // 3, timeout=300)
    kept = [r["sized"]["kept"] for r in results]
    assert kept[0] == kept[1] and 0 < kept[0] <= total // 6, kept
    assert all(r["sized"]["tokens"] == r["live-set"]["tokens"] for r in results)  # what is kept changes no token


@pytest.mark.gpus(1)
def test_grad_mode_linear_node_is_stocks_bits_on_cuda():
    """[Note: grad-mode linear] on the GPU: csrc/linear.h's node against DeepSpeed's Function itself (its torch
    `apply`, past z3ext's seam), outputs and every gradient bitwise, fp32 and bf16, 2-D, 3-D and 1-D inputs."""
    import inspect
    import torch
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3 as F
    from deepspeed_z3ext import linear
    from deepspeed_z3ext._ops import ops
    from deepspeed_z3ext.state import STATE_ATTR
    linear._load(ops())

    def node(x, w, b):  # [Note: linear in one call]: the node, for a z3ext weight (a Parameter marked as one)
        setattr(w, STATE_ATTR, None)
        out = ops().linear_call(x, w, b)
        assert out is not None, "linear_call declined a plain input and a z3ext weight"
        return out

    stock = inspect.getattr_static(torch.autograd.Function, "apply").__get__(None, F)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in [(8, 64), (2, 5, 64), (64, )]:
            for with_bias in (True, False):
                g = torch.Generator(device="cuda").manual_seed(0)
                x = torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
                w = torch.randn(32, 64, device="cuda", dtype=dtype, generator=g)
                b = torch.randn(32, device="cuda", dtype=dtype, generator=g) if with_bias else None
                results = []
                for apply in (stock, node):
                    xs, ws = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
                    bs = b.clone().requires_grad_() if b is not None else None
                    y = apply(xs, ws, bs)
                    y.backward(torch.randn(y.shape, device="cuda", dtype=dtype,
                                           generator=torch.Generator(device="cuda").manual_seed(1)))
                    results.append([y, xs.grad, ws.grad] + ([bs.grad] if bs is not None else []))
                assert type(results[1][0].grad_fn).__name__ != type(results[0][0].grad_fn).__name__  # two paths
                for a, c in zip(*results):
                    assert torch.equal(a, c), (dtype, shape, with_bias)
