"""`python -m deepspeed_z3ext`: what this environment runs (in the spirit of DeepSpeed's `ds_report`).

Versions, the DeepSpeed versions z3ext is tested with, CPU/CUDA, whether the ops are built and where,
and whether activation without an import is on ([Note: activation]). It builds nothing unless asked
(`--build`): `python -m` imports this package first, and its `__init__` skips the build and the seams
while the interpreter is locating a `-m` module (`sys.argv[0] == "-m"`), and nothing it imports loads the
ops ([Note: lazy claim vocabulary] in claims.py), so the report also works where the build would fail: it
names the compiler problem, and with --build the build's error as its last line (exit status 1), no traceback.
"""
import os
import platform
import site
import sys
from pathlib import Path

import deepspeed_z3ext_activate as activation


def _pth_files():
    dirs = list(site.getsitepackages()) + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [str(Path(d, "deepspeed_z3ext.pth")) for d in dirs if Path(d, "deepspeed_z3ext.pth").is_file()]


def _ops_status(builder_class):
    """(flavour, where, state) of the ops, without building them."""
    import importlib.util
    builder = builder_class()
    try:
        aot = importlib.util.find_spec(builder.absolute_name())
    except ImportError:
        aot = None
    if aot is not None:
        return builder.flavour, aot.origin, "built at install time (Z3EXT_BUILD_OPS=1)"
    folder = builder.build_dir()
    built = sorted(folder.glob(f"{builder.name}*.so"))
    if built:
        return builder.flavour, str(folder), f"built ({built[0].name}); an edit of csrc/ rebuilds in place"
    return builder.flavour, str(folder), ("not built. A build (the first `import deepspeed_z3ext`, or now with "
                                          "--build) compiles csrc/ with the C++ compiler and ninja into the ops "
                                          "folder: 1-3 minutes on an idle machine, cached afterwards")


def _compiler_line():
    """The compiler a build would run, or what is wrong with it (op_builder's checks, without building)."""
    from deepspeed_z3ext._ops import _builder_class
    module = sys.modules[_builder_class().__module__]
    problem = module.compiler_problem()
    if problem is not None:
        return "PROBLEM: " + problem
    return f"{module.compiler()} ({module.compiler_version()})"


def lines(build=False):
    import deepspeed
    import torch

    from deepspeed_z3ext import __version__
    from deepspeed_z3ext._ops import _builder_class, ops
    from deepspeed_z3ext.deepspeed_private import TESTED_VERSIONS

    out = [("deepspeed_z3ext", f"{__version__} ({Path(__file__).resolve().parent})"),
           ("python", f"{platform.python_version()} ({sys.executable})"),
           ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
           ("deepspeed", f"{deepspeed.__version__}" + ("" if deepspeed.__version__ in TESTED_VERSIONS else
                                                        "  <-- not a tested version")),
           ("deepspeed tested", ", ".join(TESTED_VERSIONS))]
    if torch.cuda.is_available():
        out.append(("device", f"CUDA, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}"))
    else:
        out.append(("device", f"CPU (no CUDA device visible); DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'unset')}"))
    out.append(("compiler", _compiler_line()))
    failed = None
    if build:
        try:
            ops()
        except Exception as e:  # noqa: BLE001 (the report goes on; the error is its last line)
            failed = f"{type(e).__name__}: {e}"
    flavour, where, state = _ops_status(_builder_class())
    out += [("ops", f"{flavour} flavour, {state}"), ("ops folder", where)]
    pth = _pth_files()
    on = activation.auto_enabled()
    out.append(("activation", (f"on: a config with \"z3ext\" attaches z3ext without an import ({pth[0]})" if pth and on else
                               f"off ({activation.SWITCH}={os.environ.get(activation.SWITCH)}): a config with \"z3ext\" "
                               "raises unless deepspeed_z3ext is imported" if pth else
                               "not installed (no deepspeed_z3ext.pth in site-packages: `pip install .` or "
                               "`pip install -e .`): import deepspeed_z3ext before deepspeed.initialize")))
    if failed is not None:
        out.append(("build", f"FAILED: {failed}"))
    return out


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(prog="python -m deepspeed_z3ext", description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="build (or load) the ops now, then report")
    args = parser.parse_args(argv)
    rows = lines(build=args.build)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 1 if rows[-1][0] == "build" else 0
