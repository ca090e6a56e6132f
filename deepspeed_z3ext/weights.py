"""`full_weights`: a ZeRO-3 model's full parameters streamed in buckets of bounded bytes, what an RLHF
loop pushes into an inference engine (vLLM's `load_weights` takes such (name, tensor) pairs) without
gathering the whole model at once.

[Note: weights from partitions] Every bucket is gathered from its parameters' primary partitions
(`ds_tensor`, over `ds_process_group`), never read from what a module, a GatheredParameters block or
persistence holds gathered now. Whether a parameter is gathered is a per-rank fact (a rank may still
hold a graph another rank has freed), so a stream that skipped the collective where a parameter is
gathered could issue different collectives on different ranks ([Note: one schedule on every rank] in
schedule.py); partitions exist on every rank with the same sizes, so the split into buckets (from
`ds_tensor.ds_numel`, never `numel()`, which is 0 for a released parameter) and the collectives are
the same everywhere. Nothing is claimed or gathered: z3ext's claims and stock's `ds_status` stay as
they were, for a z3ext engine as for stock ZeRO-3. The values are GatheredParameters' (it gathers the
same partitions; a persistent or held parameter is gathered from them again after each step); edits
inside a GatheredParameters block with `modifier_rank` are seen once the block has written them back.
ZeRO++ hpZ's secondary partitions are not read: the primary one is gathered over the parameter's group.

[Note: full_weights is a z3ext collective] For a z3ext engine's parameters, the arguments' exchange and every
bucket's all-gather go through the engine's agreement like its own collectives ([Note: agree before the
collective] in csrc/agreement.h, the watchdog): a rank that calls `full_weights` while another trains on (a
rank-0-only export) makes every rank raise `ScheduleMismatchError` naming full_weights and what the other rank
was about to do (gloo), or the watchdog's error at the deadline, never a collective of other sizes that the
backend aborts on.

[Note: bucket layout] A bucket is one dtype and one process group, so one all-gather
(`deepspeed.comm.all_gather_into_tensor`, which DeepSpeed's comms logger records) gathers it: each rank
copies its partitions into its own slice of one flat buffer, in place, as stock's coalesced gather
does. The buffer is then rank after rank; each parameter of a bucket of several is copied out into a
storage of its own (one strided copy each), so a tensor the consumer keeps holds only itself, and the
flat buffer's storage is freed at once (resized to 0 bytes: nothing reads it again, and the backend's
finished work may hold it a moment longer). A bucket of one parameter is its buffer, uncopied.
"""
import zlib
from typing import Iterable, Iterator, List, NamedTuple, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from deepspeed_z3ext.errors import WeightsError
from deepspeed_z3ext.state import group_of


class FullWeight(NamedTuple):
    """One parameter's full value: a (name, tensor) pair, as `load_weights` takes them."""
    name: str
    tensor: torch.Tensor


class _Entry(NamedTuple):
    name: str
    param: torch.nn.Parameter
    group: object        # its process group; None: not partitioned, yielded as it is
    dtype: torch.dtype
    partition: int       # its partition's elements (ds_tensor.ds_numel); 0 when not partitioned
    nbytes: int          # what its bucket holds of it: the full value padded as DeepSpeed partitions it


class _Gather(NamedTuple):
    bucket: List[_Entry]
    flat: Optional[torch.Tensor]  # every rank's partitions, rank after rank ([Note: bucket layout])
    work: object                  # the all-gather's handle; None: nothing gathered


