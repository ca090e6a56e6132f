"""Generation controls: a block whose no_grad forwards keep their units resident, an explicit release, and
`engine.backward` and `engine.train()` ending residency ([Note: generation residency] in resident_set.py)."""
import contextlib

import torch

from deepspeed_z3ext.state import of_engine, of_param


def _coordinator(model):
    """The coordinator of a z3ext engine, given the engine or its module (TRL generates on `engine.module`)."""
    state = next((of_param(p) for p in model.parameters() if of_param(p) is not None), None) if isinstance(
        model, torch.nn.Module) else None
    if state is None or state.coordinator is None:
        raise ValueError(f"z3ext is not enabled for this {type(model).__name__}: pass a DeepSpeed engine (or its "
                         "module) whose config has \"z3ext\": true")
    return state.coordinator


def release_resident(model):
    """Releases what no_grad forwards kept gathered; `model`: a z3ext engine or its module."""
    _coordinator(model).release_resident()


@contextlib.contextmanager
def resident(model, numel=None):
    """Inside, no_grad forwards of `model` keep up to `numel` elements gathered (default: the engine's
    `z3ext.resident_numel`); everything they kept is released on exit, also when the body raises."""
    coordinator = _coordinator(model)
    if numel is not None and (not isinstance(numel, int) or isinstance(numel, bool) or numel < 0):
        raise ValueError(f"deepspeed_z3ext.resident: numel must be an int >= 0 or None, got {numel!r}")
    res = coordinator.resident
    budget, explicit = res.budget, res.explicit
    coordinator.release_resident()  # what an earlier generation kept counts against another budget
    # [Note: arguments that must agree] in schedule.py: every rank keeps within the smallest budget
    wanted = res.default_budget() if numel is None else numel
    rows = coordinator.state.agreement.agreed("deepspeed_z3ext.resident(engine, numel)", [wanted], minimum=0)
    res.budget = min(r[0] for r in rows)
    res.explicit = True  # every no_grad forward inside keeps, the first one too
    try:
        yield
    finally:
        res.budget, res.explicit = budget, explicit
        coordinator.release_resident()


def engine_backward(stock):
    """`DeepSpeedEngine.backward` (seams.py): what no_grad forwards kept is released before a backward."""

    def backward(self, *args, **kwargs):
        state = of_engine(self)
        if state is not None and state.coordinator is not None:
            state.coordinator.release_resident()
        return stock(self, *args, **kwargs)

    return backward


def engine_train(stock):
    """`DeepSpeedEngine.train` (seams.py): training mode ends residency."""

    def train(self, mode=True):
        if mode:
            state = of_engine(self)
            if state is not None and state.coordinator is not None:
                state.coordinator.release_resident()
        return stock(self, mode)

    return train
