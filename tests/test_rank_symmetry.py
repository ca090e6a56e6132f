"""Rank symmetry: what one rank keeps alive, or when its garbage collector runs, never changes the
collectives it issues (DESIGN "Invariants", [Note: graph claims] in graphs.py).

A grad-enabled forward's graph holds its modules' parameters gathered, and a held unit is not
gathered again by the next forward. If only rank 0 keeps such a forward's output alive (for
logging, say) while rank 1 drops it, the ranks must still agree on the graph's death, or rank 1
all-gathers a unit that rank 0 skips: gloo reports a collective mismatch ("Received data size
doesn't match expected size"), NCCL hangs or mixes the data of different units.

Every case runs on 2 real gloo ranks and trains stock ZeRO-3 and z3ext on the same seed, running the
same per-rank program on both (stock trains it), then checks:
- z3ext's losses (and the kept forwards' values) and final parameters equal stock's bitwise;
- the all-gather collectives z3ext issued (`deepspeed_z3ext.stats(engine).collectives`, read after every
  forward and micro-step) are the same counts on both ranks: the schedule does not depend on lifetimes.
A mismatched schedule hangs gloo (one rank's all-gather against the other's reduce-scatter): a short
collective timeout makes it gloo's "Timed out waiting ... for send operation" on a rank, and the
per-test timeout catches whatever still hangs.

Cases:
(a) a grad-enabled forward without backward whose output only rank 0 keeps across the following steps;
(b) an evaluation forward (`engine.eval()`, no `no_grad`) between steps whose outputs rank 0 keeps;
(c) the output in a reference cycle on both ranks, garbage collected on rank 1 at once and on rank 0
    steps later (the collector disabled meanwhile, so its timing is the test's);
(d) rank 0 keeps grad-enabled forwards' outputs across optimizer steps (one taken between
    micro-steps, one between the last backward and the step) and drops them mid-accumulation later.
"""
from tests.harness import run_on_ranks

TIMEOUT = 120  # a passing case takes about 10 s; a collective mismatch may hang: it becomes a named failure
COLLECTIVE_TIMEOUT = 45  # seconds: gloo's timeout for one collective in these tests


def _batch(i):
    import torch.distributed as dist
    from tests.models import batch
    return batch(i, dist.get_rank())


class _Run:
    """One engine's micro-steps and extra forwards, with z3ext's collective count after each."""

    def __init__(self, z3ext, ga):
        from tests.models import build_engine, ds_config
        self.z3ext = z3ext
        self.engine = build_engine(ds_config(z3ext=True if z3ext else False, persistence=0, ga=ga))
        self.losses, self.collectives = [], []

    def _count(self, what):
        if self.z3ext:
            import deepspeed_z3ext
            self.collectives.append((what, deepspeed_z3ext.stats(self.engine).collectives))

    def micro(self, i, before_step=None):
        """forward, backward, (before_step), step."""
        loss = self.engine(_batch(i))
        self._count(f"forward {i}")
        self.engine.backward(loss)
        self._count(f"backward {i}")
        if before_step is not None:
            before_step()
        self.engine.step()
        self.losses.append(loss.item())
        self._count(f"step {i}")

    def forward(self, i, eval_mode=False):
        """A grad-enabled forward with no backward; its output is returned (and its value recorded)."""
        if eval_mode:
            self.engine.eval()
        out = self.engine(_batch(1000 + i))
        if eval_mode:
            self.engine.train()
        self._count(f"extra forward {i}")
        assert out.requires_grad
        self.losses.append(("extra", out.item()))
        return out

    def finish(self):
        from tests.models import full_params
        params = full_params(self.engine)
        self._count("final")
        return dict(losses=self.losses, params=params, collectives=self.collectives)


