"""`aio_handle`: file I/O of CPU tensors on C++ worker threads, a stand-in for DeepSpeed's async_io
handle (`AsyncIOBuilder().load().aio_handle`) that needs no libaio and never deadlocks on the GIL.

    from deepspeed_z3ext import aio_handle
    h = aio_handle(block_size=1 << 20, queue_depth=32)
    buf = h.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.float32))
    h.async_pwrite(buf, "/nvme/x.swp"); h.wait()       # wait() -> number of ops completed
    h.sync_pread(buf, "/nvme/x.swp")

Blocking calls (sync reads and writes, `wait`, `close`, destruction) release the GIL ([Note: aio
and the GIL] in csrc/aio.h). Any contiguous CPU tensor works, at any address, size and file offset
([Note: aio any buffer]): on a filesystem with O_DIRECT, what is aligned (`new_cpu_locked_tensor`
buffers, sizes padded to `get_alignment()`) goes straight through O_DIRECT, a misaligned buffer
address through an aligned bounce buffer, a misaligned offset or the tail of an odd size through
the page cache, chosen per request; other filesystems (tmpfs) are used through the page cache. The
mode is logged once per filesystem. New files are created 0600. Bad input raises here, naming file
and offset: `ValueError` for a buffer that is not a contiguous CPU tensor, a negative offset, a
closed handle or a bad `new_cpu_locked_tensor` size, `AioError` (an `OSError`) for everything the
filesystem refuses (missing file or directory, short file, disk full). A failed asynchronous op is
raised by the `wait()` that completes it, after every pending op has finished.

Differences from DeepSpeed's handle: `wait()` with nothing pending returns 0 (DeepSpeed asserts);
`single_submit` and `overlap_events` are accepted and reported but change nothing (there is no
submission queue to batch); `free_cpu_locked_tensor` forgets the buffer, whose memory is freed when
its last reference dies (DeepSpeed frees it under any remaining reference); on an O_DIRECT filesystem
DeepSpeed 0.19.8's handle moves only whole blocks at aligned offsets and drops the rest without an
error, this one moves every byte (tests/test_aio_any_buffer.py).
"""
import operator
import os

import torch

from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.errors import AioError

# DeepSpeed's O_DIRECT_ALIGNMENT: get_alignment() is this times intra_op_parallelism, so that
# every thread's share of a request is aligned.
_BASE_ALIGNMENT = 512




def _log_notice(notice):
    if notice:
        from deepspeed.utils import logger
        logger.info(notice)


def _raise(code, message):
    o = ops()
    if code in (o.AIO_INVALID, o.AIO_CLOSED):
        raise ValueError(message)
    if code == o.AIO_SHORT:
        raise AioError(message)
    err = AioError(code, message)
    err.strerror = message  # str(err) is the full message, with file and offset
    raise err


def io_mode(path):
    """How z3ext's op accesses the existing file `path`: {"direct": bool, "mem_align", "offset_align",
    "fs"} (O_DIRECT and its alignment, or buffered)."""
    code, message, direct, mem_align, offset_align, fs = ops().aio_probe(os.fspath(path))
    if code:
        _raise(code, message)
    return {"direct": direct, "mem_align": mem_align, "offset_align": offset_align, "fs": fs}


