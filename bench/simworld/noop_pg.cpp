// A c10d backend whose collectives do nothing: rank 0 of a world of N on one device.
//
// [Note: simulated world] Every collective checks its arguments as a real backend would (sizes,
// list lengths) and returns an already-completed Work without reading or writing any tensor. Rank 0
// then shards, gathers, reduces and steps exactly as it would in a world of N: shard sizes, host
// work and memory per rank are real, communication time is zero and values are wrong (the chunks of
// other ranks hold whatever the allocator left there). torch's own "fake" backend copies the input
// into each of the N output chunks of an all-gather (and a chunk out of a reduce-scatter's input):
// O(N x tensors) kernels and host work that a per-parameter coalesced gather pays and a flat one does
// not, which biases timings against the former and grows with N. Nothing here depends on the
// device: the same backend serves CPU and CUDA tensors (a completed Work never makes a stream wait).
#include <pybind11/pybind11.h>
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace simworld {

using c10d::AllgatherOptions;
using c10d::AllreduceCoalescedOptions;
using c10d::AllreduceOptions;
using c10d::AllToAllOptions;
using c10d::BarrierOptions;
using c10d::BroadcastOptions;
using c10d::GatherOptions;
using c10d::ReduceOptions;
using c10d::ReduceScatterOptions;
using c10d::ScatterOptions;
using c10d::Work;

class DoneWork : public Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  void blockCurrentStream() {}  // virtual in recent torch only (see getBackendOptions below)
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    // DDP-style callers chain on the future: hand them one that is already complete.
    auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    fut->markCompleted();
    return fut;
  }
};

class NoopBackend : public c10d::Backend {
 public:
  NoopBackend(int rank, int size)
      : Backend(rank, size), options_(c10::make_intrusive<Backend::Options>("simworld")) {
    TORCH_CHECK(rank >= 0 && rank < size, "simworld: rank ", rank, " outside a world of ", size);
  }

  const std::string getBackendName() const override { return "simworld"; }
  // These two are virtual in recent torch only; written without `override` they override where the
  // base declares them and are harmless extras where it does not (the bench also runs on older torch).
  c10::intrusive_ptr<Backend::Options> getBackendOptions() { return options_; }
  // Batched p2p / coalescing managers open and close a group around their calls: nothing to batch.
  bool supportsCoalescing() const { return true; }
  void startCoalescing() override {}
  c10::intrusive_ptr<Work> endCoalescing() override { return done(); }

  c10::intrusive_ptr<Work> broadcast(std::vector<at::Tensor>&, const BroadcastOptions&) override { return done(); }
  c10::intrusive_ptr<Work> allreduce(std::vector<at::Tensor>&, const AllreduceOptions&) override { return done(); }
  c10::intrusive_ptr<Work> allreduce_sparse(std::vector<at::Tensor>&, const AllreduceOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>&, const AllreduceCoalescedOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> reduce(std::vector<at::Tensor>&, const ReduceOptions&) override { return done(); }

  c10::intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                     const AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "simworld allgather: one output list per input");
    for (auto& list : outputs) {
      TORCH_CHECK(static_cast<int>(list.size()) == size_, "simworld allgather: ", list.size(),
                  " outputs for a world of ", size_);
    }
    return done();
  }
  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input, const AllgatherOptions&) override {
    check_times_world("_allgather_base", output, input);
    return done();
  }
  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const AllgatherOptions&) override {
    for (auto& list : outputs) {
      TORCH_CHECK(list.size() == inputs.size(), "simworld allgather_coalesced: one output per input");
    }
    TORCH_CHECK(static_cast<int>(outputs.size()) == size_, "simworld allgather_coalesced: ", outputs.size(),
                " output lists for a world of ", size_);
    return done();
  }
  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const AllgatherOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "simworld allgather_into_tensor_coalesced: one output per input");
    for (size_t i = 0; i < outputs.size(); ++i) check_times_world("allgather_into_tensor_coalesced", outputs[i], inputs[i]);
    return done();
  }
  c10::intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>&, std::vector<at::Tensor>&,
                                  const GatherOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> scatter(std::vector<at::Tensor>&, std::vector<std::vector<at::Tensor>>&,
                                   const ScatterOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const ReduceScatterOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "simworld reduce_scatter: one input list per output");
    for (auto& list : inputs) {
      TORCH_CHECK(static_cast<int>(list.size()) == size_, "simworld reduce_scatter: ", list.size(),
                  " inputs for a world of ", size_);
    }
    return done();
  }
  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const ReduceScatterOptions&) override {
    check_times_world("_reduce_scatter_base", input, output);
    return done();
  }
  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const ReduceScatterOptions&) override {
    TORCH_CHECK(outputs.size() == inputs.size(), "simworld reduce_scatter_tensor_coalesced: one input per output");
    for (size_t i = 0; i < outputs.size(); ++i) check_times_world("reduce_scatter_tensor_coalesced", inputs[i], outputs[i]);
    return done();
  }
  c10::intrusive_ptr<Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                         const AllToAllOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> alltoall(std::vector<at::Tensor>&, std::vector<at::Tensor>&,
                                    const AllToAllOptions&) override {
    return done();
  }
  c10::intrusive_ptr<Work> send(std::vector<at::Tensor>&, int, int) override { return done(); }
  c10::intrusive_ptr<Work> recv(std::vector<at::Tensor>&, int, int) override { return done(); }
  c10::intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>&, int) override { return done(); }
  c10::intrusive_ptr<Work> barrier(const BarrierOptions&) override { return done(); }
  void monitoredBarrier(const BarrierOptions&, bool) override {}

 private:
  static c10::intrusive_ptr<Work> done() { return c10::make_intrusive<DoneWork>(); }

  // The checks a real backend makes on a flat collective: the full tensor is world x the shard.
  void check_times_world(const char* what, const at::Tensor& full, const at::Tensor& shard) const {
    TORCH_CHECK(full.numel() == shard.numel() * size_, "simworld ", what, ": ", full.numel(),
                " elements are not world (", size_, ") x ", shard.numel());
  }

  c10::intrusive_ptr<Backend::Options> options_;
};

// torch.distributed.Backend.register_backend's creator (store, rank, world size, timeout): the store
// and timeout are unused (no rank ever waits for another).
c10::intrusive_ptr<c10d::Backend> create(const pybind11::object& /*store*/, int64_t rank, int64_t size,
                                         const pybind11::object& /*timeout*/) {
  return c10::make_intrusive<NoopBackend>(static_cast<int>(rank), static_cast<int>(size));
}

}  // namespace simworld

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("create", &simworld::create, "a backend whose collectives do nothing (rank 0 of a simulated world)",
        pybind11::arg("store"), pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"));
}