def full_weights(engine_or_module, bucket_bytes: int,
                 names: Optional[Iterable[str]] = None) -> Iterator[List[FullWeight]]:
    """An iterator of buckets, each a list of `FullWeight(name, tensor)`: every parameter of the engine's
    module (or of the module) once, in `named_parameters()` order, with its full value (`ds_shape`, its
    dtype), equal to what `deepspeed.zero.GatheredParameters` gives for it ([Note: weights from partitions]).

    - `bucket_bytes` (> 0) bounds a bucket's bytes, counted as gathered: each parameter's full bytes
      padded to a multiple of its group's world, as DeepSpeed partitions it (so the tensors' bytes are
      within it too). A parameter larger than that forms a bucket of its own. A dtype or process group
      change also starts a bucket. `names`: only these parameters (still in module order).
    - One all-gather per bucket, and the next bucket's is issued before a bucket is yielded, so
      communication overlaps the consumer's work. The iterator holds at most two buckets: the one
      yielded and the next one in flight (while a bucket of several parameters is laid out, its gather
      buffer and its parameters' copies, the previous bucket already dropped).
    - When the next bucket is requested (and when the stream ends or is closed) the previous bucket's
      list is emptied, dropping the iterator's tensors: copy (or take out) what you keep. A kept tensor
      stays valid and holds only its own memory (or, alone in its bucket, its buffer).
    - Collective: every rank must iterate the same buckets (same arguments, the same number of
      `next()` calls). Breaking out of a `for` loop, an exception in its body, or `close()` ends the
      stream: the gather in flight is waited for and nothing stays allocated or gathered.
    - Parameters not ZeRO-3 partitioned (no `ds_id`: a module or engine of ZeRO stage < 3) pass through
      without a collective, as their own data (`detach()`): read them, do not write them. ZeRO-3
      partitions on NVMe or quantized (ZeRO++ qwZ) are refused with `WeightsError` (a ValueError).
    """
    module = _module_of(engine_or_module)
    budget = _budget(bucket_bytes)
    entries = _entries(module, names)
    budget = _agreed(entries, budget)
    agreement = _agreement_of(entries)
    buckets, current, used = [], [], 0
    for e in entries:
        if current and (e.group is not current[0].group or e.dtype != current[0].dtype or used + e.nbytes > budget):
            buckets.append(current)
            current, used = [], 0
        current.append(e)
        used += e.nbytes
    if current:
        buckets.append(current)
    return _stream(buckets, agreement)


def _agreement_of(entries):
    """The z3ext engine's agreement when it owns the partitioned parameters ([Note: full_weights is a z3ext
    collective]); None for stock ZeRO-3."""
    from deepspeed_z3ext.state import of_param
    state = next((of_param(e.param) for e in entries if e.group is not None), None)
    return getattr(state, "agreement", None)


def _agreed(entries, budget) -> int:
    """The ranks' bucket bytes made equal (the smallest) and their parameter lists checked equal before any
    bucket's gather ([Note: arguments that must agree] in schedule.py); over the largest group gathered."""
    groups = [e.group for e in entries if e.group is not None]
    if not groups:
        return budget
    from deepspeed_z3ext.schedule import RankAgreement
    largest = max(groups, key=dist.get_world_size)
    agreement = _agreement_of(entries)
    if agreement is None or dist.get_world_size(agreement.group) != dist.get_world_size(largest):
        agreement = RankAgreement(largest)
    names = zlib.crc32("\0".join(e.name for e in entries).encode())
    rows = agreement.agreed("full_weights(engine, bucket_bytes, names)", [budget, len(entries), names], minimum=0,
                            kind=9)
    return min(r[0] for r in rows)


def _module_of(x) -> torch.nn.Module:
    from deepspeed.runtime.engine import DeepSpeedEngine
    if isinstance(x, DeepSpeedEngine):
        return x.module
    if isinstance(x, torch.nn.Module):
        return x
    raise WeightsError(f"full_weights takes a DeepSpeed engine or a torch.nn.Module, not {type(x).__name__}")


def _budget(bucket_bytes) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, float)) or bucket_bytes != bucket_bytes:
        raise WeightsError(f"full_weights: bucket_bytes must be a positive number of bytes, got {bucket_bytes!r}")
    if bucket_bytes <= 0:
        raise WeightsError(f"full_weights: bucket_bytes must be > 0, got {bucket_bytes!r}")
    return int(bucket_bytes)


