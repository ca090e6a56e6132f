"""The deadline of a stalled z3ext collective: the process groups' own timeout, less a margin to deliver.

[Note: the deadline is the group's] How long a rank may keep the others waiting is the user's decision, made
where the process group was made (`deepspeed.init_distributed(timeout=...)`, `dist.new_group(timeout=...)`;
DeepSpeed 0.19's default is 10 minutes, `DEEPSPEED_TIMEOUT`; torch's 30 for gloo, 10 for NCCL). A watchdog
with its own limit either ends legitimate skew (a rank-0-only checkpoint write or evaluation longer than the
limit) or, where the group's timeout is the shorter, loses to the backend's own error (gloo's "Timed out
waiting", then "Connection closed by peer" on the other ranks; NCCL's watchdog ending the process). So z3ext
reads the timeout of every group it issues collectives on (the engine's, each parameter's, hpZ's, the gradient
norm's; a group DeepSpeed makes by `new_group` without a timeout, as its hpZ groups and its data-parallel clone,
has torch's default, not the world's) and takes the smallest, `timeout`. A collective pending for
`deadline = timeout - max(5 s, 10 %)` (at most half the timeout off) ends in `RankTimeoutError` on every rank:
the margin covers a poll, the reports' exchange and the delivery, so the named error comes before the backend's.
Until then `hang_timeout` is the interval at which every rank logs a warning naming the late rank and where it
is, and training goes on ([Note: hang watchdog] in watchdog.py).

torch 2.13 keeps a group's timeout in each backend's options (`group._get_backend(device).options._timeout`,
gloo and NCCL alike; `_set_pg_timeout` changes it there); where a backend has none readable, torch's default for
the backend (`_get_default_timeout`) is what the group was made with.
"""
from datetime import timedelta
from typing import Iterable, NamedTuple

import torch.distributed as dist

MARGIN_SECONDS, MARGIN_FRACTION = 5.0, 0.1


def group_timeout(group) -> float:
    """Seconds after which `group`'s backend fails a collective ([Note: the deadline is the group's])."""
    found = []
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            found.append(timeout.total_seconds())
    if found:
        return min(found)
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group)).total_seconds()


class Deadline(NamedTuple):
    timeout: float   # the smallest timeout of the groups z3ext issues on (seconds)
    deadline: float  # a stalled collective's age at which every rank raises
    interval: float  # hang_timeout: a warning while a rank is late, this often

    @property
    def first(self) -> float:
        """The age at which the first inquiry opens: one interval, or the deadline if that comes first."""
        return min(self.interval, self.deadline)

    def describe(self) -> str:
        return (f"the process group's timeout of {self.timeout:g}s less {self.timeout - self.deadline:g}s to "
                "deliver ([Note: the deadline is the group's] in deepspeed_z3ext/deadline.py)")


def deadline_of(groups: Iterable, hang_timeout: float) -> Deadline:
    """The Deadline of an engine whose collectives go over `groups` (a group once is enough)."""
    timeout = min((group_timeout(g) for g in groups), default=dist.distributed_c10d._get_default_timeout(
        "gloo").total_seconds())
    margin = min(max(MARGIN_SECONDS, MARGIN_FRACTION * timeout), timeout / 2)
    return Deadline(timeout, timeout - margin, hang_timeout)
