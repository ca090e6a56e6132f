"""`aio_handle` as a drop-in for DeepSpeed's handle: any contiguous CPU tensor at any address, size and
file offset, on an O_DIRECT filesystem (ext4/xfs...) and on tmpfs, compared byte for byte with what was
written and with DeepSpeed's own handle where libaio lets it build; use after close; sizes checked
before allocating; new files created 0600."""
import os
import threading

import pytest
import torch

from deepspeed_z3ext import aio_handle
from deepspeed_z3ext.aio import io_mode
from tests.test_aio import backend, buffered_dir, direct_dir  # noqa: F401 (fixtures)

# (bytes, address shift in bytes, file offset): tiny, odd, one under/over the 512-byte and page
# alignments, several blocks plus a tail; shifts that break 512-byte (and 4-byte) alignment; offsets
# aligned, odd, and page-plus-odd.
CASES = [(n, shift, off) for n in (1, 3, 511, 513, 4095, 4097, 3 * 4096 + 7, (1 << 20) + 3, 1 << 20)
         for shift, off in ((0, 0), (1, 0), (64, 0), (0, 1), (3, 4096 + 5), (0, 4096))]
TAIL = 5000  # an existing file extends this far past each write: nothing outside [off, off+n) may change


@pytest.fixture(params=["direct", "buffered"])
def fs_dir(request):
    d = request.getfixturevalue(f"{request.param}_dir")
    probe = d / "probe.bin"
    probe.write_bytes(b"\0" * 4096)
    assert io_mode(probe)["direct"] is (request.param == "direct"), io_mode(probe)
    return d


