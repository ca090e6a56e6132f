// Residency: the hook through which the gather engine makes partitions that live out of memory
// (NVMe offload) resident around its own gathers.
// [Note: partition residency] A parameter's partition (`param.ds_tensor`) is normally in memory, and
// GatherEngine reads it directly. Under `offload_param.device: nvme` a large partition lives in its
// swap file and only a few swap buffers (`offload_param.buffer_count`) exist to read it into. The
// engine itself, not a wrapper around it, then brackets each of its gathers with calls to a Python
// object (deepspeed_z3ext.swap.PartitionResidency, installed by `engine.set_residency(obj)`):
//   parts(ds_ids) -> None | [[ds_id, ...], ...]
//       the partitioned parameters about to be gathered (claims already taken, ds_id order): None
//       when all their partitions are in memory (gathered as one, as without a hook), else the
//       parts to gather one after another, each small enough for the swap buffers. The split
//       depends only on the parameters and the config, never on I/O state, so every rank issues
//       the same collectives; claims are per parameter, so parts claim exactly what the whole would.
//   before_gather(ds_ids)  a part's partitions made resident (read in, or read-ahead finished);
//   after_gather(ds_ids)   the part's gather issued: its swap buffers back once the gather has
//                          copied out of them, the next read-ahead started;
//   before_sweep()         a step boundary: nothing may stay resident that the step does not write;
//   before_write_back(ds_ids) / after_write_back(ds_ids)
//       the gathered parameters of a unit whose full values are written into their partitions:
//       those partitions resident before, written to their files and handed back after.
// Why the engine calls it: every path that gathers (module hooks, prefetch batches, GatheredParameters,
// param.all_gather, the DeepCompile fallback, backward graphs) holds this one engine, and only the
// engine knows, after claiming, exactly which partitions it is about to read. A wrapper around it had
// to forward every other method and re-implement the prefetch batch (a transient claim to gather the
// batch in parts, then the units' claims); here the batch is the engine's own unshard_batch.
// Called from unshard and unshard_batch (both through gather_resident), sweep and write_back. Reshard, drop_* and destroy only release
// gathered buffers and never touch partitions, so they do not call it.
// Calls happen on the thread calling the engine, which holds the GIL (the engine's bindings do not
// release it; the collectives release and re-take it inside `gather`, never across a hook call).
// A hook's Python exception leaves as pybind11::error_already_set and reaches the caller as the
// same Python exception (type, message, traceback), as a pybind11 call from Python does; the engine
// is consistent at each hook call (claims taken; parts before it gathered, those after not yet), so
// retrying or releasing the claims afterwards is safe. Without a hook (no partition out of memory)
// the engine pays one null check per gather.
#pragma once
#include <pybind11/pybind11.h>
#include <utility>

namespace z3ext {
namespace py = pybind11;

struct Residency {
  py::object obj;  // the PartitionResidency; its bound methods are looked up once
  py::object parts, before_gather, after_gather, before_sweep, before_write_back, after_write_back;

  explicit Residency(py::object o)
      : parts(o.attr("parts")),
        before_gather(o.attr("before_gather")),
        after_gather(o.attr("after_gather")),
        before_sweep(o.attr("before_sweep")),
        before_write_back(o.attr("before_write_back")),
        after_write_back(o.attr("after_write_back")) {
    obj = std::move(o);
  }
};

}  // namespace z3ext
