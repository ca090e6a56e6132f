"""DeepSpeed's memory-efficient linear without autograd's per-call cost where no graph is built.

[Note: no_grad linear] With `memory_efficient_linear` (DeepSpeed's default) every `F.linear` of the process
is `LinearFunctionForZeroStage3.apply`: an autograd Function whose `apply` binds its arguments through
`inspect.signature` and runs `setup_context` (the saved tensors and the autocast state) on every call, also
under `no_grad`, where nothing will ever read them. In a generated token that is most of what a linear
layer costs on the host beyond its matmul. For a z3ext parameter with grad mode off, z3ext calls the
Function's own `forward` (the same ops: `addmm` for a 2-D input with a bias, else `matmul` and the bias
added in place), so the result is the same bits. The same holds for a weight that is no ZeRO-3 parameter at
all: DeepSpeed's replacement of `F.linear` persists for the whole process once `deepspeed.zero.Init` has run,
so a plain model beside the engine (a reference or reward model, generation's unsharded baseline) pays the
Function for every linear too. With grad mode on, for a stock engine's parameter and for a subclass,
DeepSpeed's `apply` runs as before.
"""
import inspect

import torch

from deepspeed_z3ext.state import STATE_ATTR


def no_grad_apply(_stock):
    """`LinearFunctionForZeroStage3.apply` (a classmethod) with the no_grad shortcut."""
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3 as owner
    forward = owner.forward
    # torch's `Function.apply` as the class holds it (a Python classmethod up to torch 2.13, a C one
    # after), bound below to whichever class calls: a subclass keeps its own `cls`.
    descriptor = inspect.getattr_static(owner, "apply")
    grad_enabled = torch.is_grad_enabled

    def apply(cls, *args, **kwargs):
        if cls is owner and not kwargs and 2 <= len(args) <= 3 and not grad_enabled() and (
                hasattr(args[1], STATE_ATTR) or not hasattr(args[1], "ds_id")):  # a z3ext weight, or none of ZeRO's
            return forward(*args)
        return descriptor.__get__(None, cls)(*args, **kwargs)

    return classmethod(apply)
