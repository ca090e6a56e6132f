"""Gradient reduce-scatter owned by z3ext: the mirror of gather/release ([Note: gradient path]).

[Note: gradient path] Stock stage 3 copies each gradient into a preallocated contiguous bucket as
autograd hands it over (`__add_grad_to_ipg_bucket`: a copy, a stream wait and a dozen Python calls per
parameter), copies the bucket again into an interleaved buffer to reduce-scatter it
(`reduce_scatter_coalesced`), and copies or adds each partition in Python (`partition_grads`).
z3ext keeps DeepSpeed's gradient hooks and everything they decide (hook counting, the epilogue,
reentrant checkpoint phases, leaf modules, `ds_grad_is_ready`) and replaces the two calls behind them
(seams.py): a gradient is only noted in the engine's `GradBucket`; when the next one would take the
bucket past `reduce_bucket_size` elements or into another process group, and at the backward's
epilogue, one C++ call (`reduce_scatter_grads`, csrc/reduce.h) lays the bucket out for the collective
(the one copy), reduce-scatters it and writes this rank's gradient partitions, bit for bit what stock
writes ([Note: gradient arithmetic]); then the full gradients are released. DeepSpeed's bucket buffer
(`reduce_bucket_size` elements, allocated at initialize) is freed: between flushes the gradients
autograd made are the bucket. On CUDA the work runs on DeepSpeed's reduce stream, waited for by
stock's epilogue; at most two flushes are in flight, as in stock.

[Note: fixed gradient layout] Which parameters get a gradient may differ by rank and by micro-step (a head per
task, LayerDrop, a tower skipped on a text-only batch, an expert no token reached): DDP's update is then each
rank's local gradient, a missing one as zeros, averaged, and every rank must still issue the same
reduce-scatters. Buckets filled in arrival order (stock's, and z3ext's before) carry no identity: a rank
whose head `a` got a gradient and one whose head `b` did reduce-scatter the two together (the same sizes: a
silently wrong update; other sizes: gloo's "Received data size doesn't match"). So every trainable parameter has
a fixed place: the layout (`_make_layout`) cuts the trainable parameters, in one order, into buckets of at most
`reduce_bucket_size` elements within one process group, the same on every rank (made again when the trainable
set changes). A backward pass reduces the buckets strictly in that order, each once: a bucket is reduced when
every one of its parameters either delivered its gradient or cannot deliver one in this backward, and at the
pass's end every bucket left is reduced with zeros in place of what did not come. Each rank so issues the same
collectives with the same sizes whatever its backward reached, and each element is the sum of the ranks' local
gradients (zeros where absent): DDP's numbers, bitwise those of stock with an unused part touched times 0.0
(tests/test_asymmetric_grads.py), and stock's wherever every rank gets every gradient.
  What cannot come is read from the autograd graph at the pass's first gradient (`unreached_in_backward`,
csrc/backward_count.h): a parameter whose AccumulateGrad is not in the running graph task. That is exact
unless a node of the graph runs a backward of its own (a reentrant checkpoint, whose parameters join only when
it runs: predicted from what ran, [Note: presence behind a reentrant checkpoint]) or the pass began inside such
a nested backward: such a pass judges nothing unreachable, reduces complete buckets as they fill, and the rest
after the backward (DeepSpeed's epilogue from `engine.backward`, outside any graph task; else the next forward
or the step); so does a predicted one. A gradient that arrives for a parameter already
reduced as unreachable raises `GradientError` naming it, never a silent zero. A z3 leaf module's hook notes
the gradients it has; its experts without one are zeros of the layout (stock makes the same zeros itself).
A leaf whose inputs need no gradient has its hook called with its outputs' gradients, before its own
backward (torch's full backward hook): its parameters' gradients come after it and no hook notes them (stock
reduces zeros for them and drops them, silently). Where the pass's end reduces a bucket, a parameter never
noted but holding a gradient of its full size is reduced with that gradient.
  Order: ds_id descending at first (modules are usually built in forward order, so gradients come roughly in
that order), and from the first optimizer step on the order in which the gradients came (each parameter at
its earliest position on any rank, the ranks' positions exchanged once with one all-gather; never-seen ones
last), so that a bucket seldom waits for a gradient that comes late: only memory depends on the order (a
waiting bucket keeps later full gradients alive), never the numbers.

[Note: flush slices] A flush lays its bucket out, reduce-scatters and writes it in slices of at most
a quarter of `reduce_bucket_size` elements (consecutive parameters in ds_id order, a larger one alone),
and frees each slice's gradients once written: the layout buffer, which a flush adds on top of the
bucket's gradients at the moment backward holds the most activations, is a quarter of the bucket
(GPT 6.7B, simulated world 8: the peak sat in the first flush, 923 MiB of layout over 1 GiB of
gradients). Each element meets the same operands in the same ops as in one collective over the
bucket, so the partitions are the same bits; it costs three more collectives per full bucket. A
gradient of at least an eighth of a slice whose numel is a multiple of the world is a slice of its own
and needs no layout ([Note: direct slices] in csrc/reduce.h): on the device a pass over most of the
gradient bytes less (GPT 6.7B: every weight matrix), for collectives of 16M elements or more.

[Note: failed pass] A backward pass that raises (out of memory in a re-fill, a flush or any op of
autograd's) never reaches DeepSpeed's epilogue: its gradients noted and not yet reduced stay in `.grad`
and in the bucket, where the next backward would accumulate into them. The first gradient a pass notes
queues an autograd-engine callback, which runs only when that graph task completes (not when it raises);
a flush that raises in the epilogue marks the pass again. At the next outermost forward (coordinator
`reset_step`) a pass that noted gradients and never completed is abandoned: those gradients are dropped,
so the micro-batch that failed contributes nothing it had not already written. What a flush had written
at the window's first micro-step is overwritten by the next backward (stock's `micro_step_id` does not
advance without an epilogue: copy semantics again); what it had added at a later micro-step cannot be
taken out of the partitions and stays (a warning says how many and that `engine.zero_grad()` restarts
the window). A flush that raises puts its unwritten gradients back into the bucket first
([Note: out of memory] in csrc/oom.h).

[Note: gradient partitions between steps] Stock keeps the optimizer's gradient partitions
(`grad_partitions_flat_buffer`, this rank's share of every gradient in the gradient dtype) allocated for
the engine's life and writes each window's first reduction over them (`micro_step_id == 0`: a copy), so a
trainable parameter that gets no gradient in a window (frozen mid-training, an expert no token reached, a
branch skipped) steps on the partition an earlier window left, and one that first gets a gradient at a
later micro-step adds it to that old partition: stale gradients, silently. With `z3ext.free_grad_partitions`
(the default) such a parameter steps on zeros, as in ZeRO stage 1/2 (which zero-fill a missing gradient;
stage 0 with a torch optimizer skips the parameter, which a flat partition cannot): on z3ext's gradient
path the buffer's storage is resized to 0 bytes after each step (`_post_step`, or the clean-up of a step an fp16
overflow skipped) and re-allocated, zeroed, by
the window's first flush (or by the next step's start if no flush came), so between steps (evaluation,
generation, a reference model's forward) the memory is the program's; where DeepSpeed reduces (offload,
qgZ, `reduce_gradients: false`) its partitions, and the CPU optimizer's gradients with `offload_optimizer`,
are zeroed after the step instead (sub-groups swapped to NVMe keep stock's behaviour, logged), and so
are they under DeepCompile, whose own ops write them. The views
DeepSpeed keeps of the buffer stay valid, as a released parameter's do ([Note: true release] in
csrc/engine.h); a gradient accessor between steps (`safe_get_full_grad` and the like) and DeepSpeed's
`offload_states` re-allocate it first. The numbers are stock's whenever every trainable parameter gets a
gradient in each window. On CUDA the buffer is freed on the compute stream after the step, when stock's
epilogue has synchronised the reduce stream that wrote it. `false` restores stock's kept partitions.

[Note: partitions as they reduce] Re-allocating the whole buffer at a window's first flush would put every
gradient partition in memory at the start of backward, where activations peak (1.6 GB at GPT 6.7B,
simulated world 8). So while the buffer is freed, a flush writes its parameters' partitions into a
tensor of their own, zeroed, allocated on the compute stream as the flush starts ("pieces"; DeepSpeed's
ds_id -> partition map points at them, and its epilogue lists them), and later flushes of the window
accumulate there. The buffer comes back whole (`consolidate`: re-allocated, zeroed, the pieces copied
into their places in one multi-tensor copy, the map and the step's partition lists pointed back at it,
the pieces' storages freed; their views serve the next window's flush of the same parameters) before
anything reads it: the step's start (`_pre_step`, after the epilogue has
synchronised the reduce stream), a gradient accessor, `offload_states`. The values are the ones the
buffer would hold (a fresh piece starts at zeros, as the re-allocated buffer did). Cost: one copy of
the partitions per step, and both at once for that copy (no activations are alive then).

[Note: step gradient view] Stock's step hands the optimizer `flatten(averaged_gradients)`: a copy of
every gradient partition into a new flat tensor, as large as this rank's fp32 master weights (3.6 GB at
0.94B parameters on one rank), allocated at each step. The partitions are consecutive views of one
flat buffer (`grad_partitions_flat_buffer`, in sub-group order), so z3ext hands the optimizer a view
of that buffer instead: the same values, no copy. The view is given only when the step's unscale
(`unscale_and_clip_grads`: `grad.mul_(1 / combined_scale)`) multiplies by exactly 1 (no loss scale,
and clipping configured off or not triggered: z3ext evaluates stock's clip coefficient from the
norm the step stashed), and a scaled copy otherwise ([Note: fused unscale]): that in-place multiply
would change the buffer itself, which holds what stock reuses for a parameter that gets no gradient
in the next window (an optimizer that edits `.grad` in place would edit it too; torch's Adam, AdamW
and SGD do not). An unscale that
multiplies by exactly 1 is not run at all (it would rewrite every gradient element with itself). A
buffer of another dtype than the master weights (bf16 gradient accumulation) is converted in one copy
(stock: a flat copy, then its conversion). With Muon, or partitions that are not consecutive views (a
parameter without requires_grad), DeepSpeed's copy runs.

[Note: fused unscale] When the unscale does multiply (clipping triggered, a loss scale), stock makes
the step's gradient in two passes over it: the copy (and conversion to the master dtype), then the
in-place multiply; z3ext makes it in one, `torch.mul(view, factor)` into a new tensor of the master
dtype, and the step's unscale is not run again. `factor` is stock's `1 / combined_scale` computed by
stock's expressions from the norm the step stashed (`_global_grad_norm` is the step's `norm /
loss_scale`, the same op on the same operands as the unscale's), rounded to the master dtype as the
in-place multiply rounds its scalar operand; the gradient's conversion to that dtype is exact (bf16 or
fp16 to fp32), so each element is the one product stock computes, rounded once: the same bits. At GPT
6.7B, simulated world 8, that is one pass of 838M fp32 elements less per step.

[Note: step view validity] Which partitions a sub-group's step reads is decided by stock's epilogue at
every backward: `averaged_gradients[i]` lists each parameter's gradient partition (a view of the buffer)
when it requires grad, and a fresh `zeros_like` when it does not. Freezing a parameter mid-training
(`requires_grad_(False)`) therefore turns its entry into zeros from that step on, while the buffer still
holds the last gradient it had: a view decided once and cached would apply that stale gradient at every
later step. The run is recomputed whenever the list's entries are not the very tensors it was computed
from (an identity check, no per-parameter arithmetic), so a frozen parameter breaks the run and the step
takes stock's copy with stock's zeros; unfreezing restores the partitions and the view.

DeepSpeed's path is kept, logged once with the reason, for optimizer offload (its partitions
live in host or NVMe buffers written at the accumulation boundary), ZeRO++ qgZ, `reduce_scatter:
false`, AutoEP/AutoTP folding, an optimizer with parameters of no z3ext engine, and
`z3ext.reduce_gradients: false`.
"""
import collections
import contextlib
import operator
import sys
import threading
import time
import weakref
from typing import List, NamedTuple, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist, logger

