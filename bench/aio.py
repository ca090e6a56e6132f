"""Read and write throughput of z3ext's I/O op vs DeepSpeed's async_io op vs plain Python file I/O.

    python bench/aio.py                       # auto: an O_DIRECT folder and /dev/shm (tmpfs)
    python bench/aio.py --dirs /nvme/x --block-sizes 128K,1M,8M --queue-depths 1,8,32 --size 512M

Every system reads and writes the same files in the same run, in interleaved rounds whose order
rotates (median reported); with --isolated each system runs in its own process per round (no other
I/O op loaded alongside it). Writes are timed up to an fsync (so page-cache writes are not counted as done); before
every read the file is written back and dropped from the page cache (POSIX_FADV_DONTNEED), so no
system reads another's cached pages. DeepSpeed's op is included when libaio lets it build
(`apt-get install libaio-dev`); otherwise the results say so.

`--buffers aligned,unaligned` (the default): `aligned` reads and writes a page-aligned
`new_cpu_locked_tensor` buffer of exactly --size bytes; `unaligned` a plain `torch.empty` buffer 4
bytes past a 512-byte boundary (as `torch.randn(n + 1)[1:]`) of --size + 3 bytes, which z3ext moves
through O_DIRECT with a bounce buffer plus a page-cache tail. DeepSpeed is left out of `unaligned`
rows on O_DIRECT folders: its handle silently drops the bytes past the last whole block there (and
aborts the process reading them back), see tests/test_aio_any_buffer.py. Results go to
bench/out/aio-<name>.{json,txt} (untracked; --out DIR elsewhere) with the machine (CPU, kernel, filesystem, device).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def human(n):
    for unit, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------- systems
class HandleSystem:
    """A DeepSpeed-API handle (ours or DeepSpeed's): one locked buffer, sync_pread / sync_pwrite."""

    def __init__(self, name, factory, block_size, queue_depth, nbytes, unaligned=False):
        self.name = name
        self.h = factory(block_size=block_size, queue_depth=queue_depth, single_submit=False,
                         overlap_events=False, intra_op_parallelism=1)
        self.buf = unaligned_buffer(nbytes) if unaligned else self.h.new_cpu_locked_tensor(
            nbytes, torch.empty(0, dtype=torch.uint8))

    def write(self, path):
        self.h.sync_pwrite(self.buf, path, 0)

    def read(self, path):
        self.h.sync_pread(self.buf, path, 0)


class PythonSystem:
    """Plain Python: one unbuffered file object, readinto/write of the tensor's memory."""
    name = "python"

    def __init__(self, nbytes, unaligned=False):
        self.buf = unaligned_buffer(nbytes) if unaligned else torch.empty(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())

    def write(self, path):
        with open(path, "r+b" if os.path.exists(path) else "wb", buffering=0) as f:
            f.write(self.view)

    def read(self, path):
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(self.view)
            assert n == len(self.view), (n, len(self.view))


def unaligned_buffer(nbytes):
    """--size + 3 bytes, 4 bytes past a 512-byte boundary: what torch.randn(n + 1)[1:] gives."""
    base = torch.empty(nbytes + 3 + 1024, dtype=torch.uint8)
    start = (-base.data_ptr()) % 512 + 4
    return base[start:start + nbytes + 3]


def deepspeed_factory():
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None, "DeepSpeed async_io not buildable here (libaio-dev missing)"
        return AsyncIOBuilder().load(verbose=False).aio_handle, None
    except Exception as e:  # a build failure is a result, not a crash of the benchmark
        return None, f"DeepSpeed async_io failed to load: {e}"


# ------------------------------------------------------------------------------------------ machine
def machine(dirs):
    from deepspeed_z3ext.aio import io_mode
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    fs = {}
    for d in dirs:
        probe = Path(d) / "z3ext_probe.bin"
        probe.write_bytes(b"\0" * 4096)
        mode = io_mode(probe)
        probe.unlink()
        try:
            src = subprocess.run(["df", "--output=source", str(d)], capture_output=True, text=True).stdout.split()[-1]
        except Exception:
            src = "?"
        dev = Path(src).name
        rot = Path(f"/sys/block/{dev}/queue/rotational")
        model = Path(f"/sys/block/{dev}/device/model")
        fs[str(d)] = dict(mode, device=src, rotational=rot.read_text().strip() if rot.exists() else "?",
                          device_model=model.read_text().strip() if model.exists() else "?")
    import deepspeed
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "filesystems": fs}


def default_dirs():
    from deepspeed_z3ext.aio import io_mode
    out = []
    for base in (Path("/tmp"), ROOT / "bench" / ".aio_tmp"):
        d = base / f"z3ext-aio-bench-{os.getpid()}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / "probe.bin"
        p.write_bytes(b"\0" * 4096)
        direct = io_mode(p)["direct"]
        p.unlink()
        if direct:
            out.append(d)
            break
        d.rmdir()
    shm = Path("/dev/shm")
    if shm.is_dir():
        d = shm / f"z3ext-aio-bench-{os.getpid()}"
        d.mkdir(exist_ok=True)
        out.append(d)
    return out


