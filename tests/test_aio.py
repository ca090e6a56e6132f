"""z3ext's file I/O op (`deepspeed_z3ext.aio_handle`) on real files: DeepSpeed's handle API, the GIL
released by every blocking call, O_DIRECT and buffered paths, errors that name file and offset,
no descriptor leaks, bit-exact data under concurrent load. Unaligned buffers, sizes and offsets:
test_aio_any_buffer.py."""
import os
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path

import pytest
import torch

import deepspeed_z3ext
from deepspeed_z3ext import AioError, aio_handle
from deepspeed_z3ext.aio import io_mode

REPO = Path(__file__).resolve().parent.parent
F32 = torch.empty(0, dtype=torch.float32)

# Every method of DeepSpeed's aio_handle (0.19.8, csrc/aio/py_lib/py_ds_aio.cpp) that callers use.
DEEPSPEED_API = ("get_block_size", "get_queue_depth", "get_single_submit", "get_overlap_events",
                 "get_intra_op_parallelism", "get_alignment", "read", "write", "pread", "pwrite", "sync_pread",
                 "sync_pwrite", "async_pread", "async_pwrite", "new_cpu_locked_tensor", "free_cpu_locked_tensor",
                 "is_pinned", "wait")


def _dir_with(direct, base):
    d = Path(base)
    d.mkdir(parents=True, exist_ok=True)
    probe = d / "probe.bin"
    probe.write_bytes(b"\0" * 4096)
    try:
        return d if io_mode(probe)["direct"] == direct else None
    finally:
        probe.unlink()


@pytest.fixture
def direct_dir(tmp_path):
    """A folder on an O_DIRECT filesystem: pytest's tmp, else one inside the checkout (/tmp may be tmpfs)."""
    for base in (tmp_path, REPO / ".pytest_aio" / tmp_path.name):
        d = _dir_with(True, base)
        if d is not None:
            return d
    pytest.skip("no O_DIRECT-capable filesystem under tmp or the checkout")


@pytest.fixture
def buffered_dir(tmp_path):
    for base in ("/dev/shm", tmp_path):
        d = _dir_with(False, Path(base) / f"z3ext-aio-{os.getpid()}-{tmp_path.name}")
        if d is not None:
            yield d
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
            return
    pytest.skip("no tmpfs (buffered-only) filesystem")


@pytest.fixture(params=["direct", "buffered"])
def any_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(params=["native", "pread"])
def backend(request, monkeypatch):
    """O_DIRECT chunks through native kernel AIO, or forced onto the pread/pwrite fallback (what runs
    where io_setup is refused)."""
    if request.param == "pread":
        monkeypatch.setenv("Z3EXT_AIO_BACKEND", "pread")
    else:
        monkeypatch.delenv("Z3EXT_AIO_BACKEND", raising=False)
    return request.param


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _filled(h, numel, seed):
    t = h.new_cpu_locked_tensor(numel, F32)
    t.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
    return t


# --------------------------------------------------------------------------------------------- API
def test_deepspeed_api_and_config():
    h = aio_handle(block_size=65536, queue_depth=8, single_submit=True, overlap_events=True, intra_op_parallelism=2)
    for name in DEEPSPEED_API:
        assert callable(getattr(h, name)), name
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events(),
            h.get_intra_op_parallelism()) == (65536, 8, True, True, 2)
    assert h.get_alignment() == 1024
    d = aio_handle()  # DeepSpeed's defaults
    assert (d.get_block_size(), d.get_queue_depth(), d.get_intra_op_parallelism()) == (1 << 20, 128, 1)
    assert d.wait() == 0 and d.wait() == 0  # nothing pending: 0, not an assertion failure
    with pytest.raises(ValueError, match="queue_depth"):
        aio_handle(queue_depth=0)
    # A locked buffer is page-aligned and reported pinned; a plain tensor is not.
    t = h.new_cpu_locked_tensor(1000, torch.empty(0, dtype=torch.bfloat16))
    assert t.dtype == torch.bfloat16 and t.numel() == 1000 and t.data_ptr() % 4096 == 0
    assert h.is_pinned(t) and h.is_pinned(t[10:]) and not h.is_pinned(torch.empty(1000))
    assert h.free_cpu_locked_tensor(t) and not h.free_cpu_locked_tensor(torch.empty(3))


