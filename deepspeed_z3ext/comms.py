"""DeepSpeed's comms logger sees z3ext's collectives ([Note: comms logger]).

[Note: comms logger] DeepSpeed's comms logger records what goes through `deepspeed.comm`'s wrappers
(`timed_op`). z3ext's gradient reduce-scatter is issued through `deepspeed.comm.reduce_scatter_fn`,
looked up at each flush, as stock's `reduce_scatter_coalesced` issues it: the C++ flush calls back
into it for the collective alone (csrc/reduce.h), so the logger, and anything else that counts
DeepSpeed's collectives, sees stock's record (op, bytes, latency) at a cost of one Python call per
slice of a flush ([Note: flush slices] in grads.py). The all-gathers are issued by the C++ gather
engine on the c10d group; with `comms_logger.enabled` in the config, z3ext records each of them as
stock's are recorded: under stock's op name (`all_gather_into_tensor`, so
`deepspeed.comm.log_summary()` puts them in the same row), with stock's message size (the input:
this rank's partitions), honouring `prof_all` / `prof_ops` / `verbose`, and timed as `timed_op`
times: the accelerator is synchronised after the call, so the latency is real and logging slows
training, as stock's does. The latency covers the whole op, so a gather's includes its claim
bookkeeping. One `unshard_batch` that issued several collectives (one per process group and dtype)
is recorded as that many records of equal shares of its bytes and time: the op reports how many it
issued, not each one's size. A ZeRO++ hpZ gather over the node group sends a node-th of the buffers
([Note: hpZ secondary partition]); a call of node gathers only is recorded so, a mixed one as
gathers over the world. Off (the default), nothing is wrapped: the gather engine is DeepSpeed-
unaware C++.
"""
import time

from deepspeed import comm as ds_comm

ALL_GATHER = "all_gather_into_tensor"


def enabled() -> bool:
    return ds_comm.comms_logger.enabled


def _profiled(name) -> bool:
    logger = ds_comm.comms_logger
    return logger.enabled and (logger.prof_all or name in logger.prof_ops)


def _sync():
    from deepspeed.accelerator import get_accelerator
    get_accelerator().synchronize()


def _record(name, seconds, msg_size, count=1):
    for _ in range(count):
        ds_comm.comms_logger.append(name, name, seconds * 1000.0 / count, msg_size // count)


def divides_after_reduce(world, comm_dtype) -> bool:
    """Whether the flush divides the reduced shard instead of stock's inputs ([Note: divide after the reduce]
    in csrc/reduce.h): the same bits for a power-of-two world of two or more, unless in fp16."""
    import torch
    return world > 1 and world & (world - 1) == 0 and comm_dtype != torch.float16


def reduce_scatter_fn(group):
    """The flush's collective: `deepspeed.comm.reduce_scatter_fn(output, input, group=group)`, looked up
    when called, as stock calls it ([Note: comms logger])."""
    return lambda output, input, async_op=False: ds_comm.reduce_scatter_fn(output, input, group=group,
                                                                           async_op=async_op)


class LoggedGatherEngine:
    """The C++ GatherEngine with its gathering calls recorded as `all_gather_into_tensor`; everything
    else is the engine's own. Made per z3ext engine when the comms logger is on as it is built."""

    def __init__(self, engine, world, node_world=None):
        self._engine = engine
        self._world = world
        self._node_world = node_world or world  # hpZ's intra-node group

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _logged(self, call):
        if not _profiled(ALL_GATHER):
            return call()
        before = self._engine.stats()
        t0 = time.perf_counter()
        out = call()
        _sync()
        seconds = time.perf_counter() - t0
        after = self._engine.stats()
        n = after["collectives"] - before["collectives"]
        if n > 0 and self._world > 1:
            # live_bytes grew by the full buffers gathered; each rank's input is a world-th of them
            node = after["secondary_collectives"] - before["secondary_collectives"] == n
            _record(ALL_GATHER, seconds,
                    max(0, after["live_bytes"] - before["live_bytes"]) // (self._node_world if node else self._world), n)
        return out

    def unshard(self, *args, **kwargs):
        return self._logged(lambda: self._engine.unshard(*args, **kwargs))

    def unshard_batch(self, *args, **kwargs):
        return self._logged(lambda: self._engine.unshard_batch(*args, **kwargs))