from deepspeed_z3ext import comms, deepspeed_private as private
from deepspeed_z3ext._ops import ops
from deepspeed_z3ext.errors import GradientError
from deepspeed_z3ext.state import group_of, of_optimizer, of_param

_MAX_IN_FLIGHT = 2  # stock's max_param_reduce_events
_SLICES = 4  # a flush reduce-scatters its bucket in this many slices at least ([Note: flush slices])
_graph_task = torch._C._current_graph_task_id  # read once per gradient (note)
_DIRECT = 8  # a gradient of an eighth of a slice or more, even over the ranks, is reduced alone ([Note: direct slices])


class GradReduceStats(NamedTuple):
    flushes: int          # buckets reduced (one reduce-scatter each on more than one rank)
    reduced_params: int   # gradients written into this rank's partitions (a parameter once per flush)
    accumulating_flushes: int  # flushes that added to the partitions (gradient accumulation)
    host_seconds: float   # host time spent in flushes (on CUDA: launching them)
    step_views: int       # optimizer sub-group steps given the gradient buffer (a view, or converted), not its flattened copy
    unscales_skipped: int  # sub-group unscales that would have multiplied by exactly 1, not run
    bucket_elements: int  # elements noted and not yet reduced
    fast_norms: int       # steps whose gradient norm was one multi-tensor pass per sub-group ([Note: gradient norm])
    reduce_scatters: int  # collectives issued: a flush issues one per slice ([Note: flush slices])
    abandoned_passes: int  # backward passes that raised: their unreduced gradients dropped ([Note: failed pass])
    partitions_freed: int  # steps after which the gradient partitions were freed ([Note: gradient partitions between steps])
    unscales_fused: int   # sub-group unscales done in the step gradient's copy ([Note: fused unscale])
    direct_reduce_scatters: int  # of reduce_scatters, those of one gradient without a layout ([Note: direct slices])
    divided_after_reduce: int   # of reduce_scatters, those whose shard was divided after it ([Note: divide after the reduce])
    partition_writes: int  # tensors written into the partitions: consecutive ones as one run ([Note: partition runs] in csrc/reduce.h)
    partition_pieces: int  # partitions allocated by a flush while the buffer was freed ([Note: partitions as they reduce])
    unreached: int        # gradients reduced as zeros: parameters a backward of this rank did not reach ([Note: fixed gradient layout])
    deferred_ends: int    # passes whose last buckets were reduced after the backward (reentrant checkpoints)
    arrival_ordered: bool  # the buckets follow the ranks' agreed arrival order (from the first step on)


def stock_path_reason(optimizer, state) -> Optional[str]:
    """Why this engine's gradients stay on DeepSpeed's path, or None when z3ext reduces them."""
    if not state.config.reduce_gradients:
        return "z3ext.reduce_gradients is false"
    if getattr(optimizer, "offload_optimizer", False):
        return "zero_optimization.offload_optimizer (partitions are written to host/NVMe at the boundary)"
    if getattr(optimizer, "all2all_process_group", None) is not None:
        return "zero_optimization.zero_quantized_gradients (ZeRO++ qgZ)"
    if not getattr(optimizer, "reduce_scatter", True):
        return "zero_optimization.reduce_scatter is false (all-reduce path)"
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:
        return "AutoEP with AutoTP folding"
    if any(not state.owns(p) for group in optimizer.fp16_groups for p in group):
        return "the optimizer holds parameters of no z3ext engine"
    return None