def test_deepspeed_handle_method_names_match():
    """Where DeepSpeed's own async_io op can be built (libaio present), every public method it has, ours has."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io needs libaio-dev, absent here")
    theirs = AsyncIOBuilder().load(verbose=False).aio_handle
    missing = [n for n in dir(theirs) if not n.startswith("_") and not hasattr(aio_handle, n)]
    assert not missing, missing


# ------------------------------------------------------------------------------------- round trips
def test_round_trip_all_entry_points(any_dir, backend):
    h = aio_handle(block_size=1 << 16, queue_depth=4)
    assert h._h.native_aio == (backend == "native")
    n = 3 * (1 << 16) + 128  # several blocks and a partial one (aligned to 512 bytes)
    src = _filled(h, n, 0)
    path = any_dir / "rt.bin"
    assert h.sync_pwrite(src, str(path)) == 1
    assert path.stat().st_size == src.numel() * 4
    for read in (lambda b: h.sync_pread(b, str(path)), lambda b: h.pread(b, path, False, False, 0),
                 lambda b: h.read(b, str(path), True), lambda b: h.pread(b, str(path), validate=True, async_op=False)):
        dst = h.new_cpu_locked_tensor(n, F32).zero_()
        assert read(dst) == 1
        assert torch.equal(dst, src)
    dst = h.new_cpu_locked_tensor(n, F32).zero_()
    assert h.async_pread(dst, str(path)) == 0 and h.wait() == 1 and torch.equal(dst, src)
    # Offsets: write the second half at an aligned offset of another file, read it back.
    half = n // 2 // 128 * 128
    assert h.pwrite(src[half:], str(any_dir / "off.bin"), False, True, half * 4) == 0  # async
    assert h.wait() == 1
    back = h.new_cpu_locked_tensor(n - half, F32)
    assert h.sync_pread(back, str(any_dir / "off.bin"), half * 4) == 1
    assert torch.equal(back, src[half:])
    # A write to an open descriptor (DeepSpeed's async_pwrite overload), left open.
    fd = os.open(any_dir / "fd.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert h.async_pwrite(src, fd, 0) == 0 and h.wait() == 1
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    assert (any_dir / "fd.bin").read_bytes() == src.numpy().tobytes()
    # An empty buffer is a completed op.
    assert h.sync_pwrite(torch.empty(0), str(any_dir / "empty.bin")) == 1


def test_modes_chosen_per_filesystem(direct_dir, buffered_dir):
    h = aio_handle()
    for d, direct in ((direct_dir, True), (buffered_dir, False)):
        p = d / "mode.bin"
        h.sync_pwrite(_filled(h, 1024, 1), str(p))
        mode = io_mode(p)
        assert mode["direct"] is direct, mode
        if direct:
            assert mode["offset_align"] >= 512 and mode["offset_align"] % 512 == 0
    assert io_mode(buffered_dir / "mode.bin")["fs"] in ("tmpfs", "ramfs")


# --------------------------------------------------------------------------------------------- errors
def test_bad_input_raises_naming_file_and_offset(any_dir):
    h = aio_handle(block_size=4096)
    buf = _filled(h, 4096, 3)
    missing = any_dir / "nope.bin"
    with pytest.raises(AioError, match=r"read of '.*nope\.bin' at offset 512: No such file") as e:
        h.sync_pread(buf, str(missing), 512)
    assert e.value.errno == 2
    with pytest.raises(AioError, match=r"write of '.*no_dir/x\.bin' at offset 0: No such file"):
        h.sync_pwrite(buf, str(any_dir / "no_dir" / "x.bin"))
    short = any_dir / "short.bin"
    h.sync_pwrite(buf[:1024], str(short))
    with pytest.raises(AioError, match=r"short\.bin' at offset 0: the file has 4096 bytes, the read needs 16384"):
        h.sync_pread(buf, str(short))
    with pytest.raises(AioError, match=r"short\.bin' at offset 4096: the file has 4096 bytes"):
        h.async_pread(buf[:128], str(short), 4096)
    with pytest.raises(ValueError, match=r"not contiguous"):
        h.sync_pwrite(torch.empty(64, 64).t(), str(any_dir / "nc.bin"))
    with pytest.raises(ValueError, match=r"is on meta; it must be a CPU tensor"):
        h.sync_pwrite(torch.empty(1024, device="meta"), str(any_dir / "meta.bin"))
    with pytest.raises(ValueError, match=r"negative file offset"):
        h.sync_pread(buf, str(short), -512)
    with pytest.raises(TypeError):
        h.sync_pread([1, 2, 3], str(short))
    with pytest.raises(TypeError, match="unexpected keyword"):
        h.pread(buf, str(short), async_opp=True)
    assert h.wait() == 0  # nothing was queued by any of the refused calls


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_and_async_failures_surface_at_wait(any_dir):
    h = aio_handle(block_size=4096, queue_depth=4)
    buf = _filled(h, 8192, 4)
    with pytest.raises(AioError, match=r"write of '/dev/full' \(32768 bytes at offset 0\) failed at offset 0: No space") as e:
        h.sync_pwrite(buf, "/dev/full")
    assert e.value.errno == 28
    # Async: submitted fine, the failure is raised by the wait() that completes it, after the other
    # ops in flight finished; the handle stays usable.
    good = any_dir / "good.bin"
    assert h.async_pwrite(buf, str(good)) == 0
    assert h.async_pwrite(buf, "/dev/full", 4096) == 0
    with pytest.raises(AioError, match=r"'/dev/full' \(32768 bytes at offset 4096\) failed at offset 4096"):
        h.wait()
    assert h.pending() == 0 and h.wait() == 0
    back = h.new_cpu_locked_tensor(8192, F32)
    assert h.sync_pread(back, str(good)) == 1 and torch.equal(back, buf)


def test_no_descriptor_leaks(any_dir):
    h = aio_handle(block_size=4096, queue_depth=8)
    buf = _filled(h, 2048, 6)
    h.sync_pwrite(buf, str(any_dir / "warm.bin"))
    before = _fds()
    for i in range(100):
        h.async_pwrite(buf, str(any_dir / f"f{i % 7}.bin"))
        h.async_pread(buf, str(any_dir / "warm.bin"))
        if i % 10 == 0:
            for bad in (lambda: h.sync_pread(buf, str(any_dir / "missing.bin")),
                        lambda: h.sync_pread(buf, str(any_dir / "warm.bin"), 4096),  # short
                        lambda: h.sync_pwrite(buf, "/dev/full")):
                with pytest.raises(AioError):
                    bad()
    h.wait()  # (the failed sync writes to /dev/full also waited for what was in flight)
    assert h.pending() == 0
    assert _fds() == before
    h.close()
    del h
    assert _fds() == before


def test_concurrent_load_bit_exact(any_dir, backend):
    """Many async writes and reads in flight on several handles and Python threads; checksums match."""
    sizes = [128, 4096, 65536, 300 * 128, 1 << 18]

    def worker(tid, out):
        h = aio_handle(block_size=8192, queue_depth=8)
        bufs, sums = [], {}
        for i in range(24):
            b = _filled(h, sizes[i % len(sizes)], 100 * tid + i)
            bufs.append(b)
            path = any_dir / f"t{tid}_{i % 6}.bin"
            off = (i // 6) * (1 << 20)  # four regions per file, written concurrently
            h.async_pwrite(b, str(path), off)
            sums[(path, off)] = (b.numel(), zlib.crc32(b.numpy().tobytes()))
        assert h.wait() == 24
        reads = []
        for (path, off), (numel, _) in sums.items():
            r = h.new_cpu_locked_tensor(numel, F32)
            h.async_pread(r, str(path), off)
            reads.append(((path, off), r))
        assert h.wait() == len(reads)
        out[tid] = [(key, zlib.crc32(r.numpy().tobytes()) == sums[key][1]) for key, r in reads]

    out = {}
    threads = [threading.Thread(target=worker, args=(t, out)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(out) == 4, "a worker thread failed or hung"
    bad = [key for results in out.values() for key, ok in results if not ok]
    assert not bad, bad


# --------------------------------------------------------------------------------------------- GIL
# Both run in a child process with a timeout: a regression here is a deadlock (a worker finishing an
# op drops a tensor reference, which takes the GIL), and must fail the test, not hang the job.
def _run_child(script, *args, timeout=180):
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    try:
        r = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"child did not finish in {timeout}s (deadlock?): {(e.stdout or b'')[-2000:]!r}")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


_GIL_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import torch
    from deepspeed_z3ext import aio_handle

    def progress_during(call):
        # How far a pure-Python counter thread got while `call` ran on this thread. Without the GIL
        # released, the counter cannot move between the two reads around the call.
        count, stop, started = [0], threading.Event(), threading.Event()
        def spin():
            started.set()
            while not stop.is_set():
                count[0] += 1
        t = threading.Thread(target=spin)
        t.start(); started.wait(); time.sleep(0.01)
        before = count[0]
        t0 = time.perf_counter()
        call()
        elapsed = time.perf_counter() - t0
        after = count[0]
        stop.set(); t.join()
        return after - before, elapsed

    path = sys.argv[1] + "/big.bin"
    h = aio_handle(block_size=1 << 16, queue_depth=1)  # one thread, small blocks: long calls
    big = h.new_cpu_locked_tensor(32 << 20, torch.empty(0))  # 128 MiB
    big.copy_(torch.randn(32 << 20))
    for name, call in (("sync_pwrite", lambda: h.sync_pwrite(big, path)),
                       ("pread", lambda: h.pread(big, path, False, False, 0)),
                       ("wait", lambda: (h.async_pread(big, path), h.wait()))):
        progress, elapsed = progress_during(call)
        print(name, progress, f"{elapsed:.3f}s")
        assert progress > 0, f"{name} held the GIL for {elapsed:.3f}s"
    h.async_pwrite(big, path)
    progress, elapsed = progress_during(lambda: h.close())  # destruction path: waits with the GIL released
    print("close", progress, f"{elapsed:.3f}s")
    assert progress > 0
    print("OK")
""")