def _compare(case, ga):
    """On every rank: the same per-rank program on stock, then on z3ext."""
    import datetime
    import torch
    import torch.distributed as dist
    # A mismatched schedule hangs gloo (an all-gather on one rank against a reduce-scatter on the other):
    # a short collective timeout turns it into gloo's error on the ranks well before the test's timeout.
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # private: absent, the test's timeout
    if set_timeout is not None:
        set_timeout(datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    out = {}
    for name, z3ext in (("stock", False), ("z3ext", True)):
        run = _Run(z3ext, ga)
        try:
            out[name] = case(run)
        finally:
            run.engine.destroy()
    stock, z3 = out["stock"], out["z3ext"]
    return dict(stock_losses=stock["losses"], z3ext_losses=z3["losses"],
                differing=[n for n in stock["params"] if not torch.equal(stock["params"][n], z3["params"][n])],
                collectives=z3["collectives"])


def _check(results):
    for rank, r in enumerate(results):
        assert r["z3ext_losses"] == r["stock_losses"], \
            f"rank {rank}: losses differ\nstock {r['stock_losses']}\nz3ext {r['z3ext_losses']}"
        assert not r["differing"], f"rank {rank}: final parameters differ from stock: {r['differing']}"
    counts = [r["collectives"] for r in results]
    assert all(c == counts[0] for c in counts), \
        "the ranks issued different all-gathers:\n" + "\n".join(f"rank {k}: {c}" for k, c in enumerate(counts))
    assert counts[0][-1][1] > 0


# --------------------------------------------------------------------------- (a)
def kept_forward(run):
    import torch.distributed as dist
    rank = dist.get_rank()
    run.micro(0)
    out = run.forward(0)
    kept = [out] if rank == 0 else []  # rank 0 keeps it "for logging"; rank 1 drops it here
    del out
    for i in range(1, 4):
        run.micro(i)
    result = run.finish()
    kept.clear()
    return result


def test_grad_forward_kept_by_rank0_only():
    _check(run_on_ranks(_compare, case=kept_forward, ga=1, timeout=TIMEOUT))


# --------------------------------------------------------------------------- (b)
def kept_eval_forward(run):
    import torch.distributed as dist
    rank = dist.get_rank()
    history = []  # rank 0 logs the evaluation losses as tensors (without .item())
    for i in range(4):
        run.micro(i)
        out = run.forward(i, eval_mode=True)
        if rank == 0:
            history.append(out)
        del out
    result = run.finish()
    history.clear()
    return result


def test_eval_forward_without_no_grad_kept_by_rank0_only():
    _check(run_on_ranks(_compare, case=kept_eval_forward, ga=1, timeout=TIMEOUT))


# --------------------------------------------------------------------------- (c)
def cycle_collected_on_rank1(run):
    import gc
    import torch.distributed as dist
    rank = dist.get_rank()
    gc.collect()
    gc.disable()
    try:
        run.micro(0)
        run.micro(1)
        holder = {"out": run.forward(0)}
        holder["self"] = holder  # only the collector frees it
        del holder
        if rank == 1:
            gc.collect()
        run.micro(2)
        run.micro(3)
        if rank == 0:  # between micro-steps of the next step
            gc.collect()
        for i in range(4, 6):
            run.micro(i)
        result = run.finish()
    finally:
        gc.enable()
        gc.collect()
    return result


def test_reference_cycle_collected_on_rank1_only():
    _check(run_on_ranks(_compare, case=cycle_collected_on_rank1, ga=2, timeout=TIMEOUT))


# --------------------------------------------------------------------------- (d)
def kept_across_step(run):
    import torch.distributed as dist
    rank = dist.get_rank()
    kept = []

    def keep(out):
        if rank == 0:
            kept.append(out)

    run.micro(0)
    keep(run.forward(0))  # between the micro-steps of step 0
    run.micro(1)
    run.micro(2)
    run.micro(3, before_step=lambda: keep(run.forward(1)))  # after step 1's last backward, before its update
    run.micro(4)
    kept.clear()  # rank 0 drops both in the middle of step 2
    run.micro(5)
    run.micro(6)
    run.micro(7)
    return run.finish()


def test_grad_forward_kept_across_step_by_rank0_then_dropped():
    _check(run_on_ranks(_compare, case=kept_across_step, ga=2, timeout=TIMEOUT))
