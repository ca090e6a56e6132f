"""deepspeed_z3ext: ZeRO-3 parameter gather and release owned by C++ ops and explicit claims.

    import deepspeed, deepspeed_z3ext
    engine, *_ = deepspeed.initialize(..., config={..., "zero_optimization": {"stage": 3}, "z3ext": True})

The first import JIT-builds the ops (cached afterwards). Without a "z3ext" section DeepSpeed is
unchanged. Installed with pip, the import is not needed: a config that enables z3ext imports this
package at its DeepSpeedConfig check ([Note: activation] in deepspeed_z3ext_activate.py).
"""
import sys as _sys

import deepspeed_z3ext_activate as _activation
from deepspeed_z3ext._ops import ops as _ops
from deepspeed_z3ext.aio import aio_handle
from deepspeed_z3ext.config import Z3extConfig
from deepspeed_z3ext.claims import ClaimError
from deepspeed_z3ext.errors import (AioError, GradientError, LeakError, WeightsError, Z3extActivationError, Z3extConfigError,
                                    Z3extError, Z3extLauncherError)
from deepspeed_z3ext.fallback import FallbackStats, fallback_of
from deepspeed_z3ext.generation import release_resident, resident
from deepspeed_z3ext.schedule import ScheduleMismatchError
from deepspeed_z3ext.seams import install, installed, uninstall
from deepspeed_z3ext.stats import Z3extStats, grad_stats, stats
from deepspeed_z3ext.watchdog import RankTimeoutError
from deepspeed_z3ext.weights import FullWeight, full_weights
from deepspeed_z3ext import deepspeed_private as _private

__version__ = "0.1.0"

# `python -m deepspeed_z3ext` (the report, report.py) imports this package while sys.argv[0] is "-m":
# it must run where the build would fail, and changes nothing in DeepSpeed. Only that command: another
# `python -m pkg.mod` whose package imports deepspeed_z3ext builds and installs as usual.
_orig = getattr(_sys, "orig_argv", [])
_report_only = (_sys.argv[:1] == ["-m"] and "-m" in _orig and _orig.index("-m") + 1 < len(_orig)
                and _orig[_orig.index("-m") + 1] == "deepspeed_z3ext")
if not _report_only:
    _ops()  # build or load now, so a broken toolchain fails at import with instructions
    _private.check_version()
    _activation.install_check()  # under the seams (which wrap it), also when the package was not installed with its .pth
    install()



def __getattr__(name):
    # ClaimKind is the compiled ops' enum: read at first use ([Note: lazy claim vocabulary] in claims.py), so
    # that `python -m deepspeed_z3ext` imports this package without building.
    if name == "ClaimKind":
        from deepspeed_z3ext import claims
        return claims.ClaimKind
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["stats", "grad_stats", "Z3extStats", "Z3extConfig", "Z3extError", "Z3extConfigError", "Z3extActivationError", "Z3extLauncherError", "GradientError", "ClaimError", "ClaimKind", "fallback_of",
           "FallbackStats", "ScheduleMismatchError", "RankTimeoutError", "LeakError", "resident", "release_resident", "aio_handle", "AioError", "install",
           "uninstall", "installed", "full_weights", "FullWeight", "WeightsError"]
