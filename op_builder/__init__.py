from .z3ext import Z3extOpBuilder, OpBuildError  # noqa: F401
