"""The line a z3ext engine logs at `deepspeed.initialize` ([Note: handover line] in deepspeed_z3ext/handover.py):
exactly one per engine on rank 0, saying what z3ext owns and what it hands to DeepSpeed and why, for each
hand-over; a real one-rank engine on CPU, its stderr and DeepSpeed log captured. Each engine then trains a step, and the
gradient path it took is the one its line named."""
import pytest

from tests.harness import run_on_ranks

CASES = {
    # case: (z3ext section, zero_optimization extras, config extras, the reason the line must give or None)
    "default": (True, {}, {}, None),
    "reduce_gradients_false": ({"enabled": True, "reduce_gradients": False}, {}, {}, "z3ext.reduce_gradients is false"),
    "offload_optimizer_cpu": (True, {"offload_optimizer": {"device": "cpu"}}, {"zero_force_ds_cpu_optimizer": False},
                              "zero_optimization.offload_optimizer"),
    "reduce_scatter_false": (True, {"reduce_scatter": False}, {}, "zero_optimization.reduce_scatter is false"),
    "no_optimizer": (True, {}, {}, "no optimizer"),
    "stock": (False, {}, {}, None),
}


def handover_cases():
    import contextlib
    import io
    import logging

    import deepspeed
    import deepspeed_z3ext  # noqa: F401 (the seams)
    from deepspeed.utils import logger
    from deepspeed_z3ext.handover import PREFIX
    from tests.models import TinyGPT, batch, ds_config

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.said = []

        def emit(self, record):
            if PREFIX in record.getMessage():
                self.said.append(record.getMessage())

    def initialize(cfg, level):
        """The engine, and the handover lines logged and printed to stderr during its initialize."""
        handler, stderr, old_level = Lines(), io.StringIO(), logger.level
        logger.addHandler(handler)
        logger.setLevel(level)
        try:
            with contextlib.redirect_stderr(stderr):
                model = TinyGPT()
                engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        finally:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
        return engine, handler.said, [line for line in stderr.getvalue().splitlines() if PREFIX in line]

    out = {}
    for case, (section, zero_extra, extra, _) in CASES.items():
        cfg = ds_config(z3ext=section, zero_extra=zero_extra, extra=extra, ga=1)
        if case == "no_optimizer":
            del cfg["optimizer"]
        # DeepSpeed's default level (warnings only): the line goes to stderr; at INFO it is logged instead.
        engine, logged, printed = initialize(cfg, logging.INFO)
        engine.destroy()
        out["logged_at_info", case] = (logged, printed)
        engine, logged, printed = initialize(cfg, logging.WARNING)
        assert logged == [], logged
        said = printed
        path = None
        if case not in ("no_optimizer", "stock"):
            loss = engine(batch(0, 0))
            engine.backward(loss)
            engine.step()
            reducer = engine.optimizer.parameter_offload.z3ext.grad_reducer
            path = "deepspeed" if reducer is False else type(reducer).__name__
        out[case] = (said, path)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def cases():
    return run_on_ranks(handover_cases, world_size=1, timeout=600)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_line_says_what_z3ext_owns_and_hands_to_deepspeed(cases, case):
    said, path = cases[case]
    reason = CASES[case][3]
    if case == "stock":
        assert said == [], said
        return
    assert len(said) == 1, said
    line = said[0]
    assert "z3ext owns gather and release of " in line and " ZeRO-3 parameters" in line, line
    if case == "default":
        assert "and the gradient reduce-scatter;" in line and "hands" not in line, line
        assert path == "GradReducer"
    elif case == "no_optimizer":
        assert "no optimizer, so no gradients are reduced" in line, line
    else:
        assert f"it hands the gradient reduce-scatter to DeepSpeed, for {reason}" in line, line
        assert path == "deepspeed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_line_goes_to_deepspeeds_logger_where_it_shows_info(cases, case):
    """Where DeepSpeed's logger shows INFO the line is logged there and not printed: one line either way."""
    logged, printed = cases["logged_at_info", case]
    assert printed == []
    assert logged == cases[case][0], (logged, cases[case][0])
