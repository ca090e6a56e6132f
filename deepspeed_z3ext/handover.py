"""The one line a z3ext engine logs at `deepspeed.initialize` (rank 0): what z3ext owns for this engine and
what it hands to DeepSpeed, and why.

[Note: handover line] A config that enables z3ext changes what runs without changing the script, and some
options give part of the work back to DeepSpeed (optimizer offload, ZeRO++ qgZ, `reduce_scatter: false`,
`z3ext.reduce_gradients: false`): before this line, gradients handed back were said only at the first
gradient, and nothing at all confirmed that z3ext was active. The line is made once the engine has its
optimizer (the `_configure_zero_optimizer` seam, which builds the stage-3 optimizer and with it the
engine's z3ext state, or only the parameter manager when there is no optimizer), from the same
`grads.stock_path_reason` that decides the gradient path at the first gradient; it only reads, so that
decision is still made there, as before (a parameter group added in between can still change it).
It goes through DeepSpeed's logger at INFO where that logger shows INFO, and otherwise to stderr: DeepSpeed
0.19.8's logger shows only warnings by default (and frameworks set its level), and a confirmation that is
not seen confirms nothing, while a warning would say something is wrong. Rank 0 only, either way one line.
"""
import logging
import sys

from deepspeed.utils import logger

from deepspeed_z3ext import grads

PREFIX = "z3ext is on for this engine:"


def line(optimizer):
    """The line for the optimizer `_configure_zero_optimizer` returned; None when z3ext is not on for it."""
    offload = getattr(optimizer, "parameter_offload", optimizer)  # no optimizer: the parameter manager itself
    state = getattr(offload, "z3ext", None)
    if state is None:
        return None
    owns = f"z3ext owns gather and release of {len(state.params)} ZeRO-3 parameters"
    if offload is optimizer:
        return (f"{PREFIX} {owns}; no optimizer, so no gradients are reduced; DeepSpeed keeps partitioning and "
                "checkpoints")
    reason = grads.stock_path_reason(optimizer, state)
    if reason is None:
        return (f"{PREFIX} {owns} and the gradient reduce-scatter; DeepSpeed keeps partitioning, the optimizer "
                "step and checkpoints")
    return (f"{PREFIX} {owns}; it hands the gradient reduce-scatter to DeepSpeed, for {reason}; DeepSpeed also "
            "keeps partitioning, the optimizer step and checkpoints")


def configure_zero_optimizer(stock):
    """`DeepSpeedEngine._configure_zero_optimizer`: DeepSpeed's, then the handover line ([Note: handover line])."""
    def _configure_zero_optimizer(self, optimizer):
        configured = stock(self, optimizer)
        said = line(configured)
        if said is not None:
            say(said)
        return configured

    return _configure_zero_optimizer


def say(message):
    """On rank 0: DeepSpeed's logger at INFO where it shows INFO, else stderr ([Note: handover line])."""
    import deepspeed.comm as dist
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if logger.isEnabledFor(logging.INFO):
        logger.info(message)
    else:
        print(message, file=sys.stderr, flush=True)
