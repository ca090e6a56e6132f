"""NVMe parameter offload under z3ext: partitions read in before their unit is gathered, through
z3ext's I/O op.

[Note: nvme offload] DeepSpeed keeps doing what it already does for `offload_param.device: nvme`:
zero.Init writes each large partition to its swap file (AsyncPartitionedParameterSwapper), the
stage-3 optimizer reads partitions in to build its fp32 master copy and writes the updated
partitions back after each step. z3ext adds:
- the swapper's handles are z3ext's `aio_handle` (no libaio, no GIL held while blocked): a swapper
  built for a config with z3ext enabled is a `Z3extParamSwapper` (dispatched at construction, as
  seams.py does for DeepSpeedZeRoOffload);
- z3ext's gathers (GatherEngine.unshard, which reads `param.ds_tensor` in C++) get their partitions
  read in first: the engine calls its `NvmeResidency` hook ([Note: partition residency]), which reads
  in every partitioned parameter of a unit whose partition is on NVMe before the gather and gives
  the swap buffers straight back after it (the file holds the same bytes; the gathered parameter is
  a copy). Swap buffers are thus held only for the duration of
  one gather, however many units are held for backward or prefetched; `offload_param.buffer_count`
  only bounds how many partitions one gather reads (a larger unit is gathered in parts).
- Read-ahead ([Note: nvme read-ahead]): the order in which partitions were read in is recorded; after
  each read, the partitions that followed it last time are read asynchronously into free buffers, so
  the next unit's I/O overlaps this unit's compute. A wrong guess costs only buffers, which are
  given back (reads completed) whenever a read needs them.
- `write_back` (GatheredParameters with a modifier_rank) reads the partition in, writes the gathered
  value's slice into it and writes it to its file;
- checkpoint load of sub-groups kept on NVMe ([Note: nvme checkpoint load]).
"""
import types
from typing import List, Optional, Protocol, runtime_checkable

import torch
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (AsyncPartitionedParameterSwapper,
                                                                      PartitionedParamStatus)
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext.aio import aio_handle
from deepspeed_z3ext.config import param_dict_of, parse_section

_AVAILABLE = PartitionedParamStatus.AVAILABLE
_NOT_AVAILABLE = PartitionedParamStatus.NOT_AVAILABLE
_INFLIGHT = PartitionedParamStatus.INFLIGHT


