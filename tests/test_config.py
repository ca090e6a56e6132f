"""The config at `deepspeed.initialize` (real engines, one gloo rank): every bad `"z3ext"` value is an
error naming its key ("auto" included; a misspelt key with the one meant), a key meant as the section but
not exactly `"z3ext"` at the top level is an error naming both (also without importing z3ext, [Note:
section key]), each DeepSpeed ZeRO-3 option z3ext does not honour is refused by name unless it has
DeepSpeed's default, and HF Trainer's standard ZeRO-3 config is accepted and trains."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import run_on_ranks

BAD_SECTIONS = {
    # case: (the "z3ext" value, what the message must name)
    "auto_enabled": ({"enabled": "auto"}, '"z3ext.enabled": "auto" is not supported'),
    "auto_section": ("auto", '"z3ext": "auto" is not supported'),
    "auto_option": ({"enabled": True, "pool_budget_mb": "auto"}, '"z3ext.pool_budget_mb": "auto"'),
    "unknown_key": ({"enabled": True, "strict": 1}, '"z3ext.strict": Extra inputs are not permitted'),
    "string_bool": ({"enabled": "yes"}, '"z3ext.enabled": Input should be a valid boolean'),
    "string_int": ({"enabled": True, "pool_budget_mb": "64"}, '"z3ext.pool_budget_mb": Input should be a valid integer'),
    "int_bool": ({"enabled": True, "leak_check": 1}, '"z3ext.leak_check": Input should be a valid boolean'),
    "bool_int": ({"enabled": True, "plan_warning_steps": True}, '"z3ext.plan_warning_steps": Input should be a valid '
                 'integer'),
    "float_int": ({"enabled": True, "pool_budget_mb": 1.5}, '"z3ext.pool_budget_mb": Input should be a valid integer'),
    "negative": ({"enabled": True, "pool_budget_mb": -1}, '"z3ext.pool_budget_mb": Input should be greater than'),
    "misspelt_key": ({"enabled": True, "hold_max_numell": 10}, '"z3ext.hold_max_numell": Extra inputs are not '
                     'permitted (got 10); did you mean "z3ext.hold_max_numel"?'),
    "misspelt_case": ({"Enabled": True}, 'did you mean "z3ext.enabled"?'),
    "far_off_key": ({"enabled": True, "prefetch_depth": 2}, '"z3ext.prefetch_depth": Extra inputs are not permitted '
                    "(got 2); DeepSpeed's own zero_optimization keys (stage3_prefetch_bucket_size"),
}

# Keys meant as the section that DeepSpeed would ignore (stock ZeRO-3, silently, without the check).
LOOKALIKES = ["Z3ext", "Z3EXT", "z3_ext", "z3-ext", "zero3ext", "zero3_ext", "z3extension", "deepspeed_z3ext"]


def _lookalike_message_ok(message, key):
    return (message is not None and message.startswith("Z3extConfigError")
            and f'"{key}" is not z3ext\'s key: write "z3ext" (exactly, at the top level)' in message)


def _nested_message_ok(message, key):
    return (message is not None and message.startswith("Z3extConfigError")
            and f'"zero_optimization.{key}": the z3ext section is "z3ext" at the top level' in message)


REFUSED = {
    # DeepSpeed zero_optimization key: (a value z3ext refuses, DeepSpeed's default, which it accepts)
    "stage3_max_reuse_distance": (500000000, 1e9),
    "stage3_allgather_sequential": (True, False),
    "enable_sanity_checks": (True, False),
    "log_trace_cache_warnings": (True, False),
}


def _hf_zero3_config():
    """HF's docs ds_config_zero3.json, its "auto" values filled by transformers as Trainer does."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    cfg = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
        "z3ext": True,
    }
    args = TrainingArguments(output_dir="/tmp/z3ext-hf-config-test", per_device_train_batch_size=2, report_to=[])
    hf = HfTrainerDeepSpeedConfig(cfg)
    hf.trainer_config_process(args)

    class Model:  # trainer_config_finalize reads the model's hidden size for the hidden-size "auto" keys

        class config:
            hidden_size = 32

    hf.trainer_config_finalize(args, Model, 10)
    return hf.config