class GradLayout(NamedTuple):
    """Every trainable parameter's place in the reduce-scatters ([Note: fixed gradient layout])."""
    buckets: tuple   # lists of parameters, each in ds_id order (the collective's layout); buckets in flush order
    bucket_of: dict  # ds_id -> index into `buckets`
    params: list     # the parameters, flush order
    key: tuple       # the trainable ds_ids it was made for, in the optimizer's order


class GradPass:
    """One backward pass's progress through the layout: which gradients arrived, which cannot come."""

    __slots__ = ("waiting", "next", "arrived", "unreached", "exact", "accumulate", "reduced", "deferred", "walked",
                 "again")

    def __init__(self, layout, accumulate):
        self.waiting = [len(b) for b in layout.buckets]  # parameters of each bucket neither arrived nor unreached
        self.next = 0            # the first bucket not reduced yet: buckets are reduced in order
        self.arrived = set()     # ds_ids whose gradient was noted
        self.unreached = set()   # ds_ids this backward cannot reach (exact passes only)
        self.exact = False       # the pass ends at DeepSpeed's epilogue ([Note: fixed gradient layout])
        self.accumulate = accumulate  # stock's `micro_step_id != 0` when the pass began
        self.reduced = [False] * len(layout.buckets)
        self.deferred = frozenset()  # buckets some rank's backward cannot complete: reduced at the pass's end
        self.walked = False      # the pass walks re-gathered modules: it ends at the walk's end ([Note: presence agreed])
        self.again = None        # ds_ids whose gradient may come twice, where the pass predicted the unreached ones
                                 # ([Note: presence behind a reentrant checkpoint])


# [Note: shared zeros] A flush reduces zeros for each gradient that did not come (an expert no token reached, a
# head another rank used: [Note: fixed gradient layout]). The zeros are only read, copied into the slice's layout,
# so they are views of one zeroed buffer per dtype and device, as long as the longest: a mixture-of-experts
# backward at simulated world 8 made 512 zero tensors of its own per pass (5.7M of its 130M host instructions on
# the CPU VM; on a GPU, as many allocations and fill kernels). A slice of one parameter is reduce-scattered from the
# gradient itself ([Note: direct slices] in csrc/reduce.h), which the collective gets as its input: such a missing
# gradient gets zeros of its own.
def _zeros_for(params):
    """ds_id -> the zeros that stand for each parameter's missing gradient in a flush ([Note: shared zeros])."""
    longest = {}
    for p in params:
        key = (p.dtype, p.ds_tensor.device)
        longest[key] = max(longest.get(key, 0), p.ds_numel)
    buffers = {key: torch.zeros(numel, dtype=key[0], device=key[1]) for key, numel in longest.items()}
    return {p.ds_id: buffers[(p.dtype, p.ds_tensor.device)][:p.ds_numel] for p in params}


def _nested_backward() -> bool:
    """Whether this code runs inside a backward that another backward's node started (a reentrant
    checkpoint's recomputation): the autograd engine calls Python hooks with the caller's frames above."""
    runs, frame = 0, sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_engine_run_backward":
            runs += 1
        frame = frame.f_back
    # An accelerator's autograd worker thread starts with no Python frame above its first hook.
    worker = isinstance(threading.current_thread(), threading._DummyThread)
    return runs >= (1 if worker else 2)