# ---------------------------------------------------------------------------------------------- run
def measure(s, path, times, key):
    """One write (to an fsync) and one read (from a dropped cache) of system `s`."""
    t0 = time.perf_counter()
    s.write(path)
    fsync_path(path)
    times.setdefault(key + ("write", ), []).append(time.perf_counter() - t0)
    drop_cache(path)
    t0 = time.perf_counter()
    s.read(path)
    times.setdefault(key + ("read", ), []).append(time.perf_counter() - t0)
    drop_cache(path)


def make_system(name, bs, qd, nbytes, ds_factory, kind="aligned"):
    from deepspeed_z3ext import aio_handle
    unaligned = kind == "unaligned"
    if name == "python":
        s = PythonSystem(nbytes, unaligned)
    else:
        s = HandleSystem(name, aio_handle if name == "z3ext" else ds_factory, bs, qd, nbytes, unaligned)
    s.buf.copy_(torch.randint(0, 256, (s.buf.numel(), ), dtype=torch.uint8))
    return s


def systems_for(names, kind, direct):
    """DeepSpeed cannot do unaligned I/O on an O_DIRECT folder (module docstring)."""
    return [n for n in names if not (kind == "unaligned" and direct and n == "deepspeed")]


def is_direct(d):
    from deepspeed_z3ext.aio import io_mode
    probe = Path(d) / "z3ext_probe_direct.bin"
    probe.write_bytes(b"\0" * 4096)
    try:
        return io_mode(probe)["direct"]
    finally:
        probe.unlink()


def child_pass(name, dirs, block_sizes, depths, nbytes, kinds):
    """--isolated: this process measures every configuration once for one system."""
    ds_factory = deepspeed_factory()[0] if name == "deepspeed" else None
    times = {}
    for d in dirs:
        for kind in kinds:
            if name not in systems_for([name], kind, is_direct(d)):
                continue
            for bs in block_sizes:
                for qd in depths:
                    s = make_system(name, bs, qd, nbytes, ds_factory, kind)
                    measure(s, str(Path(d) / "bench.bin"), times, (name, str(d), kind, bs, qd))
                    del s
    print("CHILD_RESULT " + json.dumps([list(k) + [v[0]] for k, v in times.items()]), flush=True)