class aio_handle:
    """DeepSpeed's aio_handle API on z3ext's I/O op (see the module docstring)."""

    def __init__(self, block_size=1024 * 1024, queue_depth=128, single_submit=False, overlap_events=False,
                 intra_op_parallelism=1):
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("intra_op_parallelism", intra_op_parallelism)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"aio_handle: {name} must be a positive int, got {value!r}")
        self._h = ops().AioHandle(block_size, queue_depth, bool(single_submit), bool(overlap_events),
                                  intra_op_parallelism)
        self._validate = []  # (buffer, path, offset) of async ops to check at wait()

    # -- configuration -----------------------------------------------------------------------------
    def get_block_size(self):
        return self._h.block_size

    def get_queue_depth(self):
        return self._h.queue_depth

    def get_single_submit(self):
        return self._h.single_submit

    def get_overlap_events(self):
        return self._h.overlap_events

    def get_intra_op_parallelism(self):
        return self._h.intra_op_parallelism

    def get_alignment(self):
        return _BASE_ALIGNMENT * self._h.intra_op_parallelism

    # -- I/O ---------------------------------------------------------------------------------------
    def _submit(self, buffer, filename, file_offset, read, validate):
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"aio_handle: buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if isinstance(filename, int) and not isinstance(filename, bool):
            if read:
                raise TypeError("aio_handle: reads take a file name, not a descriptor")
            code, message, notice = self._h.submit_fd(buffer, filename, int(file_offset))
        else:
            path = os.fspath(filename)
            if isinstance(path, bytes):
                path = os.fsdecode(path)
            code, message, notice = self._h.submit(buffer, path, int(file_offset), read)
            if validate and code == 0:
                self._validate.append((buffer, path, int(file_offset)))
        _log_notice(notice)
        if code:
            _raise(code, message)

    def wait(self):
        """Blocks (GIL released) until every pending op has finished; returns how many completed since
        the last wait (0 when none were pending). Raises for the first failed one."""
        n = self._h.wait()
        errors = self._h.take_errors()
        checks, self._validate = self._validate, []
        if errors:
            code, message = errors[0]
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more failed op(s): " + "; ".join(m for _, m in errors[1:4]) + ")"
            _raise(code, message)
        for buffer, path, offset in checks:
            _check_file_matches(buffer, path, offset)
        return n

    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """Reads `buffer.nbytes` bytes at `file_offset`; `async_op=False` waits and returns the count of
        completed ops, `async_op=True` returns 0 (complete with wait()). DeepSpeed's keyword `async`
        is accepted too."""
        async_op = kwargs.pop("async", async_op)
        _no_extra(kwargs)
        self._submit(buffer, filename, file_offset, True, validate)
        return 0 if async_op else self.wait()

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        async_op = kwargs.pop("async", async_op)
        _no_extra(kwargs)
        self._submit(buffer, filename, file_offset, False, validate)
        return 0 if async_op else self.wait()

    def read(self, buffer, filename, validate=False, file_offset=0):
        return self.pread(buffer, filename, validate, False, file_offset)

    def write(self, buffer, filename, validate=False, file_offset=0):
        return self.pwrite(buffer, filename, validate, False, file_offset)

    def sync_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer, filename, file_offset=0):
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer, filename, file_offset=0):
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer, filename, file_offset=0):
        """`filename` may also be an open descriptor (left open)."""
        return self.pwrite(buffer, filename, False, True, file_offset)

    # -- buffers -----------------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A 1-D CPU tensor of `num_elem` elements of `example_tensor`'s dtype, page-aligned (usable for
        O_DIRECT) and page-locked where the memlock limit allows."""
        n = operator.index(num_elem)
        if not -(1 << 63) <= n < (1 << 63):
            raise ValueError(f"aio_handle: new_cpu_locked_tensor({n} elements of {example_tensor.dtype}): the element "
                             "count does not fit in a 64-bit integer")
        code, message, t = self._h.new_locked(n, example_tensor)
        if code:
            _raise(code, message)
        if t is None:
            raise MemoryError(f"aio_handle: cannot allocate {n} elements of {example_tensor.dtype}")
        return t

    def free_cpu_locked_tensor(self, tensor):
        """True if `tensor` came from new_cpu_locked_tensor; its memory goes when its last reference does."""
        return self._h.is_locked(tensor)

    def is_pinned(self, buffer):
        return self._h.is_locked(buffer) or (buffer.device.type == "cpu" and _torch_pinned(buffer))

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self):
        """Waits for pending ops (GIL released) and stops the worker threads; also done on destruction.
        Reads and writes submitted afterwards raise ValueError at once."""
        self._h.close()

    def pending(self):
        return self._h.pending


def _no_extra(kwargs):
    if kwargs:
        raise TypeError(f"aio_handle: unexpected keyword argument(s) {sorted(kwargs)}")


def _torch_pinned(t):
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to ask
        return False


def _check_file_matches(buffer, path, offset):
    nbytes = buffer.numel() * buffer.element_size()
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    mine = buffer.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    if data != mine:
        raise AioError(f"z3ext aio: validation of '{path}' at offset {offset} ({nbytes} bytes): the file and the "
                       "buffer differ")