class GradReducer:
    """One engine's gradient path ([Note: gradient path]); created at the engine's first gradient."""

    def __init__(self, optimizer, state):
        self._optimizer = weakref.ref(optimizer)
        self.layout: Optional[GradLayout] = None  # [Note: fixed gradient layout]
        self._pass: Optional[GradPass] = None
        self._arrival = {}  # ds_id -> position in this rank's first pass on a layout not yet ordered by arrivals
        self._ordered = False  # the layout follows the ranks' agreed arrival order
        # (graph task, buckets deferred to its end, unreached, exact, may come twice, walked) ([Note: presence agreed]),
        # until the pass begins; the graph task of the last vote
        self._agreed = None
        self._voted = None
        self._unreached = None  # (graph task, layout, exact, what it cannot reach) read at the backward's start
        self._trainable_of = (None, {})  # (layout key, id(unit) -> (unit, its trainable ds_ids)) (agree_presence)
        self._agreement = state.agreement
        self._n_unreached = 0
        self._n_deferred = 0
        self.bucket_size = optimizer.reduce_bucket_size
        self.slice_numel = max(1, self.bucket_size // _SLICES)  # [Note: flush slices]
        self.comm_dtype = optimizer.communication_data_type
        self._events = collections.deque()
        self._on_device = not get_accelerator().is_synchronized_device()
        self._n_flushes = 0
        self._n_reduced = 0
        self._n_accumulating = 0
        self._host_s = 0.0
        self._n_views = 0
        self._n_unscales_skipped = 0
        self._n_fused = 0
        self._fused_sub_group = None  # the sub-group whose step gradient the unscale already scaled ([Note: fused unscale])
        self._n_norms = 0
        self._n_reduce_scatters = 0
        self._bucket_flushes = {}  # id(bucket) -> _BucketFlush: what its flushes share, made once
        self._n_direct = 0
        self._n_divided = 0
        self._n_writes = 0
        self._faults = state.engine  # its schedule log counts this rank's faults
        self._divide_after = state.config.divide_after_reduce  # [Note: divide after the reduce] in csrc/reduce.h
        self._n_abandoned = 0
        self._pass_open = False  # a backward pass noted gradients and has not completed ([Note: failed pass])
        self._pass_task = None  # its autograd graph task
        self._pass_accumulated = 0  # partitions it added to (gradient accumulation)
        self._free_partitions = state.config.free_grad_partitions  # [Note: gradient partitions between steps]
        self._state = weakref.ref(state)
        self._freed = None  # (the buffer's data_ptr, its bytes) while freed
        self._in_pieces = {}  # ds_id -> its view of the buffer, while its partition is in a piece ([Note: partitions as they reduce])
        self._window_pieces = {}  # ds_ids of a flush -> (piece, its views), this window's
        self._piece_cache = {}    # the same, the window before's, their storages freed
        self._n_pieces = 0
        self._n_freed = 0
        self.norm_group = None  # (process group or None,) once norm.py checked this engine's groups
        self._runs = {}  # (buffer data_ptr, sub-group) -> (its partitions at that step, (offset, numel) or None)
        self.step_copy_reason = None  # why the last step that could not use the buffer copied (diagnostics)
        # The stock bucket buffers are unused from now on: an empty tensor keeps offload_states working.
        for bucket in optimizer.ipg_buckets.values():
            if bucket.buffer is not None:
                bucket.buffer = bucket.buffer.new_empty(0)

    def stats(self) -> GradReduceStats:
        return GradReduceStats(self._n_flushes, self._n_reduced, self._n_accumulating, self._host_s,
                               self._n_views, self._n_unscales_skipped, self._pending_elements(), self._n_norms,
                               self._n_reduce_scatters, self._n_abandoned, self._n_freed, self._n_fused,
                               self._n_direct, self._n_divided, self._n_writes, self._n_pieces, self._n_unreached,
                               self._n_deferred, self._ordered)

    def count_norm(self):
        """norm.py computed this step's gradient norm."""
        self._n_norms += 1

    def note(self, param):
        """`reduce_independent_p_g_buckets_and_remove_grads`: `param`'s gradient is in; the buckets whose
        gradients are all in (or unreachable) are reduced, in the layout's order ([Note: fixed gradient layout])."""
        task = _graph_task()
        gpass = self._pass
        if gpass is None or (task != self._pass_task and task != -1):
            gpass = self.start_pass(task)
        ds_id = param.ds_id
        arrived = gpass.arrived
        if ds_id in arrived:
            # Noted already in this pass: a backward that raised part-way left it (its epilogue never ran) and a
            # retry's backward accumulated into the same `.grad`, as autograd does without ZeRO (or its hook fired
            # twice: a weight shared by two reentrant-checkpointed segments). Its bucket is not reduced yet (it
            # holds that tensor): the sum is reduced once.
            if not gpass.reduced[self.layout.bucket_of[ds_id]]:
                return
        if not getattr(param, "ds_grad_is_ready", True):
            return  # a transient gradient of a tiled computation: stock skips it too
        grad = param.grad
        if grad is None or grad.numel() != param.ds_numel:
            raise GradientError(f"z3ext: cannot reduce-scatter the gradient of parameter ds_id {ds_id} "
                             f"(shape {tuple(param.ds_shape)}): it has "
                             f"{'no gradient' if grad is None else f'{grad.numel()} elements, not {param.ds_numel}'}")
        index = self.layout.bucket_of.get(ds_id)
        if index is None:
            raise GradientError(f"z3ext: parameter ds_id {ds_id} (shape {tuple(param.ds_shape)}) got a gradient but "
                                "was not trainable when this backward began (requires_grad set during backward?)")
        if gpass.reduced[index] or ds_id in arrived or ds_id in gpass.unreached:
            raise GradientError(
                f"z3ext: parameter ds_id {ds_id} (shape {tuple(param.ds_shape)}) got its gradient after its bucket was "
                "reduced in this backward (as a gradient this backward could not reach): a node ran a backward of its "
                "own that z3ext did not recognise as a reentrant checkpoint, or a reentrant checkpoint's segment used a "
                "parameter of a module that did not run in it ([Note: fixed gradient layout], [Note: presence behind a "
                "reentrant checkpoint] in deepspeed_z3ext/grads.py)")
        arrived.add(ds_id)
        arrival = self._arrival
        if arrival is not None and ds_id not in arrival:
            arrival[ds_id] = len(arrival)
        waiting = gpass.waiting
        left = waiting[index] - 1
        waiting[index] = left
        if not left and index >= gpass.next and index not in gpass.deferred:
            self._advance(gpass)

    def start_pass(self, task) -> GradPass:
        """The backward pass of graph task `task` (-1: none) noted its first gradient, or a z3 leaf's hook ran before
        any of its parameters' gradients ([Note: a leaf's gradients after its hook] in grad_hooks.py): its pass."""
        if task != self._pass_task and task != -1:  # the first of this pass ([Note: failed pass])
            self._pass_task, self._pass_open = task, True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._pass_done(task))
        gpass = self._pass
        return gpass if gpass is not None else self._begin(task)

    def _begin(self, task) -> GradPass:
        """The first gradient of a backward pass: the layout (re-made when the trainable parameters changed),
        and which of them this backward cannot reach ([Note: fixed gradient layout])."""
        optimizer = self._optimizer()
        agreed = self._agreed
        if agreed is not None and agreed[0] != task and not (agreed[5] is False and _nested_backward()):
            agreed = None  # (a reentrant segment's backward inside the pass the ranks voted on at its start: theirs)
        self._agreed = None
        cached, self._unreached = self._unreached, None
        if agreed is None and cached is not None and (cached[0] != task or cached[1] is not self.layout):
            cached = None
        layout = self.layout
        if agreed is None and cached is None:  # (a walked pass, or agree_reentrant, made the layout for this task)
            key = _trainable_key(optimizer)
            if layout is None or layout.key != key:
                layout = self.layout = _make_layout(optimizer, key, self.bucket_size, None)
                self._ordered, self._arrival = False, {}
        gpass = self._pass = GradPass(layout, optimizer.micro_step_id != 0)
        if agreed is not None:
            gpass.deferred, gone, gpass.exact, gpass.again, gpass.walked = agreed[1:]
        elif cached is not None:  # read by agree_reentrant at the backward's start
            gpass.exact, gone = cached[2:]
        else:  # (a prediction without the ranks' vote would put their reductions at different places: none)
            unreached = ops().unreached_in_backward(layout.params) if task != -1 else None
            gpass.exact = unreached is not None and not unreached[1] and not _nested_backward()
            gone = self._unreachable(layout, unreached, gpass.exact)[0] if gpass.exact else ()
        if gone:
            bucket_of, waiting = layout.bucket_of, gpass.waiting
            gpass.unreached.update(gone)
            for ds_id in gone:
                waiting[bucket_of[ds_id]] -= 1
        return gpass

    # [Note: presence behind a reentrant checkpoint] A reentrant checkpoint's segment is one node of the graph until
    # its own backward runs, so the graph cannot tell at the pass's start which of the segment's parameters get a
    # gradient; a pass that reduced buckets as they filled put a reduce-scatter where another rank, whose gradients
    # differ in presence, gathers for the recomputation. The segment's first forward ran with grad mode off and its
    # recomputation runs the same modules on the same inputs: the parameters of the units this rank ran with grad
    # mode off in its training forward (plan.py `ran_without_grad`: fetched modules, group members through their
    # lifted call, declared conditional modules through a pre-hook of their own) are taken as reachable, any other
    # one outside the graph as unreachable, and the ranks vote ([Note: presence agreed]) at the backward's start (the
    # walk's start, or a pre-hook on every training forward's outputs, which votes where the graph holds a reentrant
    # checkpoint: a point every rank reaches; a pass's first gradient is not one, a rank whose first gradient comes
    # from inside a segment has gathered for its recomputation already, seed 1147): a bucket with a parameter some rank cannot reach, or with one whose
    # gradient may come twice (a unit run with grad mode off and on, or off twice: each segment's backward
    # accumulates into `.grad` again, and the sum is reduced once), is reduced at the pass's end on every rank.
    # Stock reduces such a second gradient as if it were new, off the unsharded model's numbers (tests/programs.py
    # `compare`). A z3 leaf in a segment marks its experts without a gradient at its hook (`missing_at_leaf`), which
    # runs after their gradients where the leaf's inputs need one, as a segment's do. A wrong prediction still
    # raises, named: a module run with grad mode off whose parameters get a gradient on some ranks only
    # (ScheduleMismatchError, [Note: presence in a reentrant checkpoint] in schedule.py), a parameter taken as
    # unreachable whose gradient comes (GradientError). Cost: one vote and one read of the forward's record per
    # pass whose graph holds a reentrant checkpoint; nothing for other passes.
    def _unreachable(self, layout, unreached, exact):
        """(the ds_ids of the trainable parameters this backward cannot reach, those whose gradient may come more than
        once or None): those whose gradient accumulator is not in the running graph task, where that is exact
        ([Note: fixed gradient layout]); where the graph holds a reentrant checkpoint, those of them that no unit this
        rank ran with grad mode off holds ([Note: presence behind a reentrant checkpoint]); none where neither can
        tell."""
        if unreached is None:
            return set(), None
        params = layout.params
        if exact:
            return {params[i].ds_id for i in unreached[0]}, None
        state = self._state()
        if not unreached[1] or state is None or state.coordinator is None:
            return set(), None
        hidden = state.coordinator.hidden_runs()
        if hidden is None:  # any parameter may be hidden: the vote all the same, each rank alike
            return set(), set()
        outside = {params[i].ds_id for i in unreached[0]}
        gone = {ds_id for ds_id in outside if ds_id not in hidden}
        again = {ds_id for ds_id, runs in hidden.items() if runs > 1 or ds_id not in outside}
        return gone, again

    def _vote(self, layout, gone, again, units):
        """[Note: presence agreed]: the buckets some rank cannot complete as its gradients come (a parameter in `gone`
        or in `again` on that rank), and for each of `units` (each a unit's trainable ds_ids) whether no rank's
        backward reaches any of them."""
        bucket_of = layout.bucket_of
        full = [True] * len(layout.buckets)
        for ds_id in (*gone, *(again or ())):
            index = bucket_of.get(ds_id)
            if index is not None:
                full[index] = False
        flags = full + [bool(ids) and all(i in gone for i in ids) for ids in units]
        if self._agreement.world > 1:
            flags = self._agreement.all_true(flags, kind=10)
        n = len(full)
        return frozenset(i for i, f in enumerate(flags[:n]) if not f), flags[n:]

    def missing_at_leaf(self, params):
        """A z3 leaf's hook ran after its parameters' gradients (its inputs need one): in a pass that predicted what it
        cannot reach, those of them without a gradient are unreached ([Note: presence behind a reentrant
        checkpoint]): the experts no token of this rank reached inside a reentrant segment."""
        gpass = self._pass
        if gpass is None or gpass.again is None:
            return
        bucket_of, waiting, advance = self.layout.bucket_of, gpass.waiting, False
        for p in params:
            ds_id = p.ds_id
            index = bucket_of.get(ds_id)
            if index is None or p.grad is not None or ds_id in gpass.arrived or ds_id in gpass.unreached or \
                    ds_id in gpass.again or gpass.reduced[index]:
                continue
            gpass.unreached.add(ds_id)
            waiting[index] -= 1
            advance = advance or (not waiting[index] and index >= gpass.next and index not in gpass.deferred)
        if advance:
            self._advance(gpass)

    def _advance(self, gpass, finish=False):
        """Reduces the buckets from the first unreduced one on while each is complete, passing over those
        deferred to the pass's end (every bucket left when `finish`, in order: gradients not in by now are
        zeros)."""
        buckets, deferred = self.layout.buckets, gpass.deferred
        while gpass.next < len(buckets) and (finish or gpass.next in deferred or not gpass.waiting[gpass.next]):
            index = gpass.next
            gpass.next += 1
            if index not in deferred or finish:
                if gpass.walked and not finish:
                    self._walk_above(buckets[index])
                gpass.reduced[index] = True
                self._flush(buckets[index], gpass)
        if finish:
            for index in sorted(deferred):
                if not gpass.reduced[index]:
                    gpass.reduced[index] = True
                    self._flush(buckets[index], gpass)

    def agree_reentrant(self):
        """The backward's start, on every rank (a hook on a training forward's outputs): where the graph holds a
        reentrant checkpoint, the ranks vote on what each can reach ([Note: presence behind a reentrant checkpoint])
        for a pass that walks nothing."""
        if self._voted == torch._C._current_graph_task_id() or self._pass is not None:
            return  # voted already (the walk's start, another output), or the pass began
        self.agree_presence(walked=False)

    def agree_presence(self, modules=(), unit_for=None, walked=True) -> List[bool]:
        """[Note: presence agreed] A backward that gathers modules again ([Note: backward walk] in window.py)
        issues the same gathers on every rank, but a bucket is reduced once its gradients are in, and which
        come differs by rank where the ranks' backwards reach different parameters: the reduce-scatter would sit
        between other gathers on each rank, and one group's collectives must come in one order. So at the
        walk's start, before the pass's first gather, the ranks vote (one tiny vote, over the host on NCCL) on
        which buckets each can complete ([Note: fixed gradient layout]); a bucket holding a parameter that some
        rank's backward cannot reach is reduced at the pass's end on every rank, in the layout's order, after
        the walk's last gathers; the others as before, complete on every rank at the same step of the walk. A
        pass that gathers nothing in backward (every unit held) needs no vote. The same vote says which of
        `modules` (the walk's, in order; `unit_for(module)` their units) no rank's backward needs: those with trainable parameters of which no
        rank's backward reaches any, which the walk then passes over (a branch whose output the loss never
        used); the result."""
        optimizer = self._optimizer()
        key = _trainable_key(optimizer)
        if self.layout is None or self.layout.key != key:
            self.layout = _make_layout(optimizer, key, self.bucket_size, None)
            self._ordered, self._arrival = False, {}
        layout = self.layout
        unreached = ops().unreached_in_backward(layout.params)
        exact = unreached is not None and not unreached[1] and not _nested_backward()
        gone, again = self._unreachable(layout, unreached, exact)
        if not walked and again is None:  # no reentrant checkpoint: the pass's first gradient takes what this read
            self._unreached = (torch._C._current_graph_task_id(), layout, exact, gone if exact else ())
            return []
        units = []
        if gone:
            if self._trainable_of[0] != layout.key:
                self._trainable_of = (layout.key, {})
            cache, bucket_of = self._trainable_of[1], layout.bucket_of
            for module in modules:
                unit = unit_for(module)
                hit = cache.get(id(unit))
                if hit is None or hit[0] is not unit:
                    hit = cache[id(unit)] = (unit, [h.ds_id for h in unit.handles if h.ds_id in bucket_of])
                units.append(hit[1])
        else:
            units = [()] * len(modules)
        deferred, unneeded = self._vote(layout, gone, again, units)
        self._voted = torch._C._current_graph_task_id()
        self._agreed = (self._voted, deferred, gone, exact, again, walked)
        return unneeded

    def _walk_above(self, params):
        """[Note: reductions on the walk] in window.py: the walk passes what lies above the bucket's modules first."""
        state = self._state()
        coordinator = state.coordinator if state is not None else None
        if coordinator is not None:
            coordinator.walk_above(params)

    def finish_walk(self):
        """The backward walk passed every position ([Note: presence agreed]): the pass's buckets left are reduced."""
        gpass = self._pass
        if gpass is not None and gpass.walked:
            self._finish(gpass)

    def end_pass_at_epilogue(self):
        """DeepSpeed's epilogue: where every gradient of this pass is in, its remaining buckets are reduced, zeros
        for what did not come: in an exact pass, and after the backward returned (the engine's own call of the
        epilogue, outside any graph task) in any pass."""
        gpass = self._pass
        task = torch._C._current_graph_task_id()
        if gpass is not None and (gpass.exact or task == -1) and not (gpass.walked and task != -1):
            self._finish(gpass)

    def end_backward(self):
        """After a backward, the next forward, or at the step: a pass still open (reentrant checkpoints) is
        finished ([Note: fixed gradient layout])."""
        gpass = self._pass
        if gpass is None or self._pass_open:
            return
        self._n_deferred += 1
        self._finish(gpass)
        if self._on_device:  # stock's epilogue synchronised the reduce stream before these flushes
            self._optimizer().reduce_and_partition_stream.synchronize()

    def _finish(self, gpass):
        self._advance(gpass, finish=True)
        self._pass = None

    def _pending_elements(self) -> int:
        gpass, layout = self._pass, self.layout
        if gpass is None:
            return 0
        return sum(p.ds_numel for i, b in enumerate(layout.buckets) if not gpass.reduced[i] for p in b
                   if p.ds_id in gpass.arrived)

    @torch.no_grad()
    def _flush(self, params, gpass):
        """Reduce-scatters one bucket into the optimizer's gradient partitions, zeros for a parameter whose
        gradient did not come, and releases the gradients."""
        t0 = time.perf_counter()
        optimizer = self._optimizer()
        partitions = private.grad_partitions(optimizer)
        if self._freed is not None:  # on the compute stream, before the reduce stream waits for it
            self._add_pieces(partitions, params)  # [Note: partitions as they reduce]
        arrived = gpass.arrived
        missing = []
        for p in params:
            if p.ds_id not in arrived:
                grad = p.grad  # (a gradient no hook noted: [Note: fixed gradient layout], a leaf's inputs)
                if grad is None or grad.numel() != p.ds_numel or not getattr(p, "ds_grad_is_ready", True):
                    missing.append(p)
        zeros = _zeros_for(missing)
        self._n_unreached += len(zeros)
        group = group_of(params[0])
        world = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        shared = self._bucket_flush(params, world, optimizer)
        averaging = shared.averaging
        scale = world / float(averaging) if averaging != world else 0.0
        accumulate = gpass.accumulate
        reduce_scatter = ops().reduce_scatter_grads
        divides = self._divide_after and comms.divides_after_reduce(world, self.comm_dtype)
        collective = comms.reduce_scatter_fn(group)
        state = self._state()
        note = digests = None
        if state is not None and world > 1:
            collective = _recorded(collective, state.agreement, group)
            note = state.engine.note_reduce_scatter  # [Note: schedule fingerprint] in csrc/schedule.h
            digests = shared.digests
        reduced = 0
        if self._on_device:
            stream = optimizer.reduce_and_partition_stream
            while self._events and self._events[0].query():
                self._events.popleft()
            if len(self._events) >= _MAX_IN_FLIGHT:
                self._events.popleft().synchronize()
            stream.wait_stream(get_accelerator().current_stream())
        with get_accelerator().stream(stream) if self._on_device else contextlib.nullcontext():
            for i, part in enumerate(shared.slices):  # [Note: flush slices]
                grads = [zeros[p.ds_id] if p.ds_id in zeros else p.grad for p in part]
                if len(part) == 1 and part[0].ds_id in zeros:  # [Note: shared zeros]: a slice by itself
                    grads = [torch.zeros_like(grads[0])]
                dests = [partitions[p.ds_id] for p in part]
                if note is not None:
                    note(*digests[i])
                try:
                    n, laid_out, writes = reduce_scatter(collective, grads, dests, rank, world, self.comm_dtype,
                                                         scale, accumulate, divides)
                except BaseException:
                    self._restore(gpass, params)  # [Note: failed pass]
                    raise
                del grads
                for p in part:  # (stock also records ds_ids for optimizer offload, which keeps stock's path)
                    p.grad = None
                reduced += n
                self._n_writes += writes
                self._n_reduce_scatters += world > 1
                self._n_direct += world > 1 and laid_out == 0
                self._n_divided += world > 1 and divides
                self._pass_accumulated += n if accumulate else 0
            if self._on_device:
                event = get_accelerator().Event()
                event.record()
                self._events.append(event)
        self._n_flushes += 1
        self._n_reduced += reduced
        self._n_accumulating += accumulate
        self._host_s += time.perf_counter() - t0

    def _bucket_flush(self, bucket, world, optimizer):
        """What every flush of `bucket` (a list of the layout's) shares, made at its first: its slices, their
        reduce-scatters' digests, DeepSpeed's averaging world size for its parameters (their attributes, read once
        instead of once per parameter and flush)."""
        cached = self._bucket_flushes.get(id(bucket))
        if cached is None or cached.bucket is not bucket or cached.world != world:
            slices = list(_slices(bucket, self.slice_numel, world))
            digest = ops().reduce_scatter_digest
            cached = self._bucket_flushes[id(bucket)] = _BucketFlush(
                bucket, world, slices, [digest([(p.ds_id, p.ds_numel) for p in part]) for part in slices],
                optimizer._gradient_averaging_world_size(bucket, world))
        return cached

    def free_partitions(self):
        """The step is over ([Note: gradient partitions between steps])."""
        buffer = getattr(self._optimizer(), "grad_partitions_flat_buffer", None)
        if not self._free_partitions or self._freed is not None or buffer is None:
            return
        state = self._state()
        if state is not None and state.compiled:
            buffer.zero_()  # DeepCompile's own ops write the partitions: they stay allocated, zeroed
            return
        storage = buffer.untyped_storage()
        self._freed = (buffer.data_ptr(), storage.nbytes())
        storage.resize_(0)
        self._n_freed += 1

    def consolidate(self):
        """The gradient partitions hold memory again, zeroed where no flush of the window wrote (no-op
        unless freed) ([Note: partitions as they reduce])."""
        if self._freed is None:
            return
        old, nbytes = self._freed
        self._freed = None
        optimizer = self._optimizer()
        buffer = optimizer.grad_partitions_flat_buffer
        buffer.untyped_storage().resize_(nbytes)
        partitions = private.grad_partitions(optimizer)
        if len(self._in_pieces) < len(partitions):  # (else every element is copied from a piece)
            buffer.zero_()
        new = buffer.data_ptr()  # the step view's cache follows the buffer ([Note: step view validity])
        self._runs = {(new if ptr == old else ptr, sub): run for (ptr, sub), run in self._runs.items()}
        if self._in_pieces:
            ids = list(self._in_pieces)
            torch._foreach_copy_([self._in_pieces[i] for i in ids], [partitions[i] for i in ids])
            self._drop_pieces()

    def _drop_pieces(self):
        """DeepSpeed's map and its epilogue's lists point at the buffer again; the pieces' storages are freed
        (their views are kept for the next window's flush of the same parameters)."""
        in_pieces, self._in_pieces = self._in_pieces, {}
        used, self._window_pieces = self._window_pieces, {}
        if not in_pieces:
            return
        optimizer = self._optimizer()
        partitions = private.grad_partitions(optimizer)
        back = {id(partitions[i]): view for i, view in in_pieces.items()}
        partitions.update(in_pieces)
        for grads in optimizer.averaged_gradients.values():
            if grads:
                grads[:] = [back.get(id(g), g) for g in grads]
        for piece, _ in used.values():
            piece.untyped_storage().resize_(0)
        self._piece_cache = used  # the flushes of this window (a program's flushes repeat)

    def _add_pieces(self, partitions, params):
        """`params`' partitions that are not in a piece yet get one, zeroed, in one allocation. A flush of the
        same parameters in the window before re-fills that piece's storage and reuses its views (a flush of a
        mixture-of-experts block has a thousand: making them costs more than the rest of the flush's host work)."""
        in_pieces = self._in_pieces
        ids = tuple([p.ds_id for p in params if p.ds_id not in in_pieces])
        if not ids:
            return
        buffer_views = [partitions[i] for i in ids]
        cached = self._piece_cache.pop(ids, None)
        if cached is not None:
            piece, views = cached
            piece.untyped_storage().resize_(piece.numel() * piece.element_size())
            piece.zero_()
        else:
            sizes = [v.numel() for v in buffer_views]
            piece = torch.zeros(sum(sizes), dtype=buffer_views[0].dtype, device=buffer_views[0].device)
            views = piece.split(sizes)
        self._window_pieces[ids] = (piece, views)
        self._n_pieces += 1
        in_pieces.update(zip(ids, buffer_views))
        partitions.update(zip(ids, views))

    def _restore(self, gpass, params):
        """A flush raised: its bucket is unreduced again, and the pass is dropped at the next outermost forward
        ([Note: failed pass])."""
        index = self.layout.bucket_of[params[0].ds_id]
        gpass.reduced[index] = False
        gpass.next = min(gpass.next, index)
        self._pass_open = True  # raised in the epilogue, after the pass's own completion callback

    def _pass_done(self, task):
        """The autograd engine completed graph task `task` (a raising pass never gets here)."""
        if self._pass_task == task:
            self.end_pass()

    def end_pass(self):
        self._pass_open, self._pass_task, self._pass_accumulated = False, None, 0

    def abandon_pass(self):
        """An outermost forward starts outside backward ([Note: failed pass]): a pass that completed and left
        buckets (reentrant checkpoints) is finished, one that raised is dropped."""
        if not self._pass_open:
            self.end_backward()
            return
        optimizer = self._optimizer()
        micro_step = getattr(optimizer, "micro_step_id", None)
        walked = self._pass is not None and self._pass.walked
        self._drop_unreduced()
        self._n_abandoned += 1
        if not walked:  # (a walked pass that raised is counted by its walk, on every rank alike)
            self._faults.note_fault()  # [Note: one-rank faults] in schedule.py
        if self._pass_accumulated:
            logger.warning(f"z3ext: a backward pass raised at gradient-accumulation micro-step {micro_step} after "
                           f"adding {self._pass_accumulated} gradient partitions of its micro-batch into this window; "
                           f"they stay in the window's gradients (its other gradients were dropped). Call "
                           f"engine.zero_grad() to restart the window without them")
        self.end_pass()

    def _drop_unreduced(self):
        """The gradients of the pass's unreduced buckets are dropped, and the pass with them."""
        gpass, self._pass = self._pass, None
        if gpass is None:
            return
        for i, bucket in enumerate(self.layout.buckets):
            if gpass.reduced[i]:
                continue
            for p in bucket:
                if p.ds_id in gpass.arrived:
                    p.grad = None

    def step_gradient(self, optimizer, sub_group_id):
        """Sub-group `sub_group_id`'s gradient for the optimizer step without stock's flattening copy:
        a view of the gradient buffer, or its conversion to the master weights' dtype; None where
        DeepSpeed must flatten ([Note: step gradient view])."""
        self._fused_sub_group = None
        buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
        master = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        converted = buffer is not None and buffer.dtype != master.dtype
        if buffer is None or buffer.device != master.device or getattr(optimizer, "use_muon", False):
            self.step_copy_reason = "no gradient buffer on the master weights' device, or Muon"
            return None
        run = self._run(buffer, sub_group_id, optimizer.averaged_gradients[sub_group_id])
        if run is None or run[1] != master.numel():
            self.step_copy_reason = (f"sub-group {sub_group_id}'s partitions are not consecutive views of the buffer "
                                     f"({run}, master {master.numel()} elements)")
            return None
        self._n_views += 1
        view = buffer.narrow(0, run[0], run[1])
        factor = _unscale_factor(optimizer, master)
        if factor is not None:  # [Note: fused unscale]
            self._fused_sub_group = sub_group_id
            self._n_fused += 1
            return torch.mul(view, factor)
        return view.to(master.dtype) if converted else view

    def take_fused_unscale(self, sub_group_id) -> bool:
        """Whether this sub-group's step gradient was already unscaled ([Note: fused unscale])."""
        fused, self._fused_sub_group = self._fused_sub_group == sub_group_id, None
        return fused

    def gradient_run(self, optimizer, sub_group_id):
        """Sub-group `sub_group_id`'s gradient partitions as one view of the gradient buffer when they lie
        back to back in it (the step view's run, [Note: step view validity]); else None."""
        buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
        grads = optimizer.averaged_gradients.get(sub_group_id)
        if buffer is None or not grads:
            return None
        run = self._run(buffer, sub_group_id, grads)
        return None if run is None else buffer.narrow(0, run[0], run[1])

    def _run(self, buffer, sub_group_id, grads):
        """`_consecutive_run` of this step's partitions, recomputed whenever they are not the very tensors of
        the step it was computed for ([Note: step view validity])."""
        key = (buffer.data_ptr(), sub_group_id)
        cached = self._runs.get(key)
        if cached is not None and len(cached[0]) == len(grads) and all(map(operator.is_, cached[0], grads)):
            return cached[1]
        run = _consecutive_run(buffer, grads)
        self._runs[key] = (list(grads), run)
        return run

    def drop_stale(self):
        """The optimizer step's start: a pass that completed and left buckets is finished; gradients of a pass
        that raised are dropped, as stock clears its buckets there. The first step orders the layout by the
        ranks' arrivals ([Note: fixed gradient layout])."""
        if self._pass_open:
            self._drop_unreduced()
        else:
            self.end_backward()
        self.end_pass()
        if not self._ordered and self._pass is None:
            self._order_by_arrival()
        self.consolidate()  # a window without any flush steps on zeros

    def _order_by_arrival(self):
        """Buckets re-made once, in the order gradients arrived on the ranks (each parameter at its earliest
        position on any rank; those that came on no rank last, ds_id descending), which every rank computes
        from the same all-gathered positions. Only the order changes: what each rank reduces does not."""
        optimizer = self._optimizer()
        key = _trainable_key(optimizer)
        if self.layout is None or self.layout.key != key:  # (a rank whose backward reached no parameter)
            self.layout, self._arrival = _make_layout(optimizer, key, self.bucket_size, None), {}
        layout, arrival = self.layout, self._arrival or {}
        self._ordered, self._arrival = True, None
        params = layout.params
        late = len(params)
        mine = [arrival.get(p.ds_id, late) for p in params]
        rows = self._agreement.all_gather(mine, kind=8) if self._agreement.world > 1 else [mine]
        first = [min(col) for col in zip(*rows)]
        order = sorted(range(len(params)), key=lambda i: (first[i], -params[i].ds_id))
        self.layout = _make_layout(optimizer, layout.key, self.bucket_size, [params[i] for i in order])


