"""The op builder in fresh processes: cached load time, no CUDA context at import, a stale lock left
by a killed build, and a missing ninja named in the error."""
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
        from deepspeed_z3ext.op_builder import Z3extOpBuilder
        print(Z3extOpBuilder().build_dir())""")
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
