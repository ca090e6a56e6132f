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
  read in first: `NvmeGatherEngine` wraps the engine, reads in every partitioned parameter of a unit
  whose partition is on NVMe, gathers, and gives the swap buffers straight back (the file holds the
  same bytes; the gathered parameter is a copy). Swap buffers are thus held only for the duration of
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

import torch
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import (AsyncPartitionedParameterSwapper,
                                                                      PartitionedParamStatus)
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from deepspeed_z3ext import deepspeed_private as private
from deepspeed_z3ext._ops import ops as _ops
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
_BATCH_OWNER = -1  # owner of the transient claim carrying a prefetch batch until each unit's own claim


def wrap_engine(engine, params):
    """`engine` itself when no parameter's partition lives on NVMe, else an NvmeGatherEngine."""
    nvme = [p for p in params if _on_nvme(p)]
    if not nvme:
        return engine
    return NvmeGatherEngine(engine, params)


class NvmeGatherEngine:
    """The C++ GatherEngine with NVMe partitions read in before each gather ([Note: nvme offload]).
    Every other attribute is the engine's own."""

    def __init__(self, engine, params):
        self._engine = engine
        self._by_id = {p.ds_id: p for p in params}
        self._swapper = next(p.nvme_swapper for p in params if _on_nvme(p))
        self._partitioned = _ops().ParamState.PARTITIONED
        self._succ = {}      # ds_id -> ds_id read right after it last time ([Note: nvme read-ahead])
        self._last = None    # the ds_id read last
        self._ahead = set()  # ds_ids read ahead, not yet gathered
        self.reads = 0       # partitions read in for gathers (stats and tests)
        self.read_ahead_hits = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    # -- the wrapped calls -----------------------------------------------------------------------
    def unshard_batch(self, units, kind, owners, defer=False):
        """A prefetch batch: one combined gather (NVMe reads included, see `unshard`) under a transient
        Direct claim, then each unit's own claim."""
        ops = _ops()
        combined = ops.FetchUnit([h for u in units for h in u.handles])
        direct = ops.ClaimKind.DIRECT
        gathered = self.unshard(combined, direct, _BATCH_OWNER, defer)
        for unit, owner in zip(units, owners):
            self._engine.unshard(unit, kind, owner, defer)  # already gathered: claims only
        self._engine.reshard(combined, direct, _BATCH_OWNER, False)
        return gathered

    def unshard(self, unit, kind, owner, defer=False):
        params = self._nvme_partitioned(unit)
        if not params:
            return self._engine.unshard(unit, kind, owner, defer)
        cap = self._swapper.param_buffer_count
        if len(params) <= cap:
            return self._unshard_read(unit, params, kind, owner, defer)
        # More NVMe partitions than swap buffers (a large prefetch batch): gather in parts of at most
        # `cap` of them. The split depends only on the unit and the config, so every rank issues the
        # same collectives; claims are per parameter, so parts claim exactly what the unit would.
        ops = _ops()
        nvme_ids = {p.ds_id for p in params}
        rest = [h for h in unit.handles if h.ds_id not in nvme_ids]
        nvme = [h for h in unit.handles if h.ds_id in nvme_ids]
        n = 0
        for k in range(0, len(nvme), cap):
            part = ops.FetchUnit(nvme[k:k + cap] + (rest if k == 0 else []))
            n += self._unshard_read(part, [self._by_id[h.ds_id] for h in nvme[k:k + cap]], kind, owner, defer)
        return n

    def _unshard_read(self, unit, params, kind, owner, defer):
        self._read_in(params)
        n = self._engine.unshard(unit, kind, owner, defer)
        if any(p.is_cuda for p in params):
            # The gather copies from the partitions asynchronously on its stream: let it finish
            # before the swap buffers can be refilled.
            torch.cuda.synchronize()
        self._swapper.remove_partition_and_release_buffers(params)
        self._read_ahead(len(params))
        return n

    def sweep(self, kinds):
        # Sweeps start a forward and precede the optimizer step, which copies updates into partitions
        # that are in a swap buffer without writing them to their files: no read-ahead may be there.
        self._drop_read_ahead()
        return self._engine.sweep(kinds)

    def write_back(self, unit):
        params = [self._by_id[h.ds_id] for h in unit.handles
                  if h.state != self._partitioned and _on_nvme(self._by_id[h.ds_id])]
        if params:
            self._read_in(params)
        self._engine.write_back(unit)
        if params:
            self._swapper.swap_out_and_release(params)  # synchronous write, then buffers back

    # -- reading in --------------------------------------------------------------------------------
    def _nvme_partitioned(self, unit):
        by_id, out = self._by_id, []
        for h in unit.handles:
            if h.state == self._partitioned:
                p = by_id.get(h.ds_id)
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