def _trainable_key(optimizer) -> tuple:
    """The ds_ids of the trainable parameters, in the optimizer's order: what a layout is made for."""
    return tuple([p.ds_id for group in optimizer.fp16_groups for p in group if p.requires_grad])


def _make_layout(optimizer, key, bucket_size, order) -> GradLayout:
    """[Note: fixed gradient layout] The trainable parameters (`key`) in `order` (default: ds_id descending, a
    model's usual backward order), cut into buckets of at most `bucket_size` elements (a larger parameter
    alone) within one process group."""
    if order is None:
        trainable = set(key)
        order = sorted((p for group in optimizer.fp16_groups for p in group if p.ds_id in trainable),
                       key=lambda p: -p.ds_id)
    buckets, bucket, numel, group = [], [], 0, None
    for p in order:
        g = group_of(p)
        if bucket and (g is not group or numel + p.ds_numel > bucket_size):
            buckets.append(bucket)
            bucket, numel = [], 0
        bucket.append(p)
        numel += p.ds_numel
        group = g
    if bucket:
        buckets.append(bucket)
    buckets = tuple(sorted(b, key=lambda p: p.ds_id) for b in buckets)  # the same layout on every rank
    bucket_of = {p.ds_id: i for i, b in enumerate(buckets) for p in b}
    return GradLayout(buckets, bucket_of, [p for b in buckets for p in b], key)


