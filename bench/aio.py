"""Read and write throughput of z3ext's I/O op vs DeepSpeed's async_io op vs plain Python file I/O.

    python bench/aio.py                       # auto: an O_DIRECT folder and /dev/shm (tmpfs)
    python bench/aio.py --dirs /nvme/x --block-sizes 128K,1M,8M --queue-depths 1,8,32 --size 512M

Every system reads and writes the same files in the same run, in interleaved rounds whose order
rotates (median reported). Writes are timed up to an fsync (so page-cache writes are not counted as done); before
every read the file is written back and dropped from the page cache (POSIX_FADV_DONTNEED), so no
system reads another's cached pages. DeepSpeed's op is included when libaio lets it build
(`apt-get install libaio-dev`); otherwise the results say so. Results go to
bench/results/aio-<name>.{json,txt} with the machine (CPU, kernel, filesystem, device).
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

    def __init__(self, name, factory, block_size, queue_depth, nbytes):
        self.name = name
        self.h = factory(block_size=block_size, queue_depth=queue_depth, single_submit=False,
                         overlap_events=False, intra_op_parallelism=1)
        self.buf = self.h.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))

    def write(self, path):
        self.h.sync_pwrite(self.buf, path, 0)

    def read(self, path):
        self.h.sync_pread(self.buf, path, 0)


class PythonSystem:
    """Plain Python: one unbuffered file object, readinto/write of the tensor's memory."""
    name = "python"

    def __init__(self, nbytes):
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())

    def write(self, path):
        with open(path, "r+b" if os.path.exists(path) else "wb", buffering=0) as f:
            f.write(self.view)

    def read(self, path):
        with open(path, "rb", buffering=0) as f:
            n = f.readinto(self.view)
            assert n == len(self.view), (n, len(self.view))


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
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dirs", default="auto", help="comma-separated folders (auto: an O_DIRECT one and /dev/shm)")
    ap.add_argument("--size", default="256M", help="bytes per read/write (one file per folder)")
    ap.add_argument("--block-sizes", default="128K,1M,8M")
    ap.add_argument("--queue-depths", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default=f"{os.cpu_count()}xCPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()

    import deepspeed_z3ext
    from deepspeed_z3ext import aio_handle
    nbytes = parse_size(args.size)
    dirs = default_dirs() if args.dirs == "auto" else [Path(d) for d in args.dirs.split(",")]
    block_sizes = [parse_size(b) for b in args.block_sizes.split(",")]
    depths = [int(q) for q in args.queue_depths.split(",")]
    ds_factory, ds_missing = deepspeed_factory()
    info = machine(dirs)
    info["deepspeed_async_io"] = ds_missing or "available"
    print(json.dumps(info, indent=1))

    rows = []
    python = PythonSystem(nbytes)
    for d in dirs:
        path = str(Path(d) / "bench.bin")
        for bs in block_sizes:
            for qd in depths:
                systems = [HandleSystem("z3ext", aio_handle, bs, qd, nbytes)]
                if ds_factory is not None:
                    systems.append(HandleSystem("deepspeed", ds_factory, bs, qd, nbytes))
                systems.append(python)
                for s in systems:
                    s.buf.copy_(torch.randint(0, 256, (nbytes, ), dtype=torch.uint8))
                times = {(s.name, op): [] for s in systems for op in ("write", "read")}
                for rnd in range(args.rounds):
                    # Interleaved, and rotated: each round runs every system once, each round starting
                    # with another (the system right after a write+fsync or a cache drop of another
                    # one measured consistently lower on this virtual disk).
                    for s in systems[rnd % len(systems):] + systems[:rnd % len(systems)]:
                        t0 = time.perf_counter()
                        s.write(path)
                        fsync_path(path)
                        times[(s.name, "write")].append(time.perf_counter() - t0)
                        drop_cache(path)
                        t0 = time.perf_counter()
                        s.read(path)
                        times[(s.name, "read")].append(time.perf_counter() - t0)
                        drop_cache(path)
                for (name, op), ts in times.items():
                    rows.append(dict(dir=str(d), fs=info["filesystems"][str(d)]["fs"],
                                     direct=info["filesystems"][str(d)]["direct"], block_size=bs, queue_depth=qd,
                                     system=name, op=op, seconds=statistics.median(ts), times=ts,
                                     gbps=nbytes / statistics.median(ts) / 1e9))
                    print(f"{rows[-1]['fs']:6} bs={human(bs):>4} qd={qd:>3} {name:9} {op:5} "
                          f"{rows[-1]['gbps']:6.2f} GB/s", flush=True)
                for s in systems:
                    if isinstance(s, HandleSystem):
                        del s.buf
                        del s.h
        os.unlink(path)

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
    by = {(r["dir"], r["block_size"], r["queue_depth"], r["system"], r["op"]): r["gbps"] for r in rows}
    systems = [s for s in ("z3ext", "deepspeed", "python") if any(r["system"] == s for r in rows)]
    lines = [f"bench/aio.py: {human(nbytes)} per op, median of {args.rounds} interleaved rounds, GB/s (1e9 B/s)",
             f"CPU: {info['cpu']} x{info['cores']}; kernel {info['kernel']}; torch {info['torch']}; "
             f"deepspeed {info['deepspeed']}; DeepSpeed async_io: {info['deepspeed_async_io']}"]
    for d, fs in info["filesystems"].items():
        lines.append(f"{d}: {fs['fs']} on {fs['device']} (rotational {fs['rotational']}, model {fs['device_model']}), "
                     f"z3ext uses {'O_DIRECT' if fs['direct'] else 'buffered'} I/O")
    ratio_cols = [f"z3/{s[:2]}" for s in systems[1:]]
    head = f"{'fs':6} {'op':5} {'block':>5} {'qd':>3} " + " ".join(f"{s:>9}" for s in systems) + " " + \
        " ".join(f"{c:>7}" for c in ratio_cols)
    for d in dict.fromkeys(r["dir"] for r in rows):
        fs = info["filesystems"][d]["fs"]
        lines += ["", head]
        for op in ("read", "write"):
            for bs in dict.fromkeys(r["block_size"] for r in rows):
                for qd in dict.fromkeys(r["queue_depth"] for r in rows):
                    vals = [by[(d, bs, qd, s, op)] for s in systems]
                    ratios = [vals[0] / v for v in vals[1:]]
                    lines.append(f"{fs:6} {op:5} {human(bs):>5} {qd:>3} " + " ".join(f"{v:9.2f}" for v in vals) + " " +
                                 " ".join(f"{x:6.2f}x" for x in ratios))
        for op in ("read", "write"):
            best = {s: max(by[(d, bs, qd, s, op)] for bs in dict.fromkeys(r["block_size"] for r in rows)
                           for qd in dict.fromkeys(r["queue_depth"] for r in rows)) for s in systems}
            lines.append(f"{fs:6} {op:5} best: " + ", ".join(f"{s} {v:.2f}" for s, v in best.items()) +
                         "".join(f"; z3ext/{s} {best['z3ext'] / best[s]:.2f}x" for s in systems[1:]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
