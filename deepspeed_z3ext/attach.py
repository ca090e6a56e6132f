"""Where z3ext plugs into DeepSpeed (installed once, at `import deepspeed_z3ext`).

[Note: attach seams]
- Config: `DeepSpeedConfig._do_sanity_check` also validates the `"z3ext"` section, so a bad key,
  ZeRO stage != 3 or an unsupported option fails `deepspeed.initialize` with a named error.
- Dispatch: `DeepSpeedZeRoOffload.__new__` returns a `Z3extZeRoOffload` when the config enables
  z3ext. DeepSpeed builds that object in two places (the stage-3 optimizer, and the engine itself
  without a client optimizer); dispatching at construction covers both and keeps DeepSpeed's
  `isinstance` checks true. Nothing inside `deepspeed.runtime.engine` is rebound.
- GatheredParameters: see gathered.py.
- External-parameter getter (`ZeROOrderedDict.__getitem__`): see external.py. Outside a z3ext
  module's forward it falls through to DeepSpeed's getter, which drives the eager fallback below.
- DeepCompile's eager fallback: `DeepCompileZ3EagerFallback.__new__` returns a z3ext fallback for
  z3ext engines (fallback.py); DeepSpeed's `ZeROOrderedDict` getter then drives it unchanged.
Without a `"z3ext"` section every seam falls through to DeepSpeed's own code.
"""
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from deepspeed_z3ext import external, fallback, gathered, swap
from deepspeed_z3ext.config import SECTION, Z3extConfigError, param_dict_of, parse_section, unsupported_options

_installed = False


def _validate(self):
    _stock_sanity_check(self)
    cfg = parse_section(self._param_dict)
    self.z3ext_config = cfg
    if cfg is None or not cfg.enabled:
        return
    if self.zero_optimization_stage != 3:
        raise Z3extConfigError(f'"{SECTION}" needs zero_optimization.stage 3, got stage '
                               f"{self.zero_optimization_stage}")
    refused = unsupported_options(self)
    if refused:
        raise Z3extConfigError(f'"{SECTION}" does not support yet: ' + "; ".join(refused))


def _new(cls, *args, **kwargs):
    if cls is DeepSpeedZeRoOffload:
        ds_config = kwargs.get("ds_config", args[2] if len(args) > 2 else None)
        cfg = parse_section(param_dict_of(ds_config))
        if cfg is not None and cfg.enabled:
            from deepspeed_z3ext.offload import Z3extZeRoOffload
            obj = object.__new__(Z3extZeRoOffload)
            obj._z3ext_pending_config = cfg
            return obj
    return object.__new__(cls)


_stock_sanity_check = DeepSpeedConfig._do_sanity_check


def install():
    global _installed
    if _installed:
        return
    DeepSpeedConfig._do_sanity_check = _validate
    DeepSpeedZeRoOffload.__new__ = _new
    gathered.install()
    external.install()
    fallback.install()
    swap.install()
    _installed = True