def test_blocking_calls_release_the_gil(any_dir):
    _run_child(_GIL_SCRIPT, any_dir)


_DEADLOCK_SCRIPT = textwrap.dedent("""
    import gc, logging, sys, threading, weakref
    import numpy as np, torch
    from deepspeed.utils import logger
    from deepspeed_z3ext import aio_handle
    notices = []
    class H(logging.Handler):
        def emit(self, r):
            if "z3ext aio:" in r.getMessage(): notices.append(r.getMessage())
    logger.addHandler(H(level=logging.INFO)); logger.setLevel(logging.INFO)
    direct_dir, buffered_dir = sys.argv[1], sys.argv[2]
    main = threading.get_ident()
    freed_on = []
    def submit(h, path):
        # A tensor whose storage is a numpy array: its deleter takes the GIL to drop the array.
        arr = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
        weakref.finalize(arr, lambda: freed_on.append(threading.get_ident()))
        h.async_pwrite(torch.from_numpy(arr), path)
        del arr  # the op now holds the only reference
    h = aio_handle(block_size=1 << 16, queue_depth=1)
    submit(h, buffered_dir + "/dl.bin")
    assert h.wait() == 1
    submit(h, buffered_dir + "/dl2.bin")
    del h; gc.collect()  # destruction with the op in flight
    assert len(freed_on) == 2 and main not in freed_on, (freed_on, main)
    # The I/O mode is logged once per filesystem, however many files.
    h = aio_handle()
    b = h.new_cpu_locked_tensor(1024, torch.empty(0))
    for i in range(3):
        h.sync_pwrite(b, direct_dir + f"/n{i}.bin"); h.sync_pwrite(b, buffered_dir + f"/n{i}.bin")
    print("NOTICES", notices)
    assert sum("O_DIRECT I/O on" in n for n in notices) == 1, notices
    assert sum("buffered I/O on" in n for n in notices) == 1, notices
    print("OK")
""")


def test_deadlock_shape_completes(direct_dir, buffered_dir):
    """DeepSpeed #7727/#8196: a tensor whose cleanup needs the GIL is finished on a worker while the
    caller blocks in wait() / destruction. Run in a child so that a deadlock fails instead of hanging."""
    _run_child(_DEADLOCK_SCRIPT, direct_dir, buffered_dir)
