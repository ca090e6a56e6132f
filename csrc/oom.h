// Out of memory inside a z3ext op, as Python sees it.
// [Note: out of memory] An allocation that fails inside a gather, a re-fill or a reduce-scatter throws
// c10::OutOfMemoryError (the CUDA caching allocator's error). The op first undoes what it had done
// ([Note: gather rollback] in engine.h; the gradient path restores its bucket in grads.py), then the
// binding raises torch.OutOfMemoryError with the allocator's message, the error torch's own ops raise,
// which HF Accelerate's `find_executable_batch_size` and users' retry loops catch. The Python error is
// set here and the binding returns through pybind11's error_already_set path, so no C++ exception
// type has to be matched by a translator in another library.
#pragma once
#include <torch/extension.h>
#include <utility>

namespace z3ext {
namespace py = pybind11;

template <class F>
auto oom_as_python(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::OutOfMemoryError& e) {
    py::object error = py::module_::import("torch").attr("OutOfMemoryError");
    PyErr_SetString(error.ptr(), e.what_without_backtrace());
    throw py::error_already_set();
  }
}

}  // namespace z3ext