class _BucketFlush(NamedTuple):
    bucket: list     # the layout's bucket (identity: a new layout makes new ones)
    world: int
    slices: list     # [Note: flush slices]
    digests: list    # (digest, first ds_id) of each slice's reduce-scatter ([Note: schedule fingerprint])
    averaging: int   # DeepSpeed's gradient averaging world size (`_gradient_averaging_world_size`)


def _slices(params, limit, world):
    """`params` (ds_id order) cut into consecutive runs of at most `limit` elements; a larger parameter, and
    one of at least `limit / _DIRECT` elements even over the ranks, alone ([Note: direct slices] in
    csrc/reduce.h)."""
    part, numel = [], 0
    direct = max(1, limit // _DIRECT)
    for p in params:
        alone = p.ds_numel >= direct and p.ds_numel % world == 0
        if part and (alone or numel + p.ds_numel > limit):
            yield part
            part, numel = [], 0
        part.append(p)
        numel += p.ds_numel
        if alone:
            yield part
            part, numel = [], 0
    if part:
        yield part


def _unscale_is_identity(optimizer) -> bool:
    """Whether stock's `unscale_and_clip_grads` will multiply by exactly 1: no loss scale, and its clip
    coefficient `clamp((norm / loss_scale + 1e-6) / clip_grad, min=1)` is 1. `_global_grad_norm` is the
    step's `norm / loss_scale`, computed by the same op on the same operands (stage3.py `step`)."""
    if float(optimizer.loss_scale) != 1.0:
        return False
    if optimizer.clip_grad <= 0.0:
        return True
    norm = getattr(optimizer, "_global_grad_norm", None)
    return norm is not None and bool((norm + 1e-6) / optimizer.clip_grad <= 1.0)


def _unscale_factor(optimizer, master) -> Optional[torch.Tensor]:
    """Stock's `1 / combined_scale` of `unscale_and_clip_grads` (stage3.py), by stock's expressions, as a
    1-element tensor of the master dtype on its device; None when it is exactly 1 ([Note: fused unscale])."""
    if _unscale_is_identity(optimizer):
        return None
    combined_scale = optimizer.loss_scale
    if optimizer.clip_grad > 0.:
        clip = ((optimizer._global_grad_norm) + 1e-6) / optimizer.clip_grad  # the unscale's total_norm / loss_scale
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * optimizer.loss_scale
    factor = 1. / combined_scale
    if torch.is_tensor(factor):
        return factor.to(device=master.device, dtype=master.dtype).reshape(1)
    return torch.tensor([factor], dtype=master.dtype, device=master.device)


def _consecutive_run(buffer, grads):
    """(offset, numel) when `grads` are contiguous views of `buffer`, back to back in order; else None."""
    if not grads:
        return None
    base = buffer.untyped_storage().data_ptr()
    start = grads[0].storage_offset() - buffer.storage_offset()
    offset = start
    for g in grads:
        if (g.untyped_storage().data_ptr() != base or not g.is_contiguous()
                or g.storage_offset() - buffer.storage_offset() != offset):
            return None
        offset += g.numel()
    return start, offset - start


def reducer_of(optimizer, param=None) -> Optional[GradReducer]:
    """The engine's GradReducer, created at its first use; None when DeepSpeed's path is kept."""
    state = of_param(param) if param is not None else of_optimizer(optimizer)
    if state is None:
        return None
    reducer = state.grad_reducer
    if reducer is None:
        reason = stock_path_reason(optimizer, state)
        if reason is not None:
            log_dist(f"z3ext: gradients reduced by DeepSpeed's stage-3 path: {reason}", ranks=[0])
            reducer = state.grad_reducer = False
        else:
            reducer = state.grad_reducer = GradReducer(optimizer, state)
    return reducer or None


def _recorded(collective, agreement, group):
    """The flush's collective recorded for the watchdog and, on gloo, after the ranks exchanged what it is
    (schedule.RankAgreement.collective)."""
    def recorded(output, input):
        agreement.collective([2, 0, -1, input.numel(), 1], lambda async_op: collective(output, input, async_op),
                             group)

    return recorded


# -- seams (seams.py): each falls through to DeepSpeed's method when z3ext does not reduce ---------
def note_gradient(stock):
    def reduce_independent_p_g_buckets_and_remove_grads(self, param):
        reducer = reducer_of(self, param)
        if reducer is None:
            return stock(self, param)
        reducer.note(param)

    return reduce_independent_p_g_buckets_and_remove_grads


def epilogue(stock):
    def independent_gradient_partition_epilogue(self):
        reducer = reducer_of(self)
        if reducer is not None:
            reducer.end_pass_at_epilogue()
        else:
            state = of_optimizer(self)
            if state is not None and state.conditional_params and not self._coalesce_grad_reduction:
                note_conditional(self, state)
        return stock(self)

    return independent_gradient_partition_epilogue


def pre_step(stock):
    def _pre_step(self):
        reducer = reducer_of(self)
        if reducer is not None:
            reducer.drop_stale()
        return stock(self)

    return _pre_step


@torch.no_grad()
def note_conditional(optimizer, state):
    """On DeepSpeed's gradient path every rank's backward ends here: each trainable parameter of the conditional
    modules is reduced, its gradient where its module ran, zeros where it did not ([Note: conditional modules] in
    conditional.py). z3ext's own path needs none of this ([Note: fixed gradient layout])."""
    for p in state.conditional_params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            # Released here (its data is DeepSpeed's empty placeholder), and autograd refuses a gradient of
            # another shape than the data: the zeros are set while they stand in as its data, which then
            # goes back to the placeholder (same storage object: z3ext's handle re-fills that one).
            zeros = torch.zeros(tuple(p.ds_shape), dtype=p.dtype, device=p.device)
            placeholder = p.data
            p.data = zeros
            p.grad = zeros
            p.data = placeholder
        optimizer.reduce_independent_p_g_buckets_and_remove_grads(p)


def post_step(stock):
    def _post_step(self, timer_names):
        stock(self, timer_names)
        _window_over(self)

    return _post_step


def overflow_clean_up(stock):
    """A step skipped for an fp16 overflow ends the window too: its partitions (inf or nan where it overflowed)
    must not reach a parameter without a gradient in the next one."""
    def _overflow_clean_up(self, prev_scale):
        stock(self, prev_scale)
        _window_over(self)

    return _overflow_clean_up


def _window_over(optimizer):
    """[Note: gradient partitions between steps]"""
    reducer = reducer_of(optimizer)
    if reducer is not None:
        reducer.free_partitions()
    else:
        zero_stock_partitions(optimizer)


@torch.no_grad()
def zero_stock_partitions(optimizer):
    """DeepSpeed reduces this z3ext engine's gradients (offload, qgZ, ...): its partitions are zeroed after
    the step, so a parameter without a gradient in the next window steps on zeros, not on this window's
    gradient ([Note: gradient partitions between steps]). Sub-groups whose optimizer state and gradients
    swap to NVMe keep stock's behaviour (warned once)."""
    state = of_optimizer(optimizer)
    if state is None or not state.config.free_grad_partitions:
        return
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if buffer is not None and buffer.numel():
        buffer.zero_()
    if not getattr(optimizer, "offload_optimizer", False):
        return
    swapped = 0
    for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat):
        if optimizer._swappable_optimizer_subgroup(i):
            swapped += 1
        elif flat.grad is not None:
            flat.grad.zero_()
    if swapped and not getattr(state, "_warned_swapped_grads", False):
        state._warned_swapped_grads = True
        log_dist(f"z3ext: {swapped} optimizer sub-group(s) swap their gradients to NVMe: a parameter without a "
                 "gradient in a window steps there on its previous window's gradient, as in stock ZeRO-3", ranks=[0])