def config_cases():
    import deepspeed
    import deepspeed_z3ext  # noqa: F401 (installs the config check)
    from deepspeed_z3ext.offload import Z3extZeRoOffload
    from tests.models import TinyGPT, batch, ds_config

    def init(cfg):
        model = TinyGPT()
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def error_of(cfg):
        try:
            init(cfg)
        except Exception as e:  # the message is what the user sees
            return f"{type(e).__name__}: {e}"
        return None

    def is_z3ext(engine):
        return isinstance(getattr(engine.optimizer, "parameter_offload", engine.optimizer), Z3extZeRoOffload)

    out = {"bad": {case: error_of(ds_config(z3ext=section)) for case, (section, _) in BAD_SECTIONS.items()}}
    out["refused"], out["default_accepted"] = {}, {}
    for key, (bad, default) in REFUSED.items():
        out["refused"][key] = error_of(ds_config(z3ext=True, zero_extra={key: bad}))
        out["default_accepted"][key] = is_z3ext(init(ds_config(z3ext=True, zero_extra={key: default})))
    # stage3_max_reuse_distance: 0 (release after each module) and above the default are accepted too.
    out["reuse_accepted"] = [is_z3ext(init(ds_config(z3ext=True, zero_extra={"stage3_max_reuse_distance": v})))
                             for v in (0, 10**12)]
    # Several at once: every one named in one message.
    out["refused_all"] = error_of(ds_config(z3ext=True, zero_extra={k: bad for k, (bad, _) in REFUSED.items()}))
    # Refused only when z3ext is on: stock DeepSpeed keeps them.
    out["stock_keeps_them"] = not is_z3ext(init(ds_config(zero_extra={k: bad for k, (bad, _) in REFUSED.items()})))

    # The section under a look-alike key or inside zero_optimization: refused at deepspeed.initialize and
    # at zero.Init (both build a DeepSpeedConfig), with or without a correct "z3ext" next to it.
    out["lookalike"] = {key: error_of(ds_config(extra={key: True})) for key in LOOKALIKES}
    out["lookalike_next_to_z3ext"] = error_of(ds_config(z3ext=True, extra={"Z3EXT": {"leak_check": True}}))
    out["nested"] = {key: error_of(ds_config(zero_extra={key: True})) for key in ("z3ext", "Z3ext")}
    try:
        with deepspeed.zero.Init(config_dict_or_path=ds_config(extra={"z3_ext": True})):
            TinyGPT()
        out["lookalike_zero_init"] = None
    except Exception as e:
        out["lookalike_zero_init"] = f"{type(e).__name__}: {e}"

    # MiCS: DeepSpeed 0.19.8 itself refuses the key (it removed MiCS); with z3ext on it must still be named.
    out["mics"] = error_of(ds_config(z3ext=True, zero_extra={"mics_shard_size": 2}))

    cfg = _hf_zero3_config()
    engine = init(cfg)
    out["hf_is_z3ext"] = is_z3ext(engine)
    losses = []
    for step in range(2):
        loss = engine(batch(step, 0))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out["hf_losses"] = losses
    return out


@pytest.fixture(scope="module")
def cases():
    return run_on_ranks(config_cases, world_size=1, timeout=600)[0]


@pytest.mark.parametrize("case", sorted(BAD_SECTIONS))
def test_bad_section_value_names_the_key(cases, case):
    message = cases["bad"][case]
    assert message is not None and message.startswith("Z3extConfigError"), message
    assert BAD_SECTIONS[case][1] in message, message


