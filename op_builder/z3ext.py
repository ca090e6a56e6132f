"""DeepSpeed-style op builder for the z3ext C++ ops.

`Z3extOpBuilder().load()` returns the compiled module: an ahead-of-time build when one was made at
`pip install` time (`Z3EXT_BUILD_OPS=1`), else a JIT build with ninja cached under
`TORCH_EXTENSIONS_DIR`. The CUDA flavour (streams and events) is built when torch has CUDA; a
CPU-only flavour otherwise. Nothing here creates a CUDA context.
"""
import fcntl
import functools
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
from deepspeed.ops.op_builder.builder import CUDAOpBuilder

CSRC = Path(__file__).resolve().parent.parent / "csrc"


class OpBuildError(RuntimeError):
    """The z3ext ops could not be built or loaded; the message says what to install or remove."""


def _flavour():
    return "cuda" if torch.version.cuda is not None and torch.cuda.is_available() else "cpu"


def environment_key():
    """A short hash of what a JIT build of these ops depends on besides its sources' contents.

    [Note: build cache key] torch names the JIT build folder after the extension only
    (`$TORCH_EXTENSIONS_DIR/<name>`, by default per Python and CUDA version but not per environment),
    and its build.ninja records the environment's and the source tree's paths. Two environments (two
    venvs, two `sys.prefix`) or two checkouts sharing that folder each rewrite build.ninja, so every
    switch between them rebuilds. The name therefore carries a hash of the interpreter's prefix and
    executable, the source folder and the torch version: each environment and checkout keeps its own
    build, nothing is shared between them. The sources' contents are left out on purpose: an edit
    rebuilds in place (torch compares the sources) instead of leaving one folder behind per edit.
    It also carries the version of the `ninja` on PATH (the one torch runs): ninja 1.13 writes its
    build log (`.ninja_log`) as v7, 1.11 as v5, and each discards the other's and rebuilds everything,
    so a PATH that switches between a venv's ninja and the system's would rebuild at each switch.
    """
    parts = (sys.prefix, sys.exec_prefix, os.path.abspath(sys.executable), str(CSRC), torch.__version__,
             _ninja_version(os.environ.get("PATH", "")))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


@functools.lru_cache(maxsize=None)
def _ninja_version(path):
    """`ninja --version` of the ninja found on `path` (as torch runs it); "" where there is none."""
    exe = shutil.which("ninja", path=path)
    if exe is None:
        return ""
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def torch_lock_outlives_its_holder(cpp_extension=None):
    """Whether torch's JIT build lock (`<build dir>/lock`) blocks by its mere existence, so that one
    left by a killed build blocks every later build ([Note: stale build lock]).

    True for torch up to 2.13: `_jit_compile` takes a `FileBaton` (the file created with O_EXCL, waited
    on while it exists, removed at release). False from 2.14: it holds a `filelock.FileLock` on the
    file, an flock the kernel releases when its holder dies; the file stays after every build and a
    later build simply locks it again.
    """
    if cpp_extension is None:
        from torch.utils import cpp_extension
    return "FileBaton" in vars(cpp_extension)


