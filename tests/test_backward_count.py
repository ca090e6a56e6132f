"""[Note: backward hook count] (csrc/backward_count.h): z3ext's one-call count of the parameters a running
backward reaches is DeepSpeed's own `count_used_parameters_in_backward`, compared inside real backward
passes: parameters used, unused in this forward, shared, never used with grad, frozen, non-leaf tensors,
a reentrant checkpoint's inner backward, and a second backward over a retained graph. A backward
restricted to some inputs (`autograd.grad`) is left to DeepSpeed's function (the op returns None);
outside a backward the op raises DeepSpeed's message. Stage 3 calls it through the seam (tests/test_seams.py)."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from deepspeed.runtime.utils import count_used_parameters_in_backward as stock_count

from deepspeed_z3ext._ops import ops


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)       # unused when `use_b` is False
        self.shared = nn.Linear(4, 4)  # applied twice
        self.never = nn.Linear(4, 4)   # never used with grad enabled
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x, use_b, reentrant=False):
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        if reentrant:
            h = checkpoint(lambda t: self.shared(self.shared(t)), h, use_reentrant=True)
        else:
            h = self.shared(self.shared(h))
        return self.frozen(h)


def _counts_in_backward(model, params, **forward):
    """(z3ext's count, DeepSpeed's count) at every gradient hook of one backward."""
    seen = []

    def hook(grad):
        seen.append((ops().count_used_in_backward(params), stock_count(params)))

    for p in params:
        if p.requires_grad:
            p.register_hook(hook)
    model(torch.randn(3, 4), **forward).sum().backward()
    return seen


@pytest.mark.parametrize("use_b", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_count_equals_deepspeeds_inside_backward(use_b, reentrant):
    model = _Branches()
    with torch.no_grad():
        model.never(torch.randn(1, 4))
    params = list(model.parameters())
    seen = _counts_in_backward(model, params, use_b=use_b, reentrant=reentrant)
    assert seen, "no gradient hook ran"
    for ours, stock in seen:
        assert ours == stock, seen
    # What the backward reaches: a, shared (+ b); with a reentrant checkpoint, the outer backward reaches
    # a (+ b) and the checkpoint's inner backward shared alone.
    expected = {2 + 2 * use_b, 2} if reentrant else {4 + 2 * use_b}
    assert {s for _, s in seen} == expected, seen


def test_count_of_non_leaf_tensors_and_a_retained_graph():
    model = _Branches()
    params = list(model.parameters())
    x = torch.randn(3, 4, requires_grad=True)
    mid = model.a(x)  # a non-leaf tensor: its node is its grad_fn
    tensors = params + [mid, mid]
    seen = []
    mid.register_hook(lambda g: seen.append((ops().count_used_in_backward(tensors), stock_count(tensors))))
    out = model.shared(mid).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert len(seen) == 2 and all(a == b for a, b in seen) and seen[0][0] == 5, seen  # a, shared, mid once


def test_restricted_backward_is_left_to_deepspeed_and_outside_backward_raises():
    model = _Branches()
    params = [model.a.weight, model.a.bias]
    seen = []
    h = model.a(torch.randn(3, 4))
    h.register_hook(lambda g: seen.append(ops().count_used_in_backward(params)))
    torch.autograd.grad(model.shared(h).sum(), [model.a.weight])
    assert seen == [None], seen
    with pytest.raises(RuntimeError, match="must be called during backward execution"):
        ops().count_used_in_backward(params)