def _on_nvme(param):
    return getattr(param.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme


# ------------------------------------------------------------------------------------ the swapper
class _Z3extIOBuilder:
    """What the swapper's `AsyncIOBuilder().load().aio_handle` returns under z3ext."""

    def load(self, verbose=False):
        return types.SimpleNamespace(aio_handle=aio_handle)


class Z3extParamSwapper(AsyncPartitionedParameterSwapper):
    """DeepSpeed's partitioned-parameter swapper with z3ext's aio_handle for its read and write handles."""

    def _configure_aio(self, ds_config):
        # [Note: swapper handle] DeepSpeed's _configure_aio names its handle factory through the
        # module global AsyncIOBuilder; it is rebound for the duration of this call only (construction
        # is single-threaded), so everything else the swapper sets up stays DeepSpeed's own code.
        with private.swapper_io_builder(_Z3extIOBuilder):
            super()._configure_aio(ds_config)


def new_swapper(ds_config):
    """What `AsyncPartitionedParameterSwapper(ds_config, ...)` builds when the config enables z3ext (the
    seams.py dispatch; DeepSpeed's __init__ then runs on it); None: DeepSpeed's own class."""
    cfg = parse_section(param_dict_of(ds_config))
    if cfg is not None and cfg.enabled:
        return object.__new__(Z3extParamSwapper)
    return None


# [Note: nvme checkpoint load] DeepSpeed 0.19.8's stage-3 `_rigid_load_state_dict` copies each
# restored fp32 sub-group into its flat low-precision buffer, which is None for sub-groups whose
# parameters stay on NVMe (beyond offload_param.max_in_cpu): stock crashes there (AttributeError on
# None). For z3ext engines those sub-groups get a temporary flat buffer for the duration of the stock
# load (so optimizer state, loss scaler etc. stay DeepSpeed's code); afterwards their NVMe partitions
# are written from the restored fp32 values to their swap files, exactly as after an optimizer step,
# and pointed away from the temporary buffer.
def rigid_load_state_dict(stock_load):
    """`DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict` (seams.py), see [Note: nvme checkpoint load]."""

    def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        flats = getattr(self, "fp16_partitioned_groups_flat", None) or []
        holes = [i for i, f in enumerate(flats) if f is None]
        if not holes or not hasattr(getattr(self, "parameter_offload", None), "z3ext"):
            return stock_load(self, state_dict, load_optimizer_states)
        _load_with_nvme_holes(self, holes, stock_load, state_dict, load_optimizer_states)

    return _rigid_load_state_dict


def _load_with_nvme_holes(self, holes, stock_load, state_dict, load_optimizer_states):
    flats = self.fp16_partitioned_groups_flat
    for i in holes:
        fp32 = self.fp32_partitioned_groups_flat[i]
        flats[i] = torch.empty(fp32.numel(), dtype=self.fp16_groups[i][0].ds_tensor.dtype, device=fp32.device)
    try:
        stock_load(self, state_dict, load_optimizer_states)
    finally:
        for i in holes:
            flats[i] = None
    for i in holes:
        nvme = [p for p in self.fp16_groups[i] if _on_nvme(p)]
        for p in nvme:  # the stock unflatten pointed them at the temporary buffer
            p.ds_tensor.data = p.nvme_swapper.invalid_buffer.data
            p.ds_tensor.status = _NOT_AVAILABLE
        self._partitioned_params_swap_out(i)


# ------------------------------------------------------------------------------- the gather engine
@runtime_checkable
class PartitionResidency(Protocol):
    """What GatherEngine calls around its own gathers when some partitions live out of memory
    ([Note: partition residency], csrc/residency.h). Parameters are named by ds_id."""

    def parts(self, ds_ids: List[int]) -> Optional[List[List[int]]]:
        """The partitioned parameters about to be gathered (claimed, ds_id order): None when every
        partition is in memory, else the parts to gather one after another (covering `ds_ids` once;
        a function of the parameters and the config only, so every rank issues the same collectives)."""

    def before_gather(self, ds_ids: List[int]) -> None:
        """Makes the partitions of one part resident."""

    def after_gather(self, ds_ids: List[int]) -> None:
        """The part is gathered: its partitions may leave memory again."""

    def before_sweep(self) -> None:
        """A step boundary (the start of a forward, before the optimizer step)."""

    def before_write_back(self, ds_ids: List[int]) -> None:
        """The gathered parameters of a unit are about to be written into their partitions."""

    def after_write_back(self, ds_ids: List[int]) -> None:
        """They were: partitions out of memory go back to their files."""


def attach_residency(engine, params):
    """Installs an NvmeResidency on `engine` when some parameter's partition lives on NVMe
    ([Note: nvme offload]); otherwise the engine has no hook and its gathers pay nothing for it."""
    if any(_on_nvme(p) for p in params):
        engine.set_residency(NvmeResidency(params))
    return engine.residency


class NvmeResidency(PartitionResidency):
    """NVMe partitions read in before each gather and given back after it ([Note: nvme offload]),
    read ahead along the recorded order ([Note: nvme read-ahead])."""

    def __init__(self, params):
        self._by_id = {p.ds_id: p for p in params}
        self._swapper = next(p.nvme_swapper for p in params if _on_nvme(p))
        self._succ = {}      # ds_id -> ds_id read right after it last time ([Note: nvme read-ahead])
        self._last = None    # the ds_id read last
        self._ahead = set()  # ds_ids read ahead, not yet gathered
        self.reads = 0       # partitions read in for gathers (stats and tests)
        self.read_ahead_hits = 0

    # -- the protocol ------------------------------------------------------------------------------
    def parts(self, ds_ids):
        by_id = self._by_id
        nvme = [i for i in ds_ids if (p := by_id.get(i)) is not None and _on_nvme(p)]
        if not nvme:
            return None
        cap = self._swapper.param_buffer_count
        if len(nvme) <= cap:
            return [ds_ids]
        # More NVMe partitions than swap buffers (a large prefetch batch): parts of at most `cap` of
        # them, the partitions in memory with the first.
        on = set(nvme)
        rest = [i for i in ds_ids if i not in on]
        return [nvme[k:k + cap] + (rest if k == 0 else []) for k in range(0, len(nvme), cap)]

    def before_gather(self, ds_ids):
        self._read_in(self._nvme(ds_ids))

    def after_gather(self, ds_ids):
        params = self._nvme(ds_ids)
        if any(p.is_cuda for p in params):
            # The gather copies from the partitions asynchronously on its stream: let it finish
            # before the swap buffers can be refilled.
            torch.cuda.synchronize()
        self._swapper.remove_partition_and_release_buffers(params)
        self._read_ahead(len(params))

    def before_sweep(self):
        # Sweeps start a forward and precede the optimizer step, which copies updates into partitions
        # that are in a swap buffer without writing them to their files: no read-ahead may be there.
        self._drop_read_ahead()

    def before_write_back(self, ds_ids):
        params = [self._by_id[i] for i in ds_ids if _on_nvme(self._by_id[i])]
        if params:
            self._read_in(params)

    def after_write_back(self, ds_ids):
        params = [self._by_id[i] for i in ds_ids if _on_nvme(self._by_id[i])]
        if params:
            self._swapper.swap_out_and_release(params)  # synchronous write, then buffers back

    # -- reading in --------------------------------------------------------------------------------
    def _nvme(self, ds_ids):
        by_id, out = self._by_id, []
        for i in ds_ids:
            p = by_id.get(i)
            if p is not None and _on_nvme(p):
                out.append(p)
        return out

    def _read_in(self, params):
        """Makes every partition of `params` available: read-ahead finished or used, the rest read."""
        sw = self._swapper
        if any(p.ds_tensor.status == _INFLIGHT for p in params):
            sw.synchronize_reads()  # read-ahead that reached them
        todo = [p for p in params if p.ds_tensor.status == _NOT_AVAILABLE]
        self.read_ahead_hits += sum(1 for p in params if p.ds_id in self._ahead)
        self._ahead.difference_update(p.ds_id for p in params)
        if todo:
            if len(todo) > sw.available_swap_in_buffers():
                self._drop_read_ahead()
            if len(todo) > sw.available_swap_in_buffers():
                raise RuntimeError(
                    f"z3ext: NVMe offload needs {len(todo)} swap buffers to gather parameters "
                    f"{[p.ds_id for p in todo]}, only {sw.available_swap_in_buffers()} of {sw.param_buffer_count} "
                    "are free: raise zero_optimization.offload_param.buffer_count")
            sw.swap_in(todo, async_op=False)
            self.reads += len(todo)
        for p in params:  # see [Note: nvme read-ahead]
            if self._last is not None:
                self._succ[self._last] = p.ds_id
            self._last = p.ds_id

    def _drop_read_ahead(self):
        """Gives back the buffers of partitions read ahead but not used (once their reads finished)."""
        if not self._ahead:
            return
        sw = self._swapper
        sw.synchronize_reads()
        unused = [self._by_id[i] for i in self._ahead]
        unused = [p for p in unused if p.ds_tensor.status == _AVAILABLE]
        if unused:
            sw.remove_partition_and_release_buffers(unused)
        self._ahead.clear()

    # [Note: nvme read-ahead] Each partition read remembers which one was read right after it (the
    # gathers of one step repeat in the next). After a gather, the chain of successors of the last
    # partition read is read asynchronously into free buffers, keeping back as many as this gather
    # needed (units tend to repeat in size), so the next unit's I/O overlaps this unit's compute. A
    # wrong guess only holds buffers, given back (reads completed) whenever a read needs them.
    def _read_ahead(self, n_read):
        sw = self._swapper
        budget = sw.available_swap_in_buffers() - n_read
        want, seen, cur = [], set(), self._last
        while len(want) < budget:
            cur = self._succ.get(cur)
            if cur is None or cur in seen:
                break
            seen.add(cur)
            p = self._by_id.get(cur)
            if p is None or cur in self._ahead or p.ds_tensor.status != _NOT_AVAILABLE:
                continue
            if p.ds_status.name != "NOT_AVAILABLE":  # gathered already: nothing to read ahead
                continue
            want.append(p)
        if want:
            sw.swap_in(want, async_op=True)
            self._ahead.update(p.ds_id for p in want)