def _entries(module, names) -> List[_Entry]:
    wanted = None
    if names is not None:
        wanted = {names} if isinstance(names, str) else set(names)
    out, seen = [], set()
    for name, p in module.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        seen.add(name)
        out.append(_entry(name, p))
    if wanted is not None and wanted - seen:
        unknown = sorted(wanted - seen)
        raise WeightsError(f"full_weights: no parameter named {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                           f"in the module (names are the module's named_parameters(), without 'module.')")
    return out


def _entry(name, p) -> _Entry:
    if not hasattr(p, "ds_id"):
        return _Entry(name, p, None, p.dtype, 0, p.numel() * p.element_size())
    part = p.ds_tensor
    if getattr(part, "final_location", None) == OffloadDeviceEnum.nvme:
        raise WeightsError(f"full_weights: the partition of {name} is on NVMe (offload_param.device: nvme), "
                           f"which full_weights does not read; use GatheredParameters")
    if hasattr(part, "ds_quant_scale"):
        raise WeightsError(f"full_weights: the partition of {name} is quantized (ZeRO++ qwZ), which "
                           f"full_weights does not read; use GatheredParameters")
    group = group_of(p)
    world = dist.get_world_size(group)
    # The parameter's dtype: its partition may be the fp32 master ([Note: partition is the master] in master.py).
    return _Entry(name, p, group, p.dtype, part.ds_numel, world * part.ds_numel * p.element_size())


def _stream(buckets, agreement=None) -> Iterator[List[FullWeight]]:
    ahead, shown = None, []
    try:
        if buckets:
            ahead = _start(buckets[0], agreement)
        for i in range(len(buckets)):
            current, ahead = ahead, None
            shown.clear()  # the previous bucket, before this one is laid out: two buckets at most
            shown = _finish(current)
            current = None
            if i + 1 < len(buckets):
                ahead = _start(buckets[i + 1], agreement)
            yield shown
    finally:
        shown.clear()
        if ahead is not None and ahead.work is not None:
            ahead.work.wait()  # every rank issued it; its buffer may be freed only once it is done
            _free(ahead.flat)


@torch.no_grad()
def _start(bucket, agreement=None) -> _Gather:
    first = bucket[0]
    if first.group is None:
        return _Gather(bucket, None, None)
    group = first.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = sum(e.partition for e in bucket)
    flat = torch.empty(world * size, dtype=first.dtype, device=get_accelerator().current_device_name())
    mine = flat.narrow(0, rank * size, size)
    offset = 0
    for e in bucket:
        mine.narrow(0, offset, e.partition).copy_(e.param.ds_tensor.reshape(-1)[:e.partition])
        offset += e.partition
    # Empty partitions only (parameters of 0 elements): nothing to gather, on every rank alike.
    if not size:
        return _Gather(bucket, flat, None)
    if agreement is None or world == 1:
        return _Gather(bucket, flat, dist.all_gather_into_tensor(flat, mine, group=group, async_op=True))
    # [Note: full_weights is a z3ext collective]: agreed and watched; on gloo the host waits for it there.
    work = agreement.collective([9, 0, first.param.ds_id, size, len(bucket)],
                                lambda async_op: dist.all_gather_into_tensor(flat, mine, group=group, async_op=async_op),
                                group)
    return _Gather(bucket, flat, work if hasattr(work, "wait") else None)


@torch.no_grad()
def _finish(gather: _Gather) -> List[FullWeight]:
    if gather.flat is None:
        return [FullWeight(e.name, e.param.detach()) for e in gather.bucket]
    if gather.work is not None:
        gather.work.wait()
    if len(gather.bucket) == 1:
        e = gather.bucket[0]
        return [FullWeight(e.name, gather.flat.narrow(0, 0, e.param.ds_numel).view(e.param.ds_shape))]
    size = sum(e.partition for e in gather.bucket)
    world = gather.flat.numel() // size if size else 1
    rows = gather.flat.view(world, size)
    out, offset = [], 0
    for e in gather.bucket:
        full = torch.empty(world * e.partition, dtype=e.dtype, device=gather.flat.device)
        full.view(world, e.partition).copy_(rows.narrow(1, offset, e.partition))
        out.append(FullWeight(e.name, full.narrow(0, 0, e.param.ds_numel).view(e.param.ds_shape)))
        offset += e.partition
    _free(gather.flat)
    return out


def _free(flat):
    """Returns a waited-for gather buffer's memory now ([Note: bucket layout]): the backend may still
    reference it for a moment (gloo's finished work drops its tensors after `wait()` returns)."""
    flat.untyped_storage().resize_(0)
