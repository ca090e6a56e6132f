"""The optimizer step's gradient norm without a Python loop over parameters ([Note: gradient norm]).

[Note: gradient norm] Stock's `_get_norm_groups` walks every gradient partition in Python: per
parameter `g.to(device).to(fp64).norm(2)` (three dispatches and their Python), then per sub-group
`sum(pow(stack(norms), 2))`, one all-reduce and `** 0.5`: host work per parameter at every step (5.4 of
the 6.6 ms optimizer step of a 0.94B GPT at a simulated world of 64). z3ext computes the same per-
partition norms with one `torch._foreach_norm(partitions, 2, dtype=fp64)` per sub-group, the same
stack / pow / sum, and one all-reduce of every sub-group's sum together, then stock's root and its -1
for an inf/NaN norm. On CPU `_foreach_norm` runs `linalg_vector_norm` per tensor, the op stock's
`.norm` runs: the norm is stock's bit for bit (tests/test_gradients.py). On CUDA, where a sub-group's
partitions lie back to back in the gradient buffer (the step view's run, [Note: step view validity] in
grads.py), the run is the kernel's one tensor: the same sum of squares in fp64 without the per-tensor
host work and launches of ~400 partitions (bench/norm_forms.py on the H200: 838M bf16 elements 1.55 ->
0.79 ms, 105M 1.03 -> 0.14 ms); a run broken by a frozen parameter's zeros takes the per-partition form.
The fused kernel adds in another order than stock's loop, so on CUDA the norm may differ from stock's in
rounding (the GPU tests print the largest relative difference and bound it by 1e-9; on an H200 at most
2.2e-16 there, and none over 838M-element draws, bench/norm_forms.py); that reaches the numbers only where
clipping triggers (the clip coefficient) and in the reported norm.
`"z3ext": {"exact_grad_norm": true}` keeps stock's loop. Taken where stock's norm is a plain data-parallel
one: z3ext owns the gradient path (no optimizer offload), no model-parallel group, no AutoEP experts, no
Muon, and every sub-group on one process group with partitions; anything else runs stock's method.
"""
from typing import List, Optional

import torch
from deepspeed import comm as ds_comm
from deepspeed.comm import pg_utils
from deepspeed.runtime.zero.utils import get_norm_dtype

from deepspeed_z3ext.state import of_optimizer


def _process_group(optimizer) -> Optional[object]:
    """The one partition group of every sub-group when the fast norm can apply, else None ([Note:
    gradient norm]). A walk over every parameter: run once per engine (its groups are fixed), never per
    step."""
    if getattr(optimizer, "use_muon", False) or pg_utils.is_parallel(optimizer.model_parallel_group):
        return None
    group = None
    for params in optimizer.fp16_groups:
        if not params or optimizer._autoep_expert_parallel_group(params) is not None:
            return None
        optimizer._assert_same_partition_group(params)
        pg = optimizer._get_param_partition_group(params[0])
        if group is None:
            group = pg
        elif pg != group:
            return None
    return group


def norm_groups(optimizer) -> Optional[List[torch.Tensor]]:
    """Stock's `_get_norm_groups` result from one multi-tensor norm per sub-group and one all-reduce, or
    None where stock's must run."""
    state = of_optimizer(optimizer)
    reducer = state.grad_reducer if state is not None else None
    if not reducer or state.config.exact_grad_norm or getattr(optimizer, "sub_groups_lacking_loss_scale", ()):
        return None
    if reducer.norm_group is None:
        reducer.norm_group = (_process_group(optimizer), )
    group = reducer.norm_group[0]
    grads = [optimizer.averaged_gradients.get(i) for i in range(len(optimizer.fp16_groups))]
    if group is None or not all(grads):
        return None
    norm_dtype = get_norm_dtype()
    sums = []
    for i, g in enumerate(grads):
        run = reducer.gradient_run(optimizer, i) if g[0].is_cuda else None
        if run is not None:  # [Note: gradient norm]: on CUDA the run as the kernel's one tensor
            sums.append(torch.pow(torch._foreach_norm([run], 2.0, dtype=norm_dtype)[0], 2.0))
        else:
            sums.append(torch.sum(torch.pow(torch.stack(torch._foreach_norm(g, 2.0, dtype=norm_dtype)), 2.0)))
    total = torch.stack(sums)
    state.agreement.collective([6, 0, -1, total.numel(), 1],  # [Note: agree before the collective] in csrc/agreement.h
                               lambda async_op: ds_comm.all_reduce(total, op=ds_comm.ReduceOp.SUM, group=group,
                                                                   async_op=async_op), group)
    total = total**(1. / 2.0)
    err = torch.tensor(-1.0, device=optimizer.device, dtype=torch.float)
    total = torch.where(total.isnan().logical_or(total.isinf()), err, total)
    reducer.count_norm()
    return list(total.unbind())


def get_norm_groups(stock):
    def _get_norm_groups(self):
        norms = norm_groups(self)
        return stock(self) if norms is None else norms

    return _get_norm_groups