def _bytes(n, seed):
    return torch.randint(0, 256, (n, ), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _unaligned(src, shift):
    """A uint8 tensor with `src`'s bytes whose address is `shift` bytes past a 4 KiB boundary."""
    base = torch.empty(src.numel() + shift + 4096, dtype=torch.uint8)
    start = (-base.data_ptr()) % 4096 + shift
    t = base[start:start + src.numel()]
    t.copy_(src)
    assert t.data_ptr() % 4096 == shift % 4096
    return t


def test_round_trips_any_address_size_offset(fs_dir, backend):
    h = aio_handle(block_size=1 << 16, queue_depth=8)
    for i, (n, shift, off) in enumerate(CASES):
        path = fs_dir / f"rt{i}.bin"
        # A fresh file: its size is exactly offset + n (nothing truncated, nothing padded).
        src = _unaligned(_bytes(n, i), shift)
        assert h.sync_pwrite(src, str(path), off) == 1
        assert path.stat().st_size == off + n, (n, shift, off)
        with open(path, "rb") as f:
            f.seek(off)
            assert f.read() == src.numpy().tobytes(), (n, shift, off)
        dst = _unaligned(torch.zeros(n, dtype=torch.uint8), (shift + 5) % 4096)
        assert h.sync_pread(dst, str(path), off) == 1
        assert torch.equal(dst, src), (n, shift, off)
        # Over an existing, longer file: only [off, off + n) changes, the length stays.
        before = _bytes(off + n + TAIL, 1000 + i).numpy().tobytes()
        path.write_bytes(before)
        assert h.sync_pwrite(src, str(path), off) == 1
        after = path.read_bytes()
        assert len(after) == len(before)
        assert after[:off] == before[:off] and after[off + n:] == before[off + n:], (n, shift, off)
        assert after[off:off + n] == src.numpy().tobytes(), (n, shift, off)


def test_float_tensors_from_torch_empty_and_randn(fs_dir):
    """The issue's case: plain torch.randn / torch.empty buffers (whatever address the allocator gives)."""
    h = aio_handle()
    for n in (1, 7, 1000, 1 << 18):
        src = torch.randn(n + 1)[1:]  # 4 bytes past the allocation: never 512-aligned
        h.sync_pwrite(src, str(fs_dir / f"f{n}.bin"))
        dst = torch.empty(n)
        h.sync_pread(dst, str(fs_dir / f"f{n}.bin"))
        assert torch.equal(dst, src)
        assert (fs_dir / f"f{n}.bin").read_bytes() == src.numpy().tobytes()


def test_many_unaligned_async_requests_at_once(fs_dir, backend):
    """Aligned, bounced and buffered pieces of many requests in flight together on two workers."""
    h = aio_handle(block_size=8192, queue_depth=4, intra_op_parallelism=2)
    path = fs_dir / "many.bin"
    stride = 6 * 4096  # requests never share a page ([Note: aio any buffer]: mixing modes in one page)
    path.write_bytes(b"\0" * (64 * stride))
    expect = bytearray(path.read_bytes())
    srcs = []
    for i in range(64):
        n, off = 4096 * (i % 5) + 17 * i + 1, stride * i + (0 if i % 3 else 512 * (i % 7))
        src = _unaligned(_bytes(n, 7 * i), i % 9)
        srcs.append(src)
        expect[off:off + n] = src.numpy().tobytes()
        assert h.async_pwrite(src, str(path), off) == 0
    assert h.wait() == 64
    assert path.read_bytes() == bytes(expect)


def test_descriptor_writes_unaligned(direct_dir):
    """DeepSpeed's async_pwrite(buffer, fd) overload with an O_DIRECT descriptor: the unaligned part goes
    through the same file reopened without O_DIRECT; the caller's descriptor stays open and O_DIRECT."""
    h = aio_handle()
    path = direct_dir / "fd.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        src = _unaligned(_bytes(10000, 3), 1)
        assert h.async_pwrite(src, fd, 0) == 0 and h.wait() == 1
        assert os.fstat(fd) and os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
    finally:
        os.close(fd)
    assert path.read_bytes() == src.numpy().tobytes()


# ------------------------------------------------------------------------------- DeepSpeed's handle
def _deepspeed_handle():
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io needs libaio-dev, absent here")
    return AsyncIOBuilder().load(verbose=False).aio_handle(1 << 16, 8, False, False, 1)


def test_same_results_as_deepspeed_handle(fs_dir):
    """Each case written by DeepSpeed's handle and by ours. [Note: DeepSpeed on O_DIRECT] DeepSpeed
    0.19.8's handle reports success but moves only whole `block_size` blocks at block-aligned offsets on
    an O_DIRECT filesystem: a 1 MiB + 3 byte write leaves a 1 MiB file, a write below one block or at an
    odd offset leaves nothing, and reads of such requests leave the buffer mostly unfilled. So: where
    DeepSpeed moved the whole request (every case on tmpfs; whole blocks on disk) both handles' files
    are identical and each reads the other's back exactly; elsewhere what DeepSpeed wrote is a prefix
    of ours (ours is complete: test_round_trips_any_address_size_offset)."""
    theirs, ours = _deepspeed_handle(), aio_handle(block_size=1 << 16, queue_depth=8)
    direct = io_mode(fs_dir / "probe.bin")["direct"]
    complete = 0
    for i, (n, shift, off) in enumerate(CASES):
        src = _unaligned(_bytes(n, i), shift)
        a, b = fs_dir / f"ds{i}.bin", fs_dir / f"z3{i}.bin"
        theirs.sync_pwrite(src, str(a), off)
        ours.sync_pwrite(src, str(b), off)
        mine, theirs_bytes = b.read_bytes(), a.read_bytes()
        assert len(mine) == off + n
        if len(theirs_bytes) < off + n:  # DeepSpeed dropped part of the write (O_DIRECT only)
            assert direct, (n, shift, off)
            assert theirs_bytes == mine[:len(theirs_bytes)], (n, shift, off)
            continue
        complete += 1
        assert theirs_bytes == mine, (n, shift, off)
        for reader, path in ((ours, a), (theirs, b)):
            dst = _unaligned(torch.zeros(n, dtype=torch.uint8), shift)
            reader.sync_pread(dst, str(path), off)
            assert torch.equal(dst, src), (n, shift, off, reader)
    assert complete == (len(CASES) if not direct else sum(n % (1 << 16) == 0 and off % 4096 == 0
                                                          for n, _, off in CASES))
    assert oct(os.stat(a).st_mode & 0o777) == oct(os.stat(b).st_mode & 0o777) == "0o600"


# ----------------------------------------------------------------------------------------- lifetime
def _returns_within(call, seconds=20):
    out = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: B902 (the test inspects it)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the call blocked for {seconds}s"
    return out


def test_use_after_close_raises_at_once(fs_dir):
    h = aio_handle()
    buf = h.new_cpu_locked_tensor(1024, torch.empty(0))
    path = fs_dir / "closed.bin"
    h.sync_pwrite(buf, str(path))
    h.close()
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, call in (("sync_pwrite", lambda: h.sync_pwrite(buf, str(path))),
                           ("sync_pread", lambda: h.sync_pread(buf, str(path))),
                           ("async_pwrite", lambda: h.async_pwrite(buf, str(path))),
                           ("async_pread", lambda: h.async_pread(buf, str(path))),
                           ("async_pwrite(fd)", lambda: h.async_pwrite(buf, fd))):
            out = _returns_within(call)
            assert isinstance(out.get("error"), ValueError), (name, out)
            assert "the handle is closed" in str(out["error"]), (name, out)
    finally:
        os.close(fd)
    assert _returns_within(h.wait) == {"value": 0}
    h.close()  # idempotent


def test_locked_tensor_sizes_checked_before_allocating():
    h = aio_handle()
    f32 = torch.empty(0, dtype=torch.float32)
    for n, why in ((2**62 + 1024, "overflows"), (2**63 - 1, "overflows"), (-1, "negative"), (-(2**40), "negative")):
        with pytest.raises(ValueError, match=rf"new_cpu_locked_tensor\({n} elements of 4 bytes\).*{why}"):
            h.new_cpu_locked_tensor(n, f32)
    with pytest.raises(ValueError, match=rf"new_cpu_locked_tensor\({2**64}.*64-bit"):
        h.new_cpu_locked_tensor(2**64, f32)
    # The largest byte count that still fits is refused by the allocator (MemoryError), not corrupted.
    with pytest.raises(MemoryError):
        h.new_cpu_locked_tensor(2**61 - 4096, f32)
    assert h.new_cpu_locked_tensor(0, f32).numel() == 0


def test_new_files_are_created_0600(fs_dir):
    h = aio_handle()
    old = os.umask(0)  # nothing masked: the mode is what the handle asked for
    try:
        h.sync_pwrite(torch.randn(1000), str(fs_dir / "aligned_or_not.bin"))
        h.sync_pwrite(h.new_cpu_locked_tensor(1024, torch.empty(0)), str(fs_dir / "aligned.bin"))
    finally:
        os.umask(old)
    for name in ("aligned_or_not.bin", "aligned.bin"):
        assert oct((fs_dir / name).stat().st_mode & 0o777) == "0o600", name
