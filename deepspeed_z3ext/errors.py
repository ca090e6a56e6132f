"""z3ext's exceptions: one base class, so `except deepspeed_z3ext.Z3extError` catches every error z3ext
raises on purpose, and each also is the builtin a caller of DeepSpeed's code would catch there
(`ClaimError` is defined with the claim vocabulary, claims.py). The base, the activation error and the config
error live in the top-level `deepspeed_z3ext_activate` module, which loads without this package ([Note:
activation], [Note: section key])."""
from deepspeed_z3ext_activate import Z3extActivationError, Z3extConfigError, Z3extError, Z3extLauncherError  # noqa: F401


class AioError(Z3extError, OSError):
    """A read or write the filesystem refused or could not complete; the message names file and offset."""


class GradientError(Z3extError, RuntimeError):
    """A gradient z3ext cannot reduce-scatter (missing, or not the parameter's size); the message names
    the parameter. A RuntimeError, as DeepSpeed's own "Cannot reduce scatter gradients" is."""


class WeightsError(Z3extError, ValueError):
    """A `full_weights` request it cannot serve (bucket_bytes, an unknown name, partitions on NVMe or
    quantized); the message names what."""


class LeakError(Z3extError, RuntimeError):
    """`leak_check` found a parameter gathered without a claim, or released but still referenced, on some rank;
    raised on every rank, the first line naming the leaking rank and parameter (leaks.py). A RuntimeError, as
    it was."""
