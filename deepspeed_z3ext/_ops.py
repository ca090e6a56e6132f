"""Loads the compiled ops (JIT-built on first use, cached afterwards)."""
import os
import sys
from pathlib import Path

_ops = None


def _builder_class():
    # A source tree (editable install, a worktree on PYTHONPATH) builds its own csrc/; an installed
    # package uses the op_builder it was installed with.
    root = Path(__file__).resolve().parent.parent
    if (root / "op_builder" / "z3ext.py").exists() and (root / "csrc").is_dir():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        from op_builder.z3ext import Z3extOpBuilder
        return Z3extOpBuilder
    from deepspeed_z3ext.op_builder import Z3extOpBuilder
    return Z3extOpBuilder


def ops():
    global _ops
    if _ops is None:
        _ops = _builder_class()().load(verbose=os.environ.get("Z3EXT_VERBOSE_BUILD", "0") == "1")
    return _ops