def partitions_first(stock):
    """A gradient accessor (`safe_get_full_grad`, `safe_set_local_grad`, ...) between steps reads or writes
    zeroed partitions, not freed storage ([Note: gradient partitions between steps])."""
    def accessor(self, *args, **kwargs):
        reducer = reducer_of(self)
        if reducer is not None:
            reducer.consolidate()
        return stock(self, *args, **kwargs)

    return accessor


def prepare_step_gradient(stock):
    def _prepare_fp32_grad_for_sub_group(self, sub_group_id):
        reducer = reducer_of(self)
        view = reducer.step_gradient(self, sub_group_id) if reducer is not None else None
        if view is None:
            return stock(self, sub_group_id)
        self.fp32_partitioned_groups_flat[sub_group_id].grad = view  # [Note: step gradient view]
        self.averaged_gradients[sub_group_id] = None

    return _prepare_fp32_grad_for_sub_group


def unscale(stock):
    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        reducer = reducer_of(self)
        if reducer is not None and reducer.take_fused_unscale(sub_group_id):
            return  # done in the step gradient's copy ([Note: fused unscale])
        if reducer is not None and _unscale_is_identity(self):
            reducer._n_unscales_skipped += 1  # `grad.mul_(1.0)` changes no bit ([Note: step gradient view])
            return
        return stock(self, sub_group_id, total_norm)

    return unscale_and_clip_grads


def count_used_parameters(stock):
    """DeepSpeed's stage-3 gradient hooks count the parameters the running backward reaches: for a
    z3ext engine's parameters, in one C++ call ([Note: backward hook count] in csrc/backward_count.h)."""

    def count_used_parameters_in_backward(parameters):
        if parameters and of_param(parameters[0]) is not None:
            used = ops().count_used_in_backward(parameters)
            if used is not None:
                return used
        return stock(parameters)

    return count_used_parameters_in_backward
