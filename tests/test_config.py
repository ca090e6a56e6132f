"""The config at `deepspeed.initialize` (real engines, one gloo rank): every bad `"z3ext"` value is an
error naming its key ("auto" included), each DeepSpeed ZeRO-3 option z3ext does not honour is refused by
name unless it has DeepSpeed's default, and HF Trainer's standard ZeRO-3 config is accepted and trains."""
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
}

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
