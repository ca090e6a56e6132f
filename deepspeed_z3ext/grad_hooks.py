"""The per-parameter gradient hook of a z3ext engine: stock's decisions, fewer calls ([Note: lean gradient hook]).

[Note: lean gradient hook] Stage 3 registers one post-accumulate-grad hook per trainable parameter
(`create_reduce_and_remove_grad_hooks`). Stock's hook is `instrument_w_nvtx(reduce_partition_and_remove_grads)`:
around its work, an NVTX range push and pop through the accelerator (two `is_compiling` checks each), then
optimizer methods that delegate to its backward-hook state, `reduce_ready_partitions_and_remove_grads`, and
the seam that finds the z3ext reducer from the parameter: about 15 Python calls per parameter (a 32-layer
GPT's 388 gradients: 4.9M of the 30.8M instructions z3ext's backward adds to the model's, bench/NOTES.md v25).
For a z3ext engine each of those hooks is replaced, once, right after stock registers them, by one
function that makes the same calls on DeepSpeed's own state in the same order: the refresh predicate,
the re-entry of a reentrant-checkpoint phase, the gradient's note (skipped inside
`coalesce_grad_reduction`, as stock's `reduce_ready_partitions_and_remove_grads` skips it), the
expected-hook count (stage 3's `count_used_parameters_in_backward`, looked up when called so its seam
applies) and the epilogue decision. What differs: no NVTX range named `reduce_partition_and_remove_grads`
in a profiler's timeline, and the reducer is read from the engine's state instead of through the seam.
[Note: routine gradient hook] All but the first hook of a backward find the post-backward callback queued and
no reentrant phase ending: there DeepSpeed's three calls on its hook state reduce to counting the hook
(deepspeed_private.routine_hook, count_routine_hook: the same attributes, the same values), about 2.5k of the
17.8k host instructions a hook cost (bench/NOTES.md v35); the first hook of each backward or phase, and any
other state, makes the calls.
[Note: a leaf's gradients after its hook] A z3 leaf's full backward hook runs once the gradients of the leaf's
outputs are in, which comes before its parameters' gradients where its inputs need none (its backward has
nothing to give them, so autograd runs the hook first): a leaf at the model's root, or right after a frozen
embedding. Its parameters' gradients then come after the hook and no hook notes them. The hook starts the pass
all the same, and the pass's end reduces a gradient no hook noted as it is (grads.py `_flush`): without a
noted gradient there was no pass, and a model that is one leaf (a mixture-of-experts block at the root) left
every gradient on its parameter, reduced nothing and stepped on zeros (on the CPU, DeepSpeed's `zero_grad`
failed on the gradients left behind).
A z3 leaf module's hook (`reduce_leaf_module_grads`: a full backward hook that gives each of its parameters
without a gradient, an expert no token reached, zeros and reduces them all) is replaced the same way: the same
calls in the same order, the zeros made as stock makes them, the notes without stock's two delegating calls per
parameter (a mixture-of-experts block of 32 experts has 128 parameters). Parameters a z3ext engine does not own
(and engines whose gradients take DeepSpeed's path) note through `reduce_independent_p_g_buckets_and_remove_grads`
as before.
"""
import collections

import weakref

import torch

from deepspeed.runtime.zero import stage3
from torch.utils.hooks import RemovableHandle
from deepspeed.utils import z3_leaf_parameter

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext.errors import Z3extError
from deepspeed_z3ext.grads import reducer_of, stock_path_reason
from deepspeed_z3ext.state import of_optimizer


_NO_HOOKS = collections.OrderedDict()  # what a conditional parameter's placeholder handle removes from

def _hooked_params(optimizer):
    """The parameters stock hooked, in the order it appended their handles to `_grad_acc_hooks`."""
    return [p for group in optimizer.fp16_groups for p in group if p.requires_grad and not z3_leaf_parameter(p)]


