"""DeepSpeed's comms logger sees z3ext's collectives ([Note: comms logger]).

[Note: comms logger] z3ext's all-gathers and reduce-scatters are issued by its C++ ops on the c10d
group, so DeepSpeed's `deepspeed.comm` wrappers (`timed_op`) never see them. With `comms_logger.enabled`
in the config, z3ext records each of its collectives in `deepspeed.comm.comms_logger` as stock's are
recorded: under stock's op names (`all_gather_into_tensor`, `reduce_scatter_tensor`, so
`deepspeed.comm.log_summary()` puts them in the same rows), with stock's message size (the all-gather's
input: this rank's partitions; the reduce-scatter's input: the whole laid-out bucket), honouring
`prof_all` / `prof_ops` / `verbose`, and timed as `timed_op` times: the accelerator is synchronised
after the call, so the latency is real and logging slows training, as stock's does. What the latency
covers differs: z3ext's call is a whole op, so a gather's includes its claim bookkeeping and a
reduce-scatter's the bucket's layout and the write into the partitions. One `unshard_batch` that
issued several collectives (one per process group and dtype) is recorded as that many records of
equal shares of its bytes and time: the op reports how many it issued, not each one's size.
Off (the default), nothing is wrapped: the gather engine is DeepSpeed-unaware C++ and the flush reads
one flag per bucket.
"""
import time

from deepspeed import comm as ds_comm

ALL_GATHER = "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_tensor"


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


def logged_reduce_scatter(op, grads, comm_dtype, world, *args):
    """`ops().reduce_scatter_grads(group, grads, ...)` recorded as one `reduce_scatter_tensor` (none at
    world 1, where the op issues no collective)."""
    if not _profiled(REDUCE_SCATTER):
        return op(*args)
    t0 = time.perf_counter()
    out = op(*args)
    _sync()
    seconds = time.perf_counter() - t0
    buffer_numel = out[1]
    if world > 1 and buffer_numel:
        import torch
        _record(REDUCE_SCATTER, seconds, buffer_numel * torch.empty((), dtype=comm_dtype).element_size())
    return out


class LoggedGatherEngine:
    """The C++ GatherEngine with its gathering calls recorded as `all_gather_into_tensor`; everything
    else is the engine's own. Made per z3ext engine when the comms logger is on as it is built."""

    def __init__(self, engine, world):
        self._engine = engine
        self._world = world

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
            _record(ALL_GATHER, seconds, max(0, after["live_bytes"] - before["live_bytes"]) // self._world, n)
        return out

    def unshard(self, *args, **kwargs):
        return self._logged(lambda: self._engine.unshard(*args, **kwargs))

    def unshard_batch(self, *args, **kwargs):
        return self._logged(lambda: self._engine.unshard_batch(*args, **kwargs))