def rotated(names, rnd):
    # Each round starts with another system: the system measured right after another one's
    # write+fsync or cache drop measured consistently lower on this virtual disk.
    k = rnd % len(names)
    return names[k:] + names[:k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", default="auto", help="comma-separated folders (auto: an O_DIRECT one and /dev/shm)")
    ap.add_argument("--size", default="256M", help="bytes per read/write (one file per folder)")
    ap.add_argument("--block-sizes", default="128K,1M,8M")
    ap.add_argument("--queue-depths", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffers", default="aligned,unaligned", help="aligned (locked, exact size), unaligned (plain "
                    "tensor at a misaligned address, odd size), or both")
    ap.add_argument("--isolated", action="store_true",
                    help="each system in its own process per round (no other I/O op loaded alongside)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--name", default=f"{os.cpu_count()}xCPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"), help="folder for the results (default untracked)")
    args = ap.parse_args()

    import deepspeed_z3ext  # noqa: F401  (builds the ops once, before any timing)
    nbytes = parse_size(args.size)
    block_sizes = [parse_size(b) for b in args.block_sizes.split(",")]
    depths = [int(q) for q in args.queue_depths.split(",")]
    kinds = args.buffers.split(",")
    if args.child:
        return child_pass(args.child, [Path(d) for d in args.dirs.split(",")], block_sizes, depths, nbytes, kinds)
    dirs = default_dirs() if args.dirs == "auto" else [Path(d) for d in args.dirs.split(",")]
    ds_factory, ds_missing = deepspeed_factory()
    info = machine(dirs)
    info["deepspeed_async_io"] = ds_missing or "available"
    info["mode"] = "isolated processes" if args.isolated else "one process"
    print(json.dumps(info, indent=1))
    names = ["z3ext"] + (["deepspeed"] if ds_factory is not None else []) + ["python"]

    times = {}
    if args.isolated:
        for rnd in range(args.rounds):
            for name in rotated(names, rnd):
                cmd = [sys.executable, __file__, "--child", name, "--dirs", ",".join(map(str, dirs)), "--size",
                       args.size, "--block-sizes", args.block_sizes, "--queue-depths", args.queue_depths,
                       "--buffers", args.buffers]
                r = subprocess.run(cmd, capture_output=True, text=True)
                line = [x for x in r.stdout.splitlines() if x.startswith("CHILD_RESULT ")]
                if r.returncode or not line:
                    raise SystemExit(f"bench child {name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                for name_, d, kind, bs, qd, op, sec in json.loads(line[0].split(" ", 1)[1]):
                    times.setdefault((name_, d, kind, bs, qd, op), []).append(sec)
                print(f"round {rnd}: {name} done", flush=True)
    else:
        for d in dirs:
            for kind in kinds:
                here = systems_for(names, kind, info["filesystems"][str(d)]["direct"])
                for bs in block_sizes:
                    for qd in depths:
                        systems = {n: make_system(n, bs, qd, nbytes, ds_factory, kind) for n in here}
                        for rnd in range(args.rounds):
                            for n in rotated(here, rnd):
                                measure(systems[n], str(Path(d) / "bench.bin"), times, (n, str(d), kind, bs, qd))
                        del systems
                        print(f"{d} {kind} bs={human(bs)} qd={qd} done", flush=True)

    rows = []
    for (name, d, kind, bs, qd, op), ts in times.items():
        fs = info["filesystems"][str(d)]
        moved = nbytes + (3 if kind == "unaligned" else 0)
        rows.append(dict(dir=str(d), fs=fs["fs"], direct=fs["direct"], buffer=kind, block_size=bs, queue_depth=qd,
                         system=name, op=op, seconds=statistics.median(ts), times=ts,
                         gbps=moved / statistics.median(ts) / 1e9))
    for d in dirs:
        p = Path(d) / "bench.bin"
        if p.exists():
            p.unlink()

    text = report(rows, info, nbytes, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"aio-{args.name}.json").write_text(json.dumps({"machine": info, "size": nbytes, "rounds": args.rounds,
                                                            "command": " ".join(sys.argv), "rows": rows}, indent=1))
    (out / f"aio-{args.name}.txt").write_text(text)
    for d in dirs:
        if args.dirs == "auto":
            try:
                d.rmdir()
            except OSError:
                pass


def report(rows, info, nbytes, args):
    by = {(r["dir"], r["buffer"], r["block_size"], r["queue_depth"], r["system"], r["op"]): r["gbps"] for r in rows}
    all_systems = [s for s in ("z3ext", "deepspeed", "python") if any(r["system"] == s for r in rows)]
    lines = [f"bench/aio.py: {human(nbytes)} per op, median of {args.rounds} interleaved rounds ({info['mode']}), "
             "GB/s (1e9 B/s)", f"command: python {' '.join(sys.argv)}",
             f"CPU: {info['cpu']} x{info['cores']}; kernel {info['kernel']}; torch {info['torch']}; "
             f"deepspeed {info['deepspeed']}; DeepSpeed async_io: {info['deepspeed_async_io']}"]
    for d, fs in info["filesystems"].items():
        lines.append(f"{d}: {fs['fs']} on {fs['device']} (rotational {fs['rotational']}, model {fs['device_model']}), "
                     f"z3ext uses {'O_DIRECT' if fs['direct'] else 'buffered'} I/O")
    for d, kind in dict.fromkeys((r["dir"], r["buffer"]) for r in rows):
        fs = info["filesystems"][d]["fs"]
        systems = [s for s in all_systems if any(r["system"] == s and r["dir"] == d and r["buffer"] == kind
                                                 for r in rows)]
        ratio_cols = [f"z3/{s[:2]}" for s in systems[1:]]
        head = f"{'fs':6} {'buffer':9} {'op':5} {'block':>5} {'qd':>3} " + " ".join(f"{s:>9}" for s in systems) + \
            " " + " ".join(f"{c:>7}" for c in ratio_cols)
        lines += ["", head]
        for op in ("read", "write"):
            for bs in dict.fromkeys(r["block_size"] for r in rows):
                for qd in dict.fromkeys(r["queue_depth"] for r in rows):
                    vals = [by[(d, kind, bs, qd, s, op)] for s in systems]
                    ratios = [vals[0] / v for v in vals[1:]]
                    lines.append(f"{fs:6} {kind:9} {op:5} {human(bs):>5} {qd:>3} " +
                                 " ".join(f"{v:9.2f}" for v in vals) + " " + " ".join(f"{x:6.2f}x" for x in ratios))
        for op in ("read", "write"):
            best = {s: max(by[(d, kind, bs, qd, s, op)] for bs in dict.fromkeys(r["block_size"] for r in rows)
                           for qd in dict.fromkeys(r["queue_depth"] for r in rows)) for s in systems}
            lines.append(f"{fs:6} {kind:9} {op:5} best: " + ", ".join(f"{s} {v:.2f}" for s, v in best.items()) +
                         "".join(f"; z3ext/{s} {best['z3ext'] / best[s]:.2f}x" for s in systems[1:]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
