"""One seam layer ([Note: seams] in seams.py): z3ext changes DeepSpeed's classes only there, and can be
uninstalled in a process. On 2 real gloo ranks: a stock engine (no "z3ext" in its config) trained
before z3ext is imported, a z3ext engine, then after `deepspeed_z3ext.uninstall()` every replaced
attribute is what it was before the import (an inherited `__new__`: `seams.plain_new`, which constructs
as object's did; `_do_sanity_check`: the activation check, [Note: activation]), a config that still says
`"z3ext": true` is refused by name (never stock silently) and a stock engine trains bitwise like the
first; `install()` brings z3ext back. Plus a static check that no other module assigns to an
attribute of a DeepSpeed object (the activation module: only its two checks, [Note: section key])."""
import ast
import pathlib

from tests.harness import run_on_ranks
from tests.test_lifecycle import HIDDEN, _stack_model  # 3 addmm layers: each saves its weight itself

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "deepspeed_z3ext"
SEAMS = [  # (module, class or None for the module itself, attribute): what seams.py replaces
    ("deepspeed.runtime.config", "DeepSpeedConfig", "_do_sanity_check"),
    ("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "__new__"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters", "__enter__"),
    ("deepspeed.runtime.zero.partition_parameters", "GatheredParameters", "__exit__"),
    ("deepspeed.runtime.zero.parameter_offload", "ZeROOrderedDict", "__getitem__"),
    ("deepspeed.runtime.zero.parameter_offload", "ZeROOrderedDict", "__setitem__"),
    ("deepspeed.runtime.zero.parameter_offload", "ZeROOrderedDict", "__delitem__"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_configure_zero_optimizer"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_forward_prologue"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "_forward_epilogue"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "train"),
    ("deepspeed.compile.z3_eager_fallback", "DeepCompileZ3EagerFallback", "__new__"),
    ("deepspeed.runtime.swap_tensor.partitioned_param_swapper", "AsyncPartitionedParameterSwapper", "__new__"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_rigid_load_state_dict"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "create_reduce_and_remove_grad_hooks"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "reduce_independent_p_g_buckets_and_remove_grads"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "independent_gradient_partition_epilogue"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_pre_step"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_post_step"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "step"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_overflow_clean_up"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_create_fp32_partitions"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "offload_states"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "reload_states"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_get_fp32_grad_state_partition"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "set_fp32_grad_for_param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "set_local_grad_for_param"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "update_fp32_grad_for_param_vectorized"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_prepare_fp32_grad_for_sub_group"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "unscale_and_clip_grads"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups"),
    ("deepspeed.runtime.zero.linear", "LinearFunctionForZeroStage3", "apply"),
    ("deepspeed.runtime.zero.stage3", None, "count_used_parameters_in_backward"),  # a module global
]


def _classes():
    import importlib
    return [(getattr(importlib.import_module(m), c) if c else importlib.import_module(m), a) for m, c, a in SEAMS]


def _snapshot():
    absent = object()
    return [(cls, attr, cls.__dict__.get(attr, absent)) for cls, attr in _classes()], absent


def _train(z3ext, steps=3):
    """(losses, final full parameters, whether the engine is a z3ext engine) of a fresh engine."""
    import torch
    import deepspeed
    import torch.distributed as dist
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if z3ext:
        cfg["z3ext"] = True
    torch.manual_seed(7)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = _stack_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = engine(torch.randn(2, HIDDEN, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    return losses, params, hasattr(offload, "z3ext"), engine


def install_uninstall():
    import torch
    import deepspeed_z3ext_activate
    deepspeed_z3ext_activate.install_check()  # what the .pth does at `import deepspeed` (a no-op if it did)
    before, absent = _snapshot()
    stock_losses, stock_params, is_z3ext, engine = _train(z3ext=False)
    assert not is_z3ext
    engine.destroy()

    import deepspeed_z3ext
    out = {"installed": len(deepspeed_z3ext.installed())}
    replaced = [f"{cls.__name__}.{attr}" for cls, attr, own in before if cls.__dict__.get(attr, absent) is own]
    out["not_replaced"] = replaced
    z_losses, z_params, is_z3ext, engine = _train(z3ext=True)
    out["z3ext_engine"] = is_z3ext
    try:
        deepspeed_z3ext.uninstall()
        out["refused_while_alive"] = None
    except deepspeed_z3ext.Z3extError as e:
        out["refused_while_alive"] = str(e)
    engine.destroy()
    del engine

    deepspeed_z3ext.uninstall()
    out["installed_after"] = len(deepspeed_z3ext.installed())
    from deepspeed_z3ext.seams import plain_new
    out["restored"] = [f"{cls.__name__}.{attr}" for cls, attr, own in before
                       if cls.__dict__.get(attr, absent) is own or (attr == "__new__" and own is absent and
                                                                    cls.__dict__.get(attr) is plain_new)]
    try:
        _train(z3ext=True)
        out["refused_after_uninstall"] = None
    except deepspeed_z3ext.Z3extActivationError as e:
        out["refused_after_uninstall"] = str(e)
    u_losses, u_params, is_z3ext, engine = _train(z3ext=False)
    out["engine_after_uninstall_is_z3ext"] = is_z3ext
    out["stock_equal_after_uninstall"] = (all(torch.equal(a, b) for a, b in zip(stock_losses, u_losses)) and
                                          all(torch.equal(a, b) for a, b in zip(stock_params, u_params)))
    engine.destroy()

    deepspeed_z3ext.install()
    r_losses, r_params, is_z3ext, engine = _train(z3ext=True)
    out["z3ext_again"] = is_z3ext
    out["z3ext_equal_after_reinstall"] = (all(torch.equal(a, b) for a, b in zip(z_losses, r_losses)) and
                                          all(torch.equal(a, b) for a, b in zip(z_params, r_params)))
    out["z3ext_equal_to_stock"] = (all(torch.equal(a, b) for a, b in zip(stock_losses, z_losses)) and
                                   all(torch.equal(a, b) for a, b in zip(stock_params, z_params)))
    engine.destroy()
    return out


def test_uninstall_gives_deepspeed_back_and_install_returns():
    for rank, r in enumerate(run_on_ranks(install_uninstall)):
        assert r["installed"] == len(SEAMS), r
        assert r["not_replaced"] == [], f"rank {rank}: seams not replaced at import: {r['not_replaced']}"
        assert r["z3ext_engine"], r
        assert r["refused_while_alive"] and "engine.destroy()" in r["refused_while_alive"], r
        assert r["installed_after"] == 0, r
        assert len(r["restored"]) == len(SEAMS), f"rank {rank}: restored only {r['restored']}"
        assert r["refused_after_uninstall"] and "uninstall()" in r["refused_after_uninstall"], r
        assert not r["engine_after_uninstall_is_z3ext"], r
        assert r["stock_equal_after_uninstall"], f"rank {rank}: a stock engine after uninstall trains differently"
        assert r["z3ext_again"] and r["z3ext_equal_after_reinstall"], r
        assert r["z3ext_equal_to_stock"], r


def _deepspeed_names(tree):
    """Names bound by `import deepspeed...` / `from deepspeed... import X` in a module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deepspeed":
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "deepspeed")
    return names


def _assignments_to_deepspeed(path):
    tree = ast.parse(path.read_text())
    ds = _deepspeed_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(t, ast.Attribute) and isinstance(base, ast.Name) and base.id in ds:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Name) and arg.id in ds:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_seam_layer_assigns_to_deepspeed():
    # The checker itself finds the kind of patch it looks for.
    sample = PACKAGE.parent / "tests" / "_seam_sample.py"
    try:
        sample.write_text("from deepspeed.runtime.config import DeepSpeedConfig\nDeepSpeedConfig._do_sanity_check = None\n"
                          "from deepspeed.runtime.zero import parameter_offload as po\npo.FWD_MODULE_STACK = []\n")
        assert len(_assignments_to_deepspeed(sample)) == 2
    finally:
        sample.unlink()
    allowed = {"seams.py", "deepspeed_private.py"}
    found = [f for p in sorted(PACKAGE.glob("*.py")) if p.name not in allowed for f in _assignments_to_deepspeed(p)]
    assert found == [], "DeepSpeed patched outside seams.py / deepspeed_private.py: " + "; ".join(found)
    activation = [f.split(": ", 1)[1] for f in _assignments_to_deepspeed(PACKAGE.parent / "deepspeed_z3ext_activate.py")]
    assert sorted(activation) == ["DeepSpeedConfig._do_sanity_check", "DeepSpeedConfig._initialize_params",
                                  "deepspeed.initialize"], activation
