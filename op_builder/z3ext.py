"""DeepSpeed-style op builder for the z3ext C++ ops.

`Z3extOpBuilder().load()` returns the compiled module: an ahead-of-time build when one was made at
`pip install` time (`Z3EXT_BUILD_OPS=1`), else a JIT build with ninja cached under
`TORCH_EXTENSIONS_DIR`. The CUDA flavour (streams and events) is built when torch has CUDA; a
CPU-only flavour otherwise. Nothing here creates a CUDA context.
"""
import fcntl
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
    Which `ninja` is on PATH is left out too: each folder runs the ninja it was first built with
    ([Note: one ninja per build folder]). The executable enters by its real path, links resolved: a
    venv's `python`, `python3` and `python3.11` (and a launcher's shebang, `torchrun`'s is `python3`)
    are links to one interpreter, which once cost one 63 MB build per spelling; what tells two venvs
    of one interpreter apart is their `sys.prefix`.
    """
    parts = (sys.prefix, sys.exec_prefix, os.path.realpath(sys.executable), str(CSRC), torch.__version__)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


# [Note: one ninja per build folder] torch runs `ninja` from PATH. ninja 1.13 writes its build log
# (`.ninja_log`) as v7, 1.11 as v5, and each discards the other's and rebuilds everything, so a PATH
# that switched between a venv's ninja and the system's rebuilt the ops at each switch (keying the
# folder on the ninja version instead built them once per version). The first build of a folder
# therefore pins the ninja PATH gives then: `<folder>/z3ext-ninja/ninja` is a link to it, and every
# build or load of that folder runs with `z3ext-ninja` first on PATH, so it is always that ninja
# whatever PATH says, and nothing else on PATH moves (a link, not the pinned ninja's own folder, which
# could hold another `c++`). Which ninja runs does not change what is built, only the log's format.
# Once the pinned ninja is gone (its venv removed) the link dangles and PATH's ninja is pinned anew.
PINNED_NINJA = "z3ext-ninja"


def pinned_ninja_dir(build_dir):
    """The folder holding this build folder's ninja (a link), pinned from PATH at the first call;
    None when there is none pinned and none on PATH. Called under the build folder's flock."""
    folder = Path(build_dir) / PINNED_NINJA
    link = folder / "ninja"
    if os.path.exists(link):  # follows the link: False when its target is gone
        return folder
    found = shutil.which("ninja")
    if found is None:
        return None
    folder.mkdir(exist_ok=True)
    tmp = folder / f"ninja.{os.getpid()}"
    if os.path.lexists(tmp):
        tmp.unlink()
    tmp.symlink_to(os.path.abspath(found))
    os.replace(tmp, link)
    return folder


def _mtime_ns(path):
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def _say(message):
    # stderr, not DeepSpeed's logger, whose level frameworks lower: a first build's 1-3 silent minutes
    # look like a hang.
    print(message, file=sys.stderr, flush=True)


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


def compiler() -> str:
    """The C++ compiler a build runs: torch's choice, `$CXX` or `c++`."""
    return os.environ.get("CXX", "c++")


def compiler_problem(run=True):
    """What stops the C++ compiler from building, in words, or None. `run`: also run `<compiler> --version`
    (a compiler that exists but does not run, `CXX=/bin/false`), which the report and a due build do, and
    a load of built ops does not (it compiles nothing)."""
    cxx = compiler()
    found = shutil.which(cxx)
    if found is None:
        return (f"no C++ compiler '{cxx}' on PATH. Install one (e.g. `apt-get install g++`) or set CXX to "
                "one that is.")
    if not run:
        return None
    try:
        r = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"the C++ compiler '{cxx}' ({found}) does not run: {e}. Install one or set CXX to one that runs."
    if r.returncode != 0:
        said = r.stderr.strip().splitlines()
        return (f"the C++ compiler '{cxx}' ({found}) does not run: `{cxx} --version` exited {r.returncode}"
                + (f" ({said[-1]})" if said else "") + ". Install one or set CXX to one that runs.")
    return None


def compiler_version():
    """The first line `<compiler> --version` prints (call after compiler_problem() found none)."""
    r = subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=60)
    return (r.stdout.strip().splitlines() or ["?"])[0]


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
        problem = compiler_problem(run=False)
        if problem is not None:
            raise OpBuildError(f"z3ext: {problem}")
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
            waiting = False
            while True:
                try:
                    fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waiting and time.time() - t0 > 5:  # a build, not another rank's cached load: say so once
                        _say(f"z3ext: waiting for another process building the ops in {build_dir}")
                        waiting = True
                    if time.time() - t0 > 900:
                        raise OpBuildError(f"z3ext: another process has been building the ops in {build_dir} for "
                                           "15 minutes; stop it or remove that folder.")
                    time.sleep(0.5)
            stale = build_dir / "lock"
            if torch_lock_outlives_its_holder() and stale.exists():
                from deepspeed.utils import logger
                logger.warning(f"z3ext: removing stale build lock {stale} left by a killed build")
                stale.unlink()
            ninja_dir = pinned_ninja_dir(build_dir)
            if ninja_dir is None:
                raise OpBuildError("z3ext: ninja is required to build the ops: `pip install ninja`.")
            # torch names the module after the build's name; a missing .so or a source newer than it is a
            # build (an edit of csrc/ rebuilds in place). The end line follows what really happened: the .so changed.
            so = build_dir / f"{self.name}.so"
            before = _mtime_ns(so)
            announced = before is None or any(_mtime_ns(f) > before for f in CSRC.iterdir() if f.is_file())
            if announced:
                problem = compiler_problem()  # one that exists but does not run fails the build in its own words
                if problem is not None:
                    raise OpBuildError(f"z3ext: cannot build the {self.flavour} ops in {build_dir}: {problem}")
                _say(f"z3ext: building the {self.flavour} ops in {build_dir} (first use: 1-3 minutes, cached "
                     "afterwards)")
            start = time.time()
            path = os.environ.get("PATH")
            os.environ["PATH"] = os.pathsep.join([str(ninja_dir)] + ([path] if path else []))
            try:
                mod = self.jit_load(verbose)
            except Exception as e:  # compiler errors: name the folder with the log
                raise OpBuildError(f"z3ext: building the {self.flavour} ops failed ({e}). The build folder is "
                                   f"{build_dir}; rerun with verbose=True (Z3EXT_VERBOSE_BUILD=1) to see the "
                                   "compiler output.") from e
            finally:
                if path is None:
                    os.environ.pop("PATH", None)
                else:
                    os.environ["PATH"] = path
            if announced or _mtime_ns(so) != before:
                _say(f"z3ext: built the {self.flavour} ops in {time.time() - start:.0f} s ({so})")
            return mod

    def builder(self):
        ext = super().builder()
        ext.name = self.absolute_name()
        return ext
