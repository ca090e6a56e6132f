// A CPU allocator that runs out of memory on purpose, for tests/test_faults.py: installed as torch's
// CPU allocator, it passes every allocation to the one it replaced, except the `skip + 1`-th request
// of exactly `nbytes` bytes after `arm`, which throws c10::OutOfMemoryError as the CUDA caching
// allocator does when a GPU is full. Every tensor allocation of the process goes through it (z3ext's
// gathers and re-fills, its gradient layout, autograd's gradients): the fault lands wherever that
// allocation happens, in code z3ext did not write as well as in its own.
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>

namespace {

struct FaultAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> nbytes{-1};
  std::atomic<int64_t> skip{0};
  std::atomic<int64_t> fired{0};

  c10::DataPtr allocate(size_t n) override {
    if (static_cast<int64_t>(n) == nbytes.load() && skip.fetch_sub(1) == 0) {
      nbytes = -1;
      fired++;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "fault allocator: out of memory allocating ", n,
                       " bytes (injected by tests/faults)");
    }
    return base->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return base->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

FaultAllocator* fault() {
  static FaultAllocator* a = new FaultAllocator();  // outlives every storage it allocated
  return a;
}

void install() {
  auto* a = fault();
  if (a->base == nullptr) {
    a->base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(a, /*priority=*/100);
  }
}

void arm(int64_t nbytes, int64_t skip) {
  TORCH_CHECK(fault()->base != nullptr, "fault allocator: install() first");
  fault()->skip = skip;
  fault()->nbytes = nbytes;
}

void disarm() { fault()->nbytes = -1; }

int64_t fired() { return fault()->fired.load(); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("arm", &arm, py::arg("nbytes"), py::arg("skip") = 0);
  m.def("disarm", &disarm);
  m.def("fired", &fired);
}
