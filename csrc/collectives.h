// Collectives as free functions over a c10d ProcessGroup (NCCL, gloo, anything c10d speaks).
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace z3ext {

// In-place all-gather: `input` is this rank's slice of `output` (world * input.numel()).
// Makes the current stream wait for the result (NCCL) or blocks until it is there (gloo).
inline void all_gather_into(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  auto work = group._allgather_base(output, input);
#pragma GCC diagnostic pop
  work->wait();
}

}  // namespace z3ext
