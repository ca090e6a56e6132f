"""A bf16 or fp16 parameter's partition is its fp32 master: no low-precision copy between gathers.

[Note: partition is the master] Stock ZeRO-3 keeps two partitions of every trainable parameter: the
low-precision one it gathers (`param.ds_tensor`, views of one flat `lp_param_buffer`) and the optimizer's
fp32 master (`fp32_partitioned_groups_flat`), and copies the master into the first after each step.
With bf16 that is 2 bytes per element and rank on top of the 12 that the master and Adam's two moments
need (FSDP2 keeps those 12 only). With `z3ext.partition_from_master` (the default) a z3ext engine points
each sub-group's low-precision flat and its parameters' `ds_tensor` at the fp32 master instead, as stock
itself does when the model is fp32 ("the so-called fp16 groups are aliases", stage3.py), and frees
`lp_param_buffer`. A gather casts this rank's master slice into its block of the gathered storage and
gathers in place (csrc/engine.h `gather_group`); the value is stock's (stock's step writes `master.to(bf16)`
into its partition by the same rounding, and at initialization the master is the bf16 value widened).
DeepSpeed's copies between the two (the step's, `refresh_fp32_params`, checkpoint loads) become copies of
a tensor onto itself, which torch skips.

Where stock is wrong the master is what the unsharded model has: a write-back after a GatheredParameters
block with `modifier_rank` (a weight loaded after `deepspeed.initialize`) lands in the master, which stock
overwrites with its old master at the next step, and `safe_set_full_fp32_param` is seen by the next
forward, not only after a step. A module-only universal checkpoint load keeps the checkpoint's fp32 value
(stock rounds it to bf16 first).

Not aliased (stock's two partitions kept), per sub-group: optimizer or parameter offload (the master is
on the host or NVMe, the partition on the device), a sub-group already one dtype (fp32), or a sub-group
with parameters of another engine; and no more once DeepCompile takes the engine over (its own gathers read
`ds_tensor` as the parameter's dtype: `unalias` casts the masters into low-precision flats again).
`offload_states` of `lp_params` moves the masters (they are the low-precision partitions) and
`reload_states` brings them back; the parameters' views follow (`repoint`). At `destroy` each parameter
gets a partition of its own dtype back, so a later stock engine of the same model finds what stock made.
"""
from typing import List, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

from deepspeed_z3ext.grads import reducer_of
from deepspeed_z3ext.state import of_optimizer

SWITCH = "_z3ext_partition_is_master"  # on the optimizer: the sub-groups whose partitions are the masters


def reason_not(optimizer, state) -> Optional[str]:
    """Why this engine keeps stock's low-precision partitions, or None."""
    if not state.config.partition_from_master:
        return "z3ext.partition_from_master is false"
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "offload_param", False):
        return "optimizer or parameter offload (the master is not beside the partition)"
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        return "NVMe offload"
    return None


def _view_master(optimizer, i):
    """Sub-group i's low-precision flat is its master, each parameter's `ds_tensor.data` its view of it."""
    optimizer.fp16_partitioned_groups_flat[i] = optimizer.fp32_partitioned_groups_flat[i]
    optimizer._unflatten_partitioned_parameters(i)


def alias(optimizer, state):
    """After `_create_fp32_partitions`: each eligible sub-group's low-precision flat becomes its master
    ([Note: partition is the master])."""
    if reason_not(optimizer, state) is not None:
        return
    done = []
    for i, (lp, hp) in enumerate(zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat)):
        if lp is None or lp is hp or lp.dtype == hp.dtype or lp.device != hp.device:
            continue
        if any(not state.owns(p) for p in optimizer.fp16_groups[i]):
            continue
        _view_master(optimizer, i)
        done.append(i)
    if done:
        setattr(optimizer, SWITCH, done)
        if len(done) == len(optimizer.fp16_partitioned_groups_flat):
            # Nothing views it now. Kept as an empty tensor of its dtype: stock's offload code reads it.
            buffer = getattr(optimizer, "lp_param_buffer", None)
            if buffer is not None:
                optimizer.lp_param_buffer = buffer.new_empty(0)


@torch.no_grad()
def unalias(optimizer):
    """Stock's low-precision partitions again (DeepCompile's own gathers read `ds_tensor` as the parameter's
    dtype): each aliased sub-group gets a flat of its own, the master cast, its parameters' views on it."""
    for i in aliased(optimizer):
        hp = optimizer.fp32_partitioned_groups_flat[i]
        optimizer.fp16_partitioned_groups_flat[i] = hp.to(optimizer.fp16_groups[i][0].dtype)
        optimizer._unflatten_partitioned_parameters(i)
    if aliased(optimizer):
        delattr(optimizer, SWITCH)


def aliased(optimizer) -> List[int]:
    return getattr(optimizer, SWITCH, [])


def repoint(optimizer):
    """The parameters' `ds_tensor` views follow their masters' storage (moved by offload/reload_states)."""
    for i in aliased(optimizer):
        _view_master(optimizer, i)


@torch.no_grad()
def give_back(params):
    """At destroy: a partition of the parameter's own dtype, as stock made it."""
    for p in params:
        part = getattr(p, "ds_tensor", None)
        if part is not None and part.dtype != p.dtype:
            part.data = part.data.to(p.dtype)


def _move(optimizer, device, pin_memory=False, non_blocking=False):
    """The aliased masters' storage moved to `device` (nothing where it is there already)."""
    for i in aliased(optimizer):
        flat = optimizer.fp32_partitioned_groups_flat[i]
        if flat.device == torch.device(device):
            continue
        if pin_memory and torch.device(device).type == "cpu":
            host = get_accelerator().pin_memory(torch.empty_like(flat, device=device))
            host.copy_(flat, non_blocking=non_blocking)
            flat.data = host
        else:
            flat.data = flat.data.to(device, non_blocking=non_blocking)


# -- seams (seams.py) ------------------------------------------------------------------------------
def create_fp32_partitions(stock):
    def _create_fp32_partitions(self):
        stock(self)
        state = of_optimizer(self)
        if state is not None:
            alias(self, state)

    return _create_fp32_partitions


def offload_states(stock):
    """Gradient partitions consolidated first (DeepSpeed copies the buffer out, [Note: partitions as they
    reduce] in grads.py); aliased sub-groups' `lp_params` are their masters ([Note: partition is the master])."""
    def offload_states_(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        reducer = reducer_of(self)
        if reducer is not None:
            reducer.consolidate()
        if not aliased(self):
            return stock(self, include, device, pin_memory, non_blocking)
        lp = OffloadStateTypeEnum.lp_params
        lp_now = lp not in self.offloaded_states and (include is None or lp in include)
        rest = [s for s in OffloadStateTypeEnum if s != lp and (include is None or s in include)]
        out = stock(self, rest, device, pin_memory, non_blocking)
        if lp_now:
            _move(self, device.value, pin_memory, non_blocking)
            self.offloaded_states.add(lp)
        repoint(self)
        return out

    return offload_states_


def reload_states(stock):
    def reload_states_(self, non_blocking=False):
        if not aliased(self):
            return stock(self, non_blocking)
        lp = OffloadStateTypeEnum.lp_params
        lp_off = lp in self.offloaded_states
        self.offloaded_states.discard(lp)
        out = stock(self, non_blocking)
        if lp_off:
            _move(self, get_accelerator().current_device_name(), non_blocking=non_blocking)
        repoint(self)
        return out

    return reload_states_
