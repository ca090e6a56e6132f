// Collectives as free functions over a c10d ProcessGroup (NCCL, gloo, anything c10d speaks).
#pragma once
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "progress.h"

namespace z3ext {

// Waits for `work`: through `watch` (a gloo group's host wait, woken by the watchdog: [Note: collective
// progress] in progress.h) or as c10d waits (NCCL: the current stream waits, the host does not).
inline void wait_for(c10d::Work& work, Progress* watch) {
  if (watch) {
    watch->wait(work);
  } else {
    work.wait();
  }
}

// In-place all-gather: `input` is this rank's slice of `output` (world * input.numel()).
// Makes the current stream wait for the result (NCCL) or blocks until it is there (gloo).
// [Note: no GIL while blocked] The GIL is released for the collective: a backend thread that
// finishes the work may drop the last reference to a tensor or storage that has a Python object,
// which needs the GIL; holding it while waiting deadlocks (seen with gloo: one rank stuck in
// wait(), the other in the next collective).
inline void all_gather_into(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input, Progress* watch = nullptr) {
  pybind11::gil_scoped_release no_gil;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  auto work = group._allgather_base(output, input);
#pragma GCC diagnostic pop
  wait_for(*work, watch);
}

// All-gathers each `inputs[i]` into `outputs[i]` (world * inputs[i].numel()) in one coalesced call:
// one launch for the whole bucket, each parameter's blocks land contiguous in its own output, and
// the inputs may be the partitions themselves (no copy-in) or their slice of the output (in place).
// Waits as all_gather_into does, without the GIL ([Note: no GIL while blocked]).
inline void all_gather_coalesced_into(c10d::ProcessGroup& group, std::vector<at::Tensor>& outputs,
                                      std::vector<at::Tensor>& inputs, Progress* watch = nullptr) {
  pybind11::gil_scoped_release no_gil;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  auto work = group.allgather_into_tensor_coalesced(outputs, inputs);
#pragma GCC diagnostic pop
  wait_for(*work, watch);
}

// [Note: gloo on CUDA tensors] gloo moves CUDA tensors (several ranks on one GPU run this way), but
// torch's gloo `allgather_into_tensor_coalesced` on CUDA tensors crashes the process (torch 2.11 on an
// H200, two ranks on cuda:0), while its `_allgather_base` works. A group whose CUDA backend is gloo
// gathers CUDA tensors one collective per tensor: the same bytes in the same order on every rank.
// The group's backend string: "gloo", or per device ("cpu:gloo,cuda:nccl"); torch 2.11 has no per-device query.
inline bool coalesces(c10d::ProcessGroup& group, const at::Device& device) {
  if (!device.is_cuda()) return true;
  const std::string name = group.getBackendName();
  return name != "gloo" && name.find("cuda:gloo") == std::string::npos;
}

}  // namespace z3ext
