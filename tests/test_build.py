"""The op builder in fresh processes: cached load time, no CUDA context at import, a stale lock left
by a killed build, a missing ninja named in the error, and one build folder per environment."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


def _python(code, env=None, timeout=300):
    full_env = dict(os.environ, DS_ACCELERATOR="cpu", **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def _build_dir():
    r = _python("""
        import deepspeed_z3ext
        from deepspeed_z3ext._ops import _builder_class  # the builder the import used
        print(_builder_class()().build_dir())""")
    assert r.returncode == 0, r.stderr[-2000:]
    return Path(r.stdout.strip().splitlines()[-1])


def test_cached_import_is_fast_and_creates_no_cuda_context():
    _build_dir()  # makes sure the cache is built
    r = _python("""
        import time, torch, deepspeed
        t = time.perf_counter()
        import deepspeed_z3ext
        print(time.perf_counter() - t, torch.cuda.is_initialized())""")
    assert r.returncode == 0, r.stderr[-2000:]
    seconds, cuda_ctx = r.stdout.split()[-2:]
    assert float(seconds) < 2.0
    assert cuda_ctx == "False"


def test_stale_lock_from_a_killed_build_is_removed():
    lock = _build_dir() / "lock"
    lock.write_text("")  # what torch leaves behind when a build is killed
    t = time.time()
    r = _python("import deepspeed_z3ext", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not lock.exists() and time.time() - t < 120
    assert "stale build lock" in r.stderr + r.stdout


def test_missing_ninja_says_what_to_install(tmp_path):
    r = _python("import deepspeed_z3ext", env={"PATH": str(tmp_path), "CXX": "/usr/bin/g++",
                                                "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}, timeout=120)
    assert r.returncode != 0
    assert "pip install ninja" in r.stderr


def test_two_environments_never_rebuild_each_others_ops(tmp_path):
    """Two venvs (two sys.prefix) over one torch, one TORCH_EXTENSIONS_DIR: each builds once into its own
    folder ([Note: build cache key]); switching between them twice rebuilds nothing."""
    venvs = []
    for name in ("env_a", "env_b"):
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / name)],
                       check=True, timeout=120)
        venvs.append(tmp_path / name / "bin" / "python")
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]))
    probe = textwrap.dedent("""
        import sys
        from deepspeed_z3ext._ops import ops
        print("PREFIX", sys.prefix)
        print("SO", ops().__file__)""")

    def load(python):
        r = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line[:3] in ("PRE", "SO "))
        so = Path(lines["SO"])
        return lines["PREFIX"], so, so.stat().st_mtime_ns, (so.parent / ".ninja_log").read_text()

    first = [load(p) for p in venvs]
    assert first[0][0] != first[1][0]  # two environments really
    assert first[0][1].parent != first[1][1].parent  # each its own build folder
    assert all(f[1].parent.parent == tmp_path / "ext" for f in first)
    for _ in range(2):  # switch back and forth twice
        again = [load(p) for p in venvs]
        assert [a[1:] for a in again] == [f[1:] for f in first], "a switch rebuilt the ops"