def _lean_hook(optimizer, state, params, counted, leaf_modules, name, zero_missing=False):
    """[Note: lean gradient hook]: a parameter's hook (`params` = [it]), or a z3 leaf module's (its parameters,
    `zero_missing`: stock's zeros for those without a gradient)."""

    def hook(*args):
        hooks = routine = private.routine_hook(optimizer)  # [Note: routine gradient hook]
        if routine is None:
            hooks = private.backward_hook_state(optimizer)
            refresh = hooks.should_refresh_expected_hook_count()  # before the re-entry, as stock evaluates it
            hooks.reenter_backward_if_needed()
        reducer = state.grad_reducer
        if reducer is None:  # the first gradient of the engine decides z3ext's path or DeepSpeed's
            reducer = reducer_of(optimizer, params[0])
        if zero_missing and not reducer:  # (stock makes them also inside coalesce_grad_reduction)
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        if not optimizer._coalesce_grad_reduction:
            if reducer:  # a leaf's parameter without a gradient is reduced as zeros ([Note: fixed gradient layout])
                if zero_missing:  # [Note: a leaf's gradients after its hook]
                    reducer.start_pass(torch._C._current_graph_task_id())
                for param in params:
                    if param.grad is not None:
                        reducer.note(param)
                if zero_missing and any(g is not None for g in args[1]):  # after its parameters' gradients
                    reducer.missing_at_leaf(params)
            else:
                for param in params:
                    optimizer.reduce_independent_p_g_buckets_and_remove_grads(param)
        if routine is not None:
            private.count_routine_hook(hooks)
            return
        if refresh:
            expected = stage3.count_used_parameters_in_backward(counted) + leaf_modules
        else:
            expected = hooks.max_expected_hooks_seen
        hooks.update_hook_state_and_maybe_run_epilogue(expected)

    hook.__name__ = hook.__qualname__ = name
    return hook


def create_hooks(stock):
    def create_reduce_and_remove_grad_hooks(self):
        stock(self)
        state = of_optimizer(self)
        if state is None:
            return
        state.optimizer = weakref.ref(self)
        params = _hooked_params(self)
        handles = self._grad_acc_hooks
        if len(handles) != len(params):
            raise Z3extError(f"z3ext: stage 3 registered {len(handles)} gradient hooks for {len(params)} trainable "
                             "non-leaf parameters; this DeepSpeed version hooks differently "
                             "(see deepspeed_private.TESTED_VERSIONS)")
        leaf_modules = len(self.leaf_parameters)
        # On DeepSpeed's gradient path a conditional module's parameters are reduced at the epilogue, zeros where
        # it did not run (grads.note_conditional); z3ext's layout reduces a gradient that did not come as zeros
        # itself, so there they keep their hooks ([Note: fixed gradient layout] in grads.py).
        stock_path = stock_path_reason(self, state) is not None
        skipped = {id(p) for p in state.conditional_params} if stock_path else set()
        counted = [p for p in params if id(p) not in skipped]
        for i, param in enumerate(params):
            handles[i].remove()
            if id(param) in skipped:
                handles[i] = RemovableHandle(_NO_HOOKS)
                continue
            handles[i] = param.register_post_accumulate_grad_hook(
                _lean_hook(self, state, [param], counted, leaf_modules, "z3ext_reduce_partition_and_remove_grads"))
        leaf_handles = self._leaf_module_hooks
        if len(leaf_handles) != leaf_modules:
            raise Z3extError(f"z3ext: stage 3 registered {len(leaf_handles)} leaf-module gradient hooks for "
                             f"{leaf_modules} z3 leaf modules; this DeepSpeed version hooks differently "
                             "(see deepspeed_private.TESTED_VERSIONS)")
        for i, (module, leaf_params) in enumerate(self.leaf_parameters.items()):
            leaf_handles[i].remove()
            leaf_handles[i] = module.register_full_backward_hook(
                _lean_hook(self, state, list(leaf_params), counted, leaf_modules, "z3ext_reduce_leaf_module_grads",
                           zero_missing=True))

    return create_reduce_and_remove_grad_hooks
