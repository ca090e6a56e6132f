"""Loads the compiled ops (JIT-built on first use, cached afterwards)."""
import os

_ops = None


def ops():
    global _ops
    if _ops is None:
        try:
            from deepspeed_z3ext.op_builder import Z3extOpBuilder
        except ImportError:  # a source checkout used without `pip install -e .`
            import sys
            from pathlib import Path
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from op_builder import Z3extOpBuilder
        _ops = Z3extOpBuilder().load(verbose=os.environ.get("Z3EXT_VERBOSE_BUILD", "0") == "1")
    return _ops
