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

ClaimKind = ops().ClaimKind
FORWARD, BACKWARD, GATHERED = ClaimKind.FORWARD, ClaimKind.BACKWARD, ClaimKind.GATHERED
FALLBACK, PERSIST, DIRECT = ClaimKind.FALLBACK, ClaimKind.PERSIST, ClaimKind.DIRECT
RESIDENT = ClaimKind.RESIDENT

SHARED_OWNER = ops().SHARED_OWNER  # GATHERED, DIRECT and PERSIST claims
TOKEN_BASE = ops().TOKEN_BASE      # BACKWARD tokens start above every module ds_id

# What the start of an outermost forward ends (Backward claims end with their graph or pass).
FORWARD_START_KINDS = (FORWARD, DIRECT, FALLBACK)
# What the optimizer step ends: everything but live GatheredParameters blocks (the step rewrites
# partitions: a full parameter kept across it would be stale) and persistence, whose parameters stay
# gathered and are re-gathered in place (engine.sweep_step, [Note: persistent refresh] in csrc/engine.h).
STEP_KINDS = FORWARD_START_KINDS + (BACKWARD, RESIDENT)
# What DeepSpeed's other releases of everything end (a checkpoint's save or load, an emptied partition
# cache): persistence too, as stock, whose module state saved there is partitioned.
RESET_KINDS = STEP_KINDS + (PERSIST, )


class ClaimError(Z3extError, RuntimeError):
    """A duplicate claim by one owner, or a release without a claim; the message names the parameter."""
