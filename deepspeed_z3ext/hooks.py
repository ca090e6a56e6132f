"""Module hooks: z3ext's two per-module hooks in place of DeepSpeed's four.

[Note: module hooks] DeepSpeed registers four hooks on every module: a forward pre-hook (fetch), a
forward hook (release), and two more that wrap every output and every input tensor in an autograd
Function so that backward can fetch before and release after each module. Those wrappers run on
every forward, grad-enabled or not, and cost more host time than the fetch itself. z3ext registers
one forward pre-hook and one forward hook per module:
- pre-forward: the module joins DeepSpeed's forward module stack and the coordinator fetches its unit;
- post-forward (`always_call`: also when the forward raised, or when non-reentrant checkpointing
  stopped a recomputation early inside it, so no module is left running and no Forward claim
  behind): it leaves the stack, a parameter returned as an output is registered as external to the
  enclosing module (as DeepSpeed's hook does), and the coordinator releases the unit or holds it for
  the backward of this call's autograd graph ([Note: hold for backward], [Note: graph claims]).
A held module needs nothing in backward. Only a module that was not held in a grad-enabled forward
gets backward hooks, and cheap ones, owned by that one call (graphs.claim_per_call). Inputs and
outputs are walked at any depth (tuples, lists, dicts, namedtuples, dataclasses, HF ModelOutput),
as DeepSpeed's `apply_to_tensors_only` does. The root module also carries DeepSpeed's
start-of-forward hook (`reset_step`) and, before it, one that notes whether the call passes a KV cache
([Note: generation residency] in resident_set.py).
"""
import functools
import sys

import torch
from deepspeed.runtime.zero.partition_parameters import register_external_parameter, unregister_external_parameter
from deepspeed.utils import z3_leaf_module

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.conditional import is_conditional
from deepspeed_z3ext.epoch import TREE
from deepspeed_z3ext.graphs import tensors_in as _tensors
from deepspeed_z3ext.lifted import LiftedHooks
from deepspeed_z3ext.state import of_param


def _dangling(module, params):
    """A module that returns one of its parameters (e.g. an embedding's weight for a tied head): the
    parameter is registered to the enclosing module, which uses it, as DeepSpeed's hook does."""
    stack = private.forward_module_stack()
    for param in params:
        if not stack:
            return
        if not any(id(param) in m._external_params for m in stack):
            param.is_external_param = True
            register_external_parameter(stack[-1], param)
            if id(param) in module._external_params:
                unregister_external_parameter(module, param)
            TREE.advance()  # both modules' units change ([Note: tree epoch])
            state = of_param(param)
            if state is not None:
                # Claimed for the enclosing module's forward: a direct gather would end with the
                # release of `module`, which comes next, before the enclosing module uses it.
                state.discover_external(stack[-1], param)
            else:
                param.all_gather()


