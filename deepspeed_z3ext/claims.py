"""One claim vocabulary: the kinds and owners of claims, and their error ([Note: claims] and
[Note: claim owners] in csrc/claim.h, where the same constants are defined for the C++ engine).

A parameter is gathered while it holds at least one `(kind, owner)` claim:
- FORWARD, owner a module's ds_id: its forward runs (or its unit was prefetched for it);
- BACKWARD, owner a token from `new_token` space (>= TOKEN_BASE): an autograd graph or one module
  call needs it in backward ([Note: graph claims] in graphs.py);
- GATHERED / DIRECT / PERSIST / RESIDENT, owner SHARED_OWNER: a GatheredParameters block, a direct
  `param.all_gather()`, persistence, a no_grad forward's unit kept for the next ([Note: generation
  residency] in resident_set.py);
- FALLBACK, owner a DeepCompile forward graph id (fallback.py).
"""
from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.errors import Z3extError

# [Note: lazy claim vocabulary] The constants are the compiled ops' own (ClaimKind is the C++ enum the engine
# takes), so reading them loads the ops, and a load may build them. They are therefore made at the first
# read of any of them (module `__getattr__`), not at import: importing the package must not build where
# nothing asked for the ops (`python -m deepspeed_z3ext`, the report, builds nothing unless given --build and
# must work where a build would fail). The first read puts them all in the module's globals, so later reads
# are plain attribute lookups. What they are:
# - ClaimKind, FORWARD, BACKWARD, GATHERED, FALLBACK, PERSIST, DIRECT, RESIDENT: the kinds;
# - SHARED_OWNER: the owner of GATHERED, DIRECT and PERSIST claims; TOKEN_BASE: BACKWARD tokens start above
#   every module ds_id;
# - FORWARD_START_KINDS: what the start of an outermost forward ends (Backward claims end with their graph
#   or pass);
# - STEP_KINDS: what the optimizer step ends: everything but live GatheredParameters blocks (the step
#   rewrites partitions: a full parameter kept across it would be stale) and persistence, whose parameters
#   stay gathered and are re-gathered in place (engine.sweep_step, [Note: persistent refresh] in
#   csrc/engine.h);
# - RESET_KINDS: what DeepSpeed's other releases of everything end (a checkpoint's save or load, an emptied
#   partition cache): persistence too, as stock, whose module state saved there is partitioned.
_LAZY = ("ClaimKind", "FORWARD", "BACKWARD", "GATHERED", "FALLBACK", "PERSIST", "DIRECT", "RESIDENT", "SHARED_OWNER",
         "TOKEN_BASE", "FORWARD_START_KINDS", "STEP_KINDS", "RESET_KINDS")


def _vocabulary() -> dict:
    compiled = ops()
    kind = compiled.ClaimKind
    names = {"ClaimKind": kind, "SHARED_OWNER": compiled.SHARED_OWNER, "TOKEN_BASE": compiled.TOKEN_BASE}
    names.update((k, getattr(kind, k)) for k in ("FORWARD", "BACKWARD", "GATHERED", "FALLBACK", "PERSIST", "DIRECT",
                                                  "RESIDENT"))
    names["FORWARD_START_KINDS"] = (kind.FORWARD, kind.DIRECT, kind.FALLBACK)
    names["STEP_KINDS"] = names["FORWARD_START_KINDS"] + (kind.BACKWARD, kind.RESIDENT)
    names["RESET_KINDS"] = names["STEP_KINDS"] + (kind.PERSIST, )
    return names


def __getattr__(name):  # [Note: lazy claim vocabulary]
    if name in _LAZY:
        globals().update(_vocabulary())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ClaimError(Z3extError, RuntimeError):
    """A duplicate claim by one owner, or a release without a claim; the message names the parameter."""