@pytest.mark.parametrize("case", ["unknown_key", "misspelt_key", "far_off_key"])
def test_an_unknown_key_gets_the_list_of_valid_keys(cases, case):
    """An unknown key, close to a valid one or not, ends the message with every key of the section, once."""
    from deepspeed_z3ext.config import Z3extConfig
    message = cases["bad"][case]
    keys = ", ".join(sorted(Z3extConfig.model_fields))
    assert message.endswith(f'The keys of "z3ext": {keys}'), message
    assert message.count("The keys of") == 1, message
    assert "schedule_check" in keys and "reduce_gradients" in keys


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_deepspeed_option_refused_by_name_unless_default(cases, key):
    message = cases["refused"][key]
    assert message is not None and message.startswith("Z3extConfigError"), message
    assert f"zero_optimization.{key} = {REFUSED[key][0]!r}" in message, message
    assert cases["default_accepted"][key] is True
    assert all(f"zero_optimization.{k} =" in cases["refused_all"] for k in REFUSED), cases["refused_all"]
    assert cases["stock_keeps_them"] is True
    assert cases["reuse_accepted"] == [True, True]


def test_hf_standard_zero3_config_is_accepted_and_trains(cases):
    assert cases["hf_is_z3ext"] is True
    assert all(loss == loss and loss > 0 for loss in cases["hf_losses"]), cases["hf_losses"]


def test_mics_refused_by_name(cases):
    assert cases["mics"] is not None and "mics_shard_size" in cases["mics"], cases["mics"]


@pytest.mark.parametrize("key", LOOKALIKES)
def test_a_lookalike_section_key_names_the_right_one(cases, key):
    assert _lookalike_message_ok(cases["lookalike"][key], key), cases["lookalike"][key]


def test_a_lookalike_is_refused_next_to_z3ext_and_at_zero_init(cases):
    assert _lookalike_message_ok(cases["lookalike_next_to_z3ext"], "Z3EXT"), cases["lookalike_next_to_z3ext"]
    assert _lookalike_message_ok(cases["lookalike_zero_init"], "z3_ext"), cases["lookalike_zero_init"]


@pytest.mark.parametrize("key", ["z3ext", "Z3ext"])
def test_the_section_inside_zero_optimization_names_the_top_level(cases, key):
    assert _nested_message_ok(cases["nested"][key], key), cases["nested"][key]


_WITHOUT_IMPORT = """
    import sys
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    import deepspeed_z3ext_activate
    print("PTH", deepspeed_z3ext_activate.STARTED_BY_PTH)
    for key, where in (("Z3EXT", "top"), ("zero3_ext", "top"), ("z3ext", "zero")):
        cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3}}
        (cfg if where == "top" else cfg["zero_optimization"])[key] = True
        try:
            DeepSpeedConfig(cfg)
            print("ACCEPTED", key)
        except Exception as e:
            print("RAISED", key, type(e).__name__ + ": " + str(e).replace("\\n", " "))
    print("IMPORTED", "deepspeed_z3ext" in sys.modules)
"""


@pytest.mark.parametrize("switch", ["on", "off"])
def test_lookalikes_refused_without_an_import(tmp_path, switch):
    """The program never imports deepspeed_z3ext ([Note: activation], the .pth that `pip install` puts in
    site-packages): a look-alike key does not enable z3ext, yet is refused by name at DeepSpeedConfig, with
    DEEPSPEED_Z3EXT_AUTO on or off, and nothing of the package (nor its build) is loaded for it."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("DEEPSPEED_Z3EXT_AUTO", None)
    if switch == "off":
        env["DEEPSPEED_Z3EXT_AUTO"] = "0"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_WITHOUT_IMPORT)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.split(" ")[0] in ("PTH", "RAISED", "ACCEPTED", "IMPORTED")]
    assert lines[0] == "PTH True", ("deepspeed_z3ext.pth is not in site-packages: install the package "
                                    "(`pip install --no-build-isolation --no-deps -e .`) to test activation")
    raised = {line.split(" ", 2)[1]: line.split(" ", 2)[2] for line in lines if line.startswith("RAISED")}
    assert set(raised) == {"Z3EXT", "zero3_ext", "z3ext"}, lines
    assert _lookalike_message_ok(raised["Z3EXT"], "Z3EXT"), raised
    assert _lookalike_message_ok(raised["zero3_ext"], "zero3_ext"), raised
    assert _nested_message_ok(raised["z3ext"], "z3ext"), raised
    assert lines[-1] == "IMPORTED False", lines