# [Note: input boundary] The identity node stock DeepSpeed puts on every module input
# (`PostBackwardFunctionModule`: forward `detach()`, backward passes the gradient through; here
# csrc/boundary.h). z3ext needs no such node for its own bookkeeping, but it decides how autograd
# sums the gradient of a tensor read both inside a module and outside it: with the node, the
# module's own uses are summed first (in the node's input buffer), then added to the outside ones;
# without it, all are summed in execution order. HF Llama's RMSNorm reads its input twice and the
# residual reads it again: without the node the gradients differed from stock's in the last bit
# (issue 15, item 6). Only inputs that need grad get it, in grad mode (elsewhere it changes nothing).
def _boundary(value, boundary, depth=0):
    if torch.is_tensor(value):
        if not value.requires_grad:
            return value
        out = boundary(value)
        if hasattr(value, "ds_id"):
            out.ds_param_alias = value  # as stock: a parameter passed as input stays recognisable
        return out
    if depth > 32:
        return value
    if isinstance(value, (tuple, list)):
        items = [_boundary(v, boundary, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):  # in place, as stock (keeps dict subclasses)
        for k in value:
            value[k] = _boundary(value[k], boundary, depth + 1)
    return value


def _input_boundary(args, boundary):
    """The module's positional inputs with boundary nodes, or None when none needs grad."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor):  # most modules: one tensor, no walk
        return (_boundary(args[0], boundary), ) if args[0].requires_grad else None
    out = _boundary(args, boundary)
    return None if out is args else out


# [Note: eager hooks] z3ext's hooks must never be traced by Dynamo (they gather, release and claim),
# so they are `torch.compiler.disable`d. The disabled wrapper swaps the frame-evaluation callback out
# and back on every call: on the 2-core VM an `nn.Linear(4, 4)` call takes 5.2 us without hooks, 7.0
# with two plain hooks and 8.2 with two disabled ones, two hook calls per module per forward. In
# eager, where there is no callback to swap, the hook runs its body directly; under a compiled region,
# where the callback is set, through the disabled wrapper. Dynamo sees the disabled function's marks
# on it (it refuses to inline it, with the same graph break), and its code is skipped as a frame of
# its own (called eagerly after a graph break). tests/test_compile.py compiles a z3ext engine.
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
_frame_callback = getattr(_eval_frame, "get_eval_frame_callback", None)


def _never_traced(fn, lifted):
    # Dynamo is imported here, at the first hook registration, not at `import deepspeed_z3ext`:
    # `torch._dynamo` takes about a second to import and a program that never registers hooks
    # (`python -m deepspeed_z3ext`, stock engines) does not need it (tests/test_build.py).
    disabled = torch.compiler.disable(fn)
    if _frame_callback is None:
        return disabled
    def hook(*args):
        if _frame_callback() is None:
            return fn(*args)
        lifted.compiled += 1  # no member hooks lifted from here ([Note: member hooks] in lifted.py)
        try:
            return disabled(*args)
        finally:
            lifted.compiled -= 1

    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)  # loaded by torch.compiler.disable
    if skip_code is not None:
        skip_code(hook.__code__)  # called outside a traced frame (after a graph break): not a frame to compile
    for attr in ("_torchdynamo_disable", "_torchdynamo_disable_msg", "_torchdynamo_orig_callable",
                 "_torchdynamo_disable_recursive"):
        if hasattr(disabled, attr):
            setattr(hook, attr, getattr(disabled, attr))
    return hook


def register(offload, module):
    """Numbers the module tree (ds_id) and registers z3ext's hooks on every module; handles go to the
    offload's `forward_hooks`, which DeepSpeed removes and re-registers through this same method."""
    boundary = ops().input_boundary
    counter = [0]
    lifted = offload.__dict__.setdefault("z3ext_lifted", LiftedHooks())

    def visit(m):
        m.ds_id = counter[0]
        m.ds_recompute_parameters = set()
        if z3_leaf_module(m):
            for p in m.parameters():
                p.ds_z3_leaf_module = m
        else:
            for child in m.children():
                if is_conditional(child):
                    continue  # gathered with `m`, no hooks of its own ([Note: conditional modules])
                counter[0] += 1
                visit(child)
        pre = m.register_forward_pre_hook(_pre_forward)
        post = m.register_forward_hook(_post_forward, always_call=True)
        # [Note: lifted hooks] in lifted.py: every module's but the root's may be lifted in a generation step
        offload.forward_hooks.extend(lifted.add(m, pre, post) if m is not module else (pre, post))

    stack = private.forward_module_stack()

    grad_enabled = torch.is_grad_enabled

    @functools.partial(_never_traced, lifted=lifted)
    def _pre_forward(m, args):
        stack.append(m)
        coordinator = offload.param_coordinator
        resident = coordinator.resident
        if resident.fast:  # [Note: resident fast path] in resident_set.py
            if id(m) in resident.fast_ids and not grad_enabled():
                return
            resident.leave_fast_path()
        coordinator.fetch_sub_module(m, True)
        if grad_enabled():
            return _input_boundary(args, boundary)

    @functools.partial(_never_traced, lifted=lifted)
    def _post_forward(m, args, output):
        raised = output is None and sys.exc_info()[0] is not None
        if stack and stack[-1] is m:
            stack.pop()
        resident = offload.param_coordinator.resident
        if resident.fast and id(m) in resident.fast_ids:  # [Note: resident fast path]: nothing to release
            if isinstance(output, torch.Tensor) and (hasattr(output, "ds_id") or hasattr(output, "ds_param_alias")):
                _dangling(m, [output if hasattr(output, "ds_id") else output.ds_param_alias])
            return
        if isinstance(output, torch.Tensor):  # most modules: one tensor, no walk
            outputs = (output, )
            if hasattr(output, "ds_id") or hasattr(output, "ds_param_alias"):
                _dangling(m, [output if hasattr(output, "ds_id") else output.ds_param_alias])
        else:
            outputs = _tensors(output) if output is not None else ()
            returned = [t if hasattr(t, "ds_id") else t.ds_param_alias for t in outputs
                        if hasattr(t, "ds_id") or hasattr(t, "ds_param_alias")]
            if returned:
                _dangling(m, returned)
        offload.param_coordinator.release_sub_module(m, grad_enabled(), args, outputs, raised)

    Tensor = torch.Tensor

    def _member_forward(group, module, forward, *args, **kwargs):
        # A group member's call while its group is open, in place of its two hooks ([Note: member hooks] in
        # lifted.py): the pre-forward hook's input boundary, in grad mode. Most members take one tensor: its
        # boundary inline (this runs for every member of every block). While the group is closed its hooks go back
        # and the call runs through them ([Note: kept lift] in lifted.py).
        if not group.open:
            return lifted.closed_call(group, module, args, kwargs)
        if not grad_enabled():  # inside a no_grad region of the owner's forward: a reentrant checkpoint's, say
            offload.param_coordinator.plan.members_without_grad.append(module)
        elif args:
            if len(args) == 1 and isinstance(args[0], Tensor):
                x = args[0]
                if x.requires_grad:
                    out = boundary(x)
                    if hasattr(x, "ds_id"):
                        out.ds_param_alias = x  # as _boundary does
                    return forward(out, **kwargs)
            else:
                with_boundary = _input_boundary(args, boundary)
                if with_boundary is not None:
                    args = with_boundary
        return forward(*args, **kwargs)

    lifted.member_boundary = _member_forward

    @functools.partial(_never_traced, lifted=lifted)
    def _root_call(m, args, kwargs):
        # [Note: generation residency]: HF generate passes its KV cache; read before DeepSpeed's start-of-forward hook
        # (`past_key_values`; `cache` since transformers 5.25)
        offload.param_coordinator.resident.generating = (kwargs.get("past_key_values") is not None
                                                         or kwargs.get("cache") is not None)

    offload.forward_hooks.append(module.register_forward_pre_hook(_root_call, prepend=True, with_kwargs=True))
    visit(module)
