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
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace z3ext {

struct SecondaryPartition {
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // the intra-node group
  int64_t rank = 0;            // this rank's place in it
  int64_t world = 0;           // its size (zero_hpz_partition_size)
  int64_t partition_numel = 0; // padded numel / world
};

// Copies each parameter's chunk out of its gathered flat storage into a new secondary partition.
// `fulls[i]`: parameter i's gathered storage (padded, 1-D), `numels[i]` its ds_numel, `secondaries[i]`
// its hpZ layout; the partitions are made with the options of `like` (the primary partitions' dtype
// and device), as views of one allocation, filled by one multi-tensor copy; elements past ds_numel are
// zero, as stock's. One release of a unit makes all of its parameters' secondaries in one call: a
// kernel and an allocation per parameter cost a host-bound forward more than the copy (6.7B GPT: ~400
// parameters a step).
inline std::vector<at::Tensor> copy_secondaries_out(const std::vector<at::Tensor>& fulls,
                                                    const std::vector<int64_t>& numels,
                                                    const std::vector<const SecondaryPartition*>& secondaries,
                                                    const at::TensorOptions& like) {
  at::NoGradGuard no_grad;
  std::vector<int64_t> sizes;
  sizes.reserve(secondaries.size());
  int64_t total = 0;
  for (const auto* s : secondaries) {
    sizes.push_back(s->partition_numel);
    total += s->partition_numel;
  }
  std::vector<at::Tensor> out = at::empty({total}, like).split_with_sizes(sizes);  // one call for all views
  std::vector<at::Tensor> dst, src;
  dst.reserve(out.size());
  src.reserve(out.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const SecondaryPartition& s = *secondaries[i];
    const int64_t start = s.rank * s.partition_numel;
    const int64_t n = std::max<int64_t>(0, std::min(s.partition_numel, numels[i] - start));
    if (n == 0) {
      out[i].zero_();
      continue;
    }
    if (n < s.partition_numel) {  // the tail past ds_numel
      out[i].narrow(0, n, s.partition_numel - n).zero_();
      dst.push_back(out[i].narrow(0, 0, n));
    } else {
      dst.push_back(out[i]);
    }
    src.push_back(fulls[i].narrow(0, start, n));
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  return out;
}

}  // namespace z3ext
