// SecondaryPartition: a parameter's ZeRO++ hpZ partition within its node (`ds_secondary_tensor`).
//
// [Note: hpZ secondary partition] With `zero_hpz_partition_size` M > 1, DeepSpeed keeps beside each
// parameter's primary partition (1/world of it, gathered over the whole data-parallel group) a
// secondary one: 1/M of it, for the M ranks of the intra-node group, so that gathers after the first
// one of a step stay on the node's fabric. Stock (0.19.8, partition_parameters.py) creates it when it
// releases a gathered parameter that has none (`_partition_param_sec`: its 1/M chunk of the full
// value, the padding past ds_numel zeroed), rewrites it when a partition is written back
// (`partition(has_been_updated=True)`), drops it after each optimizer step and checkpoint load
// (`invalidate_secondary_tensor`), and gathers from it, over the intra-node group, whenever it exists
// (the coordinator's `all_gather_coalesced`; `param.all_gather()` always gathers the primary). z3ext
// does the same in its engine: a gather for a module (forward, backward, prefetch, eager fallback)
// reads the secondary partition when DeepSpeed's attribute holds one, a Direct claim (`all_gather`,
// GatheredParameters) and the re-gather of a persistent parameter after the step read the primary,
// and the release that empties a gathered storage first copies the rank's chunk out of it. The
// gathered storage is the same either way (M * (padded / M) = world * (padded / world) elements), so
// a parameter's views stay valid ([Note: true release]).
#pragma once
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace z3ext {

struct SecondaryPartition {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // the intra-node group
  int64_t rank = 0;            // this rank's place in it
  int64_t world = 0;           // its size (zero_hpz_partition_size)
  int64_t partition_numel = 0; // padded numel / world
};

// The rank's chunk of a gathered flat storage `full` (padded) as a new secondary partition on the
// device and dtype of `like` (the primary partition): its elements past `numel` are zero, as stock's.
inline at::Tensor copy_secondary_out(const SecondaryPartition& s, const at::Tensor& full, int64_t numel,
                                     const at::Tensor& like) {
  at::NoGradGuard no_grad;
  at::Tensor out = at::zeros({s.partition_numel}, like.options());
  const int64_t start = s.rank * s.partition_numel;
  const int64_t n = std::max<int64_t>(0, std::min(s.partition_numel, numel - start));
  if (n > 0) out.narrow(0, 0, n).copy_(full.narrow(0, start, n));
  return out;
}

}  // namespace z3ext
