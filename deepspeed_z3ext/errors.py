"""z3ext's exceptions: one base class, so `except deepspeed_z3ext.Z3extError` catches every error z3ext
raises on purpose, and each also is the builtin a caller of DeepSpeed's code would catch there
(`ClaimError` is defined with the claim vocabulary, claims.py)."""


class Z3extError(Exception):
    """Base of every error z3ext raises on purpose; the message names the key, parameter or file."""


class Z3extConfigError(Z3extError, ValueError):
    """A `z3ext` config problem; the message names the key."""


class AioError(Z3extError, OSError):
    """A read or write the filesystem refused or could not complete; the message names file and offset."""


class GradientError(Z3extError, RuntimeError):
    """A gradient z3ext cannot reduce-scatter (missing, or not the parameter's size); the message names
    the parameter. A RuntimeError, as DeepSpeed's own "Cannot reduce scatter gradients" is."""
