"""`deepspeed_z3ext.stats(engine)`: what z3ext holds for an engine right now."""
from typing import Dict, List, NamedTuple, Tuple


class Z3extStats(NamedTuple):
    live_bytes: int                 # bytes of gathered storages holding memory now ([Note: true release])
    peak_live_bytes: int
    gathered: List[str]             # names of parameters gathered now
    claims: Dict[str, List[Tuple[str, int]]]  # parameter name -> [(claim kind, owner)], claimed ones only
    collectives: int                # all-gathers issued since the engine was created
    gathered_params: int            # parameter gathers since creation
    # No buffer pool since true release (released memory goes back to the allocator at once, see
    # [Note: true release] in csrc/engine.h): these stay 0 and are kept for readers of older versions.
    pool_cached_bytes: int
    pool_budget_bytes: int
    pool_reused: int
    pool_orphaned: int
    nvme_reads: int = 0             # NVMe partitions read in for gathers ([Note: nvme offload])
    nvme_read_ahead_hits: int = 0   # of those, read ahead before their gather ([Note: nvme read-ahead])
    refilled_params: int = 0        # gathers into a storage a previous gather made (views of it valid again)
    backward_prefetched: int = 0    # units gathered ahead of their module's backward ([Note: backward prefetch])
    refreshed_params: int = 0       # persistent parameters re-gathered in place after a step ([Note: persistent refresh])
    fetch_groups: int = 0           # modules fetching their block's units as one ([Note: fetch groups])
    # ZeRO++ hpZ ([Note: hpZ secondary partition] in csrc/secondary.h): bytes of the secondary
    # partitions the parameters hold now, and the all-gathers (of `collectives`) that read them.
    secondary_bytes: int = 0
    secondary_collectives: int = 0
    # [Note: schedule check] in schedule.py: comparisons of the ranks' all-gathers, and the host time they took
    schedule_checks: int = 0
    schedule_check_seconds: float = 0.0
    graph_votes: int = 0            # votes on graph deaths ([Note: one schedule on every rank])
    # [Note: generation residency] in resident_set.py: elements no_grad forwards keep gathered now, and the
    # no_grad forwards that found everything resident ([Note: resident fast path])
    resident_numel: int = 0
    resident_forwards: int = 0


def state_of(engine):
    """The Z3extState of a DeepSpeedEngine (or of its optimizer / DeepSpeedZeRoOffload)."""
    from deepspeed_z3ext.state import of_engine
    state = of_engine(engine)
    if state is None:
        raise ValueError("z3ext is not enabled for this engine: add \"z3ext\": true to its DeepSpeed config "
                         "(with zero_optimization.stage 3); installed with pip, z3ext attaches itself, else import deepspeed_z3ext "
                         "before deepspeed.initialize")
    return state


def stats(engine) -> Z3extStats:
    state = state_of(engine)
    s = state.engine.stats()
    from deepspeed_z3ext._ops import ops
    gathered_state = ops().ParamState.GATHERED
    residency = state.engine.residency  # None without NVMe offload
    check = state.schedule_check
    gathered, claims = [], {}
    for h in state.engine.handles:
        if h.state == gathered_state:
            gathered.append(h.name)
        cs = h.claims
        if cs:
            claims[h.name] = [(k.name.lower(), owner) for k, owner in cs]
    return Z3extStats(live_bytes=s["live_bytes"], peak_live_bytes=s["peak_live_bytes"], gathered=gathered,
                      claims=claims, collectives=s["collectives"], gathered_params=s["gathered_params"],
                      pool_cached_bytes=0, pool_budget_bytes=0, pool_reused=0, pool_orphaned=0,
                      refilled_params=s["refilled"], refreshed_params=s["refreshed"],
                      backward_prefetched=state.coordinator.backward_window.gathered_ahead if state.coordinator else 0,
                      fetch_groups=len(state.groups),
                      secondary_bytes=sum(t.numel() * t.element_size() for t in
                                          (getattr(p, "ds_secondary_tensor", None) for p in state.params) if t is not None),
                      secondary_collectives=s["secondary_collectives"],
                      nvme_reads=getattr(residency, "reads", 0),
                      nvme_read_ahead_hits=getattr(residency, "read_ahead_hits", 0),
                      schedule_checks=check.checks if check else 0, schedule_check_seconds=check.seconds if check else 0.0,
                      graph_votes=state.agreement.votes,
                      resident_numel=state.coordinator.resident.numel if state.coordinator else 0,
                      resident_forwards=state.coordinator.resident.forwards if state.coordinator else 0)


def grad_stats(engine):
    """`GradReduceStats` of z3ext's gradient path for this engine ([Note: gradient path]); None while no
    gradient has been reduced yet, or when DeepSpeed's path reduces them."""
    reducer = state_of(engine).grad_reducer
    return reducer.stats() if reducer else None
