"""DeepSpeed's memory-efficient linear without its Python autograd Function: no Function where no graph is built,
one C++ node where one is.

[Note: no_grad linear] With `memory_efficient_linear` (DeepSpeed's default) every `F.linear` of the process
is `LinearFunctionForZeroStage3.apply`: an autograd Function whose `apply` binds its arguments through
`inspect.signature` and runs `setup_context` (the saved tensors and the autocast state) on every call, also
under `no_grad`, where nothing will ever read them. In a generated token that is most of what a linear
layer costs on the host beyond its matmul. For a z3ext parameter with grad mode off, z3ext calls the
Function's own `forward` (the same ops: `addmm` for a 2-D input with a bias, else `matmul` and the bias
added in place), so the result is the same bits. The same holds for a weight that is no ZeRO-3 parameter at
all: DeepSpeed's replacement of `F.linear` persists for the whole process once `deepspeed.zero.Init` has run,
so a plain model beside the engine (a reference or reward model, generation's unsharded baseline) pays the
Function for every linear too. For a stock engine's parameter and for a subclass, DeepSpeed's `apply` runs as before.

[Note: grad-mode linear] With grad mode on, the same Function costs a linear layer far more than its ops: `apply`
(Python up to torch 2.13, with the binding above), `setup_context` (the accelerator, the autocast state, the saved
tensors) and, in backward, a Python method under a `torch.autocast` context that takes the GIL for every linear
node: on the 2-core VM an 8x64 linear took 30.6 us of host time in forward against F.linear's 5.3, 135 against 66
in forward and backward (bench/NOTES.md v36). For a z3ext weight (a plain Parameter), plain inputs, in eager, the
node is csrc/linear.h's `ZeroLinear`: the Function's ATen calls in the same order, forward and backward, so the
same bits as stock's, in one C++ call. Stock's Function still runs where its bookkeeping could differ: autocast on
for the inputs' device (its backward replays the forward's autocast state; the node's backward runs with autocast
off, which is stock's state when the forward had none), tensors a functorch transform, a Python dispatch key or a
torch function mode would see, a tensor subclass, code Dynamo traces, and a weight that is no z3ext parameter (a
plain model's keeps the Function its graph names: DeepSpeed's own tests look for it). A weight that is released
when its node runs (DeepSpeed's Function gathers it and releases it after) goes to stock's backward itself
(`released_backward`).

[Note: linear in one call] Even with the shortcut and the node, a linear layer's call went through three Python
frames before its ops: DeepSpeed's `zero3_linear_wrap` (what `F.linear` is), the Function's `apply` (the seam
below) and, under no_grad, the Function's `forward`; the unsharded model makes one C call (a generated token of a
16-layer Llama runs 113 linears). The seam's first step is now one C++ call (csrc/linear.h `linear_call`) that runs
the forward's ops (no_grad) or the node (grad mode) where the two notes above would, the same bits, or declines to
the rest of the seam (a subclass, a torch function mode, a stock engine's weight, autocast in grad mode). Code
Dynamo traces never reaches the seam (Dynamo traces `Function.apply` as the Function's forward and backward); a
make_fx-based trace (non-strict export) sets `torch.compiler`'s compiling flag, which the seam reads as a flag:
`torch.compiler.is_compiling()` is two Python calls per linear. `F.linear` stays DeepSpeed's own function
(`F.linear is zero3_linear_wrap`, which DeepSpeed's tests check): replacing it too would save one more frame per
linear.
"""
import inspect
from types import SimpleNamespace

import torch

from deepspeed_z3ext.state import STATE_ATTR


def stock_apply_seam(_stock):
    """`LinearFunctionForZeroStage3.apply` (a classmethod) with the no_grad shortcut and the grad-mode node, in one
    C++ call where it can ([Note: linear in one call])."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3 as owner
    from deepspeed_z3ext._ops import ops
    forward = owner.forward
    # torch's `Function.apply` as the class holds it (a Python classmethod up to torch 2.13, a C one
    # after), bound below to whichever class calls: a subclass keeps its own `cls`.
    descriptor = inspect.getattr_static(owner, "apply")
    grad_enabled = torch.is_grad_enabled
    # `torch.compiler.is_compiling()` outside TorchScript, read as the flag it returns ([Note: linear in one call])
    compiler = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()
    linear_call = None

    def apply(cls, *args, **kwargs):
        nonlocal linear_call
        if cls is owner and not kwargs and 2 <= len(args) <= 3:
            if not compiler._is_compiling_flag:
                # [Note: grad-mode linear] and [Note: no_grad linear] for plain tensors without a torch function
                # mode (a subclass's __torch_function__ would not see C++'s ops); the node declines autocast and
                # wrapped tensors itself.
                if linear_call is None:
                    _load(ops())
                    linear_call = ops().linear_call
                out = linear_call(*args)
                if out is not None:
                    return out
            # [Note: no_grad linear] for what the C++ call declined: a z3ext weight, or none of ZeRO's
            if not grad_enabled() and (hasattr(args[1], STATE_ATTR) or not hasattr(args[1], "ds_id")):
                return forward(*args)
        return descriptor.__get__(None, cls)(*args, **kwargs)

    return classmethod(apply)


class _CompilingFlag:
    """`torch.compiler._is_compiling_flag` where a torch version has no such flag."""

    @property
    def _is_compiling_flag(self):
        return torch.compiler.is_compiling()


def _load(ops):
    ops.set_linear_released_backward(released_backward)


def released_backward(grad_output, input, weight, bias, needs_input_grad):
    """Stock's backward for a ZeroLinear node whose weight is empty when it runs (csrc/linear.h): DeepSpeed's
    own code, which gathers a released weight and releases it after, with the forward's autocast state (off)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3, _get_autocast_dtype
    ctx = SimpleNamespace(saved_tensors=(input, weight, bias), needs_input_grad=needs_input_grad,
                          _fwd_used_autocast=False, _dtype=_get_autocast_dtype(get_accelerator().device_name()))
    return tuple(LinearFunctionForZeroStage3.backward(ctx, grad_output))