class Z3extOpBuilder(CUDAOpBuilder):
    BUILD_VAR = "Z3EXT_BUILD_OPS"
    NAME = "deepspeed_z3ext_ops"

    def __init__(self, flavour=None):
        self.flavour = flavour or _flavour()
        # The JIT build (module and folder) is keyed by environment ([Note: build cache key]); the
        # ahead-of-time module keeps the plain name (absolute_name), as it lives inside its environment.
        super().__init__(name=f"{self.NAME}_{self.flavour}_{environment_key()}")

    def absolute_name(self):
        return f"deepspeed_z3ext.{self.NAME}_{self.flavour}"

    def sources(self):
        return [str(CSRC / "bindings.cpp")]

    def include_paths(self):
        return [str(CSRC)]

    def cxx_args(self):
        args = super().cxx_args() + ["-Wno-deprecated-declarations"]
        if self.flavour == "cuda":
            args.append("-DZ3EXT_WITH_CUDA")
        return args

    def nvcc_args(self):
        # No .cu sources: the CUDA flavour is C++ against ATen's CUDA stream/event API. Skipping
        # DeepSpeed's arch parsing also avoids its crash on TORCH_CUDA_ARCH_LIST=9.0a.
        return []

    def is_compatible(self, verbose=False):
        return True

    # -- checks that turn build failures into instructions -------------------------------------
    def check_toolchain(self):
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise OpBuildError(f"z3ext: no C++ compiler '{cxx}' on PATH. Install one (e.g. `apt-get install g++`) "
                               "or set CXX.")
        try:
            from torch.utils.cpp_extension import verify_ninja_availability
            verify_ninja_availability()
        except RuntimeError as e:
            raise OpBuildError("z3ext: ninja is required to build the ops: `pip install ninja`.") from e
        py_inc = sysconfig.get_paths()["include"]
        if not Path(py_inc, "Python.h").exists():
            raise OpBuildError(f"z3ext: Python headers not found in {py_inc}: install python3-dev "
                               "(`apt-get install python3-dev`) for this interpreter.")
        if self.flavour == "cuda":
            from torch.utils.cpp_extension import CUDA_HOME
            if CUDA_HOME is None or not Path(CUDA_HOME, "include", "cuda_runtime.h").exists():
                raise OpBuildError("z3ext: torch has CUDA but the CUDA toolkit headers were not found; install the "
                                   "CUDA toolkit matching torch.version.cuda and set CUDA_HOME.")

    def build_dir(self):
        from torch.utils.cpp_extension import _get_build_directory
        return Path(_get_build_directory(self.name, verbose=False))

    def load(self, verbose=False):
        if self.name in self._loaded_ops:
            return self._loaded_ops[self.name]
        try:  # ahead-of-time build from `Z3EXT_BUILD_OPS=1 pip install .`
            mod = importlib.import_module(self.absolute_name())
            self._loaded_ops[self.name] = mod
            return mod
        except ImportError:
            pass
        self.check_toolchain()
        build_dir = self.build_dir()
        # [Note: stale build lock] torch up to 2.13 guards its JIT build folder with a `lock` file
        # whose existence blocks (FileBaton) and waits forever if a killed build left it behind.
        # Every z3ext build first takes an flock on `z3ext.flock` (released by the kernel when its
        # holder dies), so there a torch `lock` that exists while we hold the flock belongs to a dead
        # build and is removed, with a warning. torch 2.14 holds an flock on that file instead
        # (filelock) and leaves the file after every build: a leftover blocks nothing, and removing
        # it could let two builds lock two different files, so it is left alone and nothing is said
        # (torch_lock_outlives_its_holder; tests/test_build.py checks which kind the installed torch has).
        with open(build_dir / "z3ext.flock", "w") as guard:
            t0 = time.time()
            while True:
                try:
                    fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.time() - t0 > 900:
                        raise OpBuildError(f"z3ext: another process has been building the ops in {build_dir} for "
                                           "15 minutes; stop it or remove that folder.")
                    time.sleep(0.5)
            stale = build_dir / "lock"
            if torch_lock_outlives_its_holder() and stale.exists():
                from deepspeed.utils import logger
                logger.warning(f"z3ext: removing stale build lock {stale} left by a killed build")
                stale.unlink()
            try:
                return self.jit_load(verbose)
            except Exception as e:  # compiler errors: name the folder with the log
                raise OpBuildError(f"z3ext: building the {self.flavour} ops failed ({e}). The build folder is "
                                   f"{build_dir}; rerun with verbose=True (Z3EXT_VERBOSE_BUILD=1) to see the "
                                   "compiler output.") from e

    def builder(self):
        ext = super().builder()
        ext.name = self.absolute_name()
        return ext
