// Pre-agreement: on gloo, the ranks exchange what their next collective is before issuing it.
// [Note: agree before the collective] gloo aborts the process in C++ when two ranks issue collectives of
// different sizes ("Received data size doesn't match expected size"): no Python runs, no module is named.
// On a gloo group (the CPU and test backend, and ranks on one GPU), z3ext's every collective is preceded by
// a tiny all-gather of a fixed-size descriptor (kind, hpZ or not, first ds_id, elements, tensors); all ranks
// issue it whatever their next collective is, so it always matches, and where the descriptors differ every
// rank learns it before the mismatched call. The engine then calls its Python callback with every rank's
// descriptor, which raises the named error (schedule.py); without a callback nothing is exchanged. NCCL
// does not abort on a size mismatch (it hangs or mixes data), and an exchange before every collective
// would cost it a host synchronisation: there the schedule check at the step names the mismatch.
#pragma once
#include <array>
#include <cstdint>
#include <vector>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include "collectives.h"

namespace z3ext {

using Descriptor = std::array<int64_t, 5>;  // kind, secondary, first ds_id, elements, tensors

inline bool is_gloo(c10d::ProcessGroup& group) {
  const std::string name = group.getBackendName();
  return name == "gloo" || name.find("cpu:gloo") != std::string::npos;
}

// Exchanges `mine` over `group`; where any rank's differs, calls `on_disagree(rows)` (which raises) and
// throws if it returns.
inline void agree_before(c10d::ProcessGroup& group, const Descriptor& mine, const pybind11::object& on_disagree,
                         Progress* watch) {
  const int64_t n = static_cast<int64_t>(mine.size());
  const int64_t world = group.getSize();
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor in = at::empty({n}, opts);
  for (int64_t i = 0; i < n; ++i) in[i] = mine[i];
  at::Tensor out = at::empty({world * n}, opts);
  all_gather_into(group, out, in, watch);
  const int64_t* v = out.data_ptr<int64_t>();
  bool same = true;
  for (int64_t i = n; i < world * n && same; ++i) same = v[i] == v[i % n];
  if (same) return;
  std::vector<std::vector<int64_t>> rows(world, std::vector<int64_t>(n));
  for (int64_t r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) rows[r][i] = v[r * n + i];
  on_disagree(rows);
  throw std::runtime_error("z3ext: the ranks' next collectives differ ([Note: agree before the collective])");
}

}  // namespace z3ext
