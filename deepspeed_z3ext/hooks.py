"""Module hooks: z3ext's two per-module hooks in place of DeepSpeed's four.

[Note: module hooks] DeepSpeed registers four hooks on every module: a forward pre-hook (fetch), a
forward hook (release), and two more that wrap every output and every input tensor in an autograd
Function so that backward can fetch before and release after each module. Those wrappers run on
every forward, grad-enabled or not, and cost more host time than the fetch itself. z3ext registers
one forward pre-hook and one forward hook per module:
- pre-forward: the module joins DeepSpeed's forward module stack and the coordinator fetches its unit;
- post-forward: it leaves the stack, a parameter returned as an output is registered as external to
  the enclosing module (as DeepSpeed's hook does), and the coordinator releases the unit or holds it
  for backward ([Note: hold for backward]).
A held module needs nothing in backward: its parameters are gathered, and the stage-3 optimizer's
backward epilogue releases what backward held (`release_backward_leftovers`). Only a module that was
not held in a grad-enabled forward gets backward hooks, and cheap ones: a tensor hook on its outputs
fetches before its backward, a tensor hook on its inputs releases once their gradient is complete
(after this module's backward; later than stock when an input has other consumers, never earlier).
The root module also carries DeepSpeed's start-of-forward hook (`reset_step`).
"""
import torch
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter
from deepspeed.utils import z3_leaf_module

from deepspeed_z3ext.state import STATE_ATTR


def _tensors(value):
    if torch.is_tensor(value):
        return (value, )
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if torch.is_tensor(v))
    if isinstance(value, dict):
        return tuple(v for v in value.values() if torch.is_tensor(v))
    return tuple(v for k, v in vars(value).items() if not k.startswith("__") and torch.is_tensor(v)) \
        if hasattr(value, "__dict__") else ()


def _dangling(module, params):
    """A module that returns one of its parameters (e.g. an embedding's weight for a tied head): the
    parameter is registered to the enclosing module, which uses it, as DeepSpeed's hook does."""
    stack = parameter_offload.FWD_MODULE_STACK
    for param in params:
        if not stack:
            return
        if not any(id(param) in m._external_params for m in stack):
            param.is_external_param = True
            register_external_parameter(stack[-1], param)
            if id(param) in module._external_params:
                unregister_external_parameter(module, param)
            state = getattr(param, STATE_ATTR, None)
            if state is not None:
                # Claimed for the enclosing module's forward: a direct gather would end with the
                # release of `module`, which comes next, before the enclosing module uses it.
                state.discover_external(stack[-1], param)
            else:
                param.all_gather()


def register(offload, module):
    """Numbers the module tree (ds_id) and registers z3ext's hooks on every module; handles go to the
    offload's `forward_hooks`, which DeepSpeed removes and re-registers through this same method."""
    counter = [0]

    def visit(m):
        m.ds_id = counter[0]
        m.ds_recompute_parameters = set()
        if z3_leaf_module(m):
            for p in m.parameters():
                p.ds_z3_leaf_module = m
        else:
            for child in m.children():
                counter[0] += 1
                visit(child)
        offload.forward_hooks.append(m.register_forward_pre_hook(_pre_forward))
        offload.forward_hooks.append(m.register_forward_hook(_post_forward))

    stack = parameter_offload.FWD_MODULE_STACK

    @torch.compiler.disable
    def _pre_forward(m, args):
        stack.append(m)
        offload.param_coordinator.fetch_sub_module(m, forward=True)
        if _WRAP_INPUTS and torch.is_grad_enabled():
            return apply_to_tensors_only(_InputBoundary.apply, args)

    @torch.compiler.disable
    def _post_forward(m, args, output):
        if stack and stack[-1] is m:
            stack.pop()
        if output is not None:
            returned = [t if hasattr(t, "ds_id") else t.ds_param_alias for t in _tensors(output)
                        if hasattr(t, "ds_id") or hasattr(t, "ds_param_alias")]
            if returned:
                _dangling(m, returned)
        coord = offload.param_coordinator
        grad = torch.is_grad_enabled()
        held = coord.release_sub_module(m, forward=True, grad_enabled=grad)
        if grad and not held and coord.needs_backward_hooks(m):
            _backward_hooks(coord, m, args, output)

    visit(module)


import os
from deepspeed.runtime.zero.utils import apply_to_tensors_only
_WRAP_INPUTS = os.environ.get("Z3EXT_WRAP_INPUTS", "1") == "1"  # PROTOTYPE switch for issue 15 (6): 0 = old behaviour


class _InputBoundary(torch.autograd.Function):
    """PROTOTYPE: the identity node stock DeepSpeed puts on every module input (PostBackwardFunctionModule)."""

    @staticmethod
    def forward(x):
        return x.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _backward_hooks(coord, module, args, output):
    outs = [t for t in _tensors(output) if t.requires_grad]
    ins = [t for t in _tensors(args) if t.requires_grad]
    if not outs:
        return
    state = {"fetched": False, "pending": len(ins)}

    def before(grad):
        if not state["fetched"]:
            state["fetched"] = True
            coord.fetch_sub_module(module, forward=False)

    def after(grad):
        state["pending"] -= 1
        if state["pending"] == 0 and state["fetched"]:
            coord.release_sub_module(module, forward=False)

    for t in outs:
        t.register_hook(before)
    for t in ins:
        t.register_hook(after)
