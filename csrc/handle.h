// ParamHandle: one ZeRO-3 parameter as z3ext sees it: its claims and, while gathered, the bucket
// whose buffer its `.data` views.
#pragma once
#include <optional>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <memory>
#include "claim.h"
#include "device.h"
#include "secondary.h"

namespace z3ext {
namespace py = pybind11;

// DeepSpeed's parameter attributes z3ext reads and writes on every gather and release, as interned
// Python strings made once: `attr("name")` makes a new string and hashes it on every call (about 700
// instructions per parameter and gather, bench/NOTES.md v35). Leaked on purpose: freed after the
// interpreter's finalization they would touch a dead heap. First used with the GIL held.
struct AttrNames {
  py::object ds_tensor, ds_status, ds_secondary_tensor;
};
inline const AttrNames& attr_names() {
  static const AttrNames* names = new AttrNames{
      py::reinterpret_steal<py::object>(PyUnicode_InternFromString("ds_tensor")),
      py::reinterpret_steal<py::object>(PyUnicode_InternFromString("ds_status")),
      py::reinterpret_steal<py::object>(PyUnicode_InternFromString("ds_secondary_tensor"))};
  return *names;
}

// The parameters gathered by one collective: they share its completion fence. Each parameter's
// gathered memory is its own storage (ParamHandle::full), see [Note: true release] in engine.h.
struct Bucket {
  // [Note: deferred wait] A prefetched bucket's gather may still be running on the gather stream;
  // the compute stream waits on `ready` only when a claimant first uses it (or it is released or
  // written back), so the gather overlaps the compute queued before that point.
  Fence ready;
  bool pending = false;
  void wait_ready(const at::Device& device) {
    if (pending) {
      ready.wait_on_current(device);
      pending = false;
    }
  }
};

enum class ParamState : uint8_t { Partitioned = 0, Gathered = 1 };

struct ParamHandle {
  py::object param;             // the nn.Parameter (ds_status is written back on it)
  at::Tensor tensor;            // the same parameter, for set_data
  std::string name;
  int64_t ds_id = 0;
  int64_t numel = 0;            // ds_numel
  int64_t partition_numel = 0;  // ds_tensor.ds_numel (padded numel / world)
  std::vector<int64_t> shape;   // ds_shape
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int64_t rank = 0;
  int64_t world = 1;
  bool persist = false;  // ds_persist: every gather also takes a Persist claim
  std::optional<SecondaryPartition> secondary;  // ZeRO++ hpZ ([Note: hpZ secondary partition])
  ClaimSet claims;
  std::shared_ptr<Bucket> bucket;  // set while gathered
  // The parameter's gathered storage (1-D, world * partition_numel, padded), made at its first gather
  // and kept for the handle's life: 0 bytes while released, re-filled in place by the next gather, so
  // views of it saved by autograd see valid data again ([Note: true release]). Undefined until then
  // and for a parameter that views its own partition ([Note: world of one]).
  at::Tensor full;
  bool full_live = false;  // `full` holds its bytes (gathered into it)
  // Made once, set as `.data` at each gather and release ([Note: handle views] in engine.h): the
  // parameter-shaped view of `full`, the empty placeholder, and the error a read of released memory raises.
  at::Tensor full_view;
  at::Tensor placeholder;
  std::string released_msg;
  at::Tensor parked;  // the module storage while a user-only gather uses another ([Note: user views])
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> user_storage;  // the last user-only gather's
  bool module_claimed = false;  // a module (or fallback) claim since this gather ([Note: user views])
  // Kept gathered through the optimizer step, its partition since rewritten: the next claim re-gathers
  // it into the same storage ([Note: persistent refresh] in engine.h).
  bool stale = false;

  ParamState state() const { return bucket ? ParamState::Gathered : ParamState::Partitioned; }

  // Plain string concatenation, no iostreams: std::ostringstream crashed (SIGSEGV) in the CUDA
  // build on the GPU image, whose process loads another libstdc++ than the extension was built with.
  std::string describe() const { return "parameter '" + name + "' (ds_id " + std::to_string(ds_id) + ")"; }
  std::string describe_claims() const {
    std::string s = "[";
    for (const auto& c : claims.items()) {
      if (s.size() > 1) s += ", ";
      s += std::string(claim_kind_name(c.kind)) + ":" + std::to_string(c.owner);
    }
    return s + "]";
  }
};

using HandlePtr = std::shared_ptr<ParamHandle>;

}  // namespace z3ext
