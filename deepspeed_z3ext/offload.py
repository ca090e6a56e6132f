"""Z3extZeRoOffload: DeepSpeed's ZeRO-3 parameter manager with gather and release owned by z3ext.

DeepSpeed keeps partitioning, its module hooks, gradient reduce-scatter, the optimizer and
checkpoints; the coordinator behind the hooks and the per-parameter entry points are z3ext's.
"""
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

from deepspeed_z3ext import conditional, hooks, master, swap
from deepspeed_z3ext.config import param_dict_of, parse_section
from deepspeed_z3ext.coordinator import Z3extCoordinator
from deepspeed_z3ext.state import Z3extState, of_optimizer


def new_offload(ds_config):
    """What `DeepSpeedZeRoOffload(..., ds_config, ...)` builds when the config enables z3ext (the
    seams.py dispatch: DeepSpeed builds it in the stage-3 optimizer and, without a client optimizer,
    in the engine; its __init__ then runs on this object). None: DeepSpeed's own class."""
    cfg = parse_section(param_dict_of(ds_config))
    if cfg is None or not cfg.enabled:
        return None
    obj = object.__new__(Z3extZeRoOffload)
    obj._z3ext_pending_config = cfg
    return obj


def optimizer_step(stock):
    """`DeepSpeedZeroOptimizer_Stage3.step` inside the coordinator's `optimizer_step` ([Note: persistent
    refresh] in csrc/engine.h); stock's own for an optimizer of no z3ext engine."""
    def step(self, *args, **kwargs):
        state = of_optimizer(self)
        coordinator = state.coordinator if state is not None else None
        if coordinator is None:
            return stock(self, *args, **kwargs)
        with coordinator.optimizer_step():
            return stock(self, *args, **kwargs)

    return step


def _sizes_resident_from_memory(ds_config, z3ext_config) -> bool:
    """Whether generation sizes its resident budget from memory: no budget was set, neither z3ext's nor the
    live one ([Note: resident budget] in resident_set.py)."""
    zero = param_dict_of(ds_config).get("zero_optimization") or {}
    return z3ext_config.resident_numel is None and not {"stage3_max_live_parameters", "max_live_parameters"} & set(zero)


class Z3extZeRoOffload(DeepSpeedZeRoOffload):

    def __init__(self, module, timers, ds_config, *args, **kwargs):
        # Set by new_offload, which parsed the "z3ext" section.
        z3ext_config = self.__dict__.pop("_z3ext_pending_config")
        # DeepSpeed creates a module's backward-hook Functions only if absent, bound to the engine that
        # made them: drop any left by an earlier engine so backward routes to this one.
        for m in module.modules():
            m.__dict__.pop("pre_bwd_fn", None)
            m.__dict__.pop("post_bwd_fn", None)
        # Before the hooks: a mixture-of-experts block's unit is decided now ([Note: conditional blocks]).
        # stage3_module_granularity_threshold makes DeepSpeed choose the leaves (in its __init__): it decides.
        detect = z3ext_config.conditional_blocks and not kwargs.get("zero_module_granularity_threshold", 0)
        live = kwargs.get("max_live_parameters", 1_000_000_000)
        bound = z3ext_config.fetch_group_numel or max(1, int(live) // 2)  # [Note: a bounded guess]
        blocks = conditional.mark(module, bound) if detect else []
        skipped = conditional.mark_modules(module, z3ext_config.conditional_modules)  # [Note: conditional modules]
        super().__init__(module, timers, ds_config, *args, **kwargs)
        conditional.warn_over_budget(blocks, self._max_available_parameters_in_numel)
        self.z3ext = Z3extState(self.module, z3ext_config, self.persistent_parameters)
        self.z3ext.conditional_params = sorted(skipped, key=lambda p: p.ds_id)
        swap.attach_residency(self.z3ext.engine, self.z3ext.params)  # [Note: nvme offload]
        # stage3_max_reuse_distance 0 asks stock to release every parameter right after its module
        # and fetch it again for backward: z3ext honours it by not holding for backward.
        hold = z3ext_config.hold_for_backward and self._max_reuse_distance_in_numel > 0
        # No fetch groups ([Note: fetch groups]) where a block gathered at once is not what was asked:
        # stage3_max_reuse_distance 0 releases each module right after it, and NVMe offload sizes its
        # swap buffers (offload_param.buffer_count) for a module's partitions, not a block's.
        group_max = z3ext_config.fetch_group_numel
        if self._max_reuse_distance_in_numel <= 0 or self.z3ext.engine.residency is not None:
            group_max = 0
        self.param_coordinator = Z3extCoordinator(self.z3ext, self._max_available_parameters_in_numel,
                                                  self._prefetch_bucket_sz, hold_for_backward=hold,
                                                  hold_max_numel=z3ext_config.hold_max_numel,
                                                  group_max_numel=group_max,
                                                  group_claim_max_numel=z3ext_config.fetch_group_claim_numel,
                                                  resident_numel=z3ext_config.resident_numel,
                                                  resident_from_memory=_sizes_resident_from_memory(ds_config, z3ext_config))
        self.z3ext.coordinator = self.param_coordinator
        self.param_coordinator.resident.lifted = self.z3ext_lifted  # [Note: lifted hooks] (set by hooks.register)
        # What z3ext owns is said once the engine has its optimizer ([Note: handover line] in handover.py).

    def _register_deepspeed_module(self, module, count=None):
        # z3ext's two hooks per module instead of DeepSpeed's four ([Note: module hooks]).
        hooks.register(self, module)

    def partition_all_parameters(self):
        # Stock re-checks every parameter here; after the sweep only parameters of live
        # GatheredParameters blocks can still be gathered (they hold a Gathered claim), so no loop.
        self.get_param_coordinator().release_and_reset_all(self.module)

    def destroy(self):
        fallback = self.__dict__.pop("z3ext_fallback", None)  # set by fallback.py under DeepCompile
        if fallback is not None:
            fallback.close()
        coordinator = self.__dict__.get("param_coordinator")
        if isinstance(coordinator, Z3extCoordinator) and getattr(self, "z3ext", None) is not None:
            coordinator.close_all_groups()  # the members' kept hooks back before DeepSpeed removes them ([Note: kept lift])
        super().destroy()
        if getattr(self, "z3ext", None) is not None:
            master.give_back([p for p in self.z3ext.params if self.z3ext.owns(p)])  # [Note: partition is the master]
            self.z3ext.destroy()
            self.z3ext = None
