// The one binding file: exposes the z3ext concepts (claims, handles, units, the gather engine).
#include <torch/csrc/utils/pybind.h>
#include <pybind11/functional.h>
#include "aio.h"
#include "backward_count.h"
#include "boundary.h"
#include "engine.h"
#include "linear.h"
#include "oom.h"
#include "reduce.h"

namespace py = pybind11;
using namespace z3ext;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_z3ext C++ ops: coalesced all-gather, claims, true release on last claim";
#ifdef Z3EXT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  m.def("input_boundary", &input_boundary, py::arg("tensor"));
  // [Note: grad-mode linear] in deepspeed_z3ext/linear.py: None where stock's Function must run
  m.def("linear_call", &linear_call, py::arg("input"), py::arg("weight"), py::arg("bias") = py::none());  // [Note: linear in one call]
  m.def(  // [Note: schedule fingerprint] in schedule.h: a gradient reduce-scatter's (digest, first ds_id)
      "reduce_scatter_digest",
      [](const std::vector<std::pair<int64_t, int64_t>>& ids) {
        return ScheduleLog::digest(ids.begin(), ids.end(), ScheduleLog::kReduceScatter, false);
      },
      py::arg("ids"));
  m.def("set_linear_released_backward", [](py::object fn) { linear_released_backward() = std::move(fn); });
  m.def("count_used_in_backward", &count_used_in_backward, py::arg("params"));  // [Note: backward hook count]
  m.def(  // [Note: gradients this backward will not deliver]
      "unreached_in_backward",
      [](const std::vector<at::Tensor>& params) -> py::object {
        auto r = unreached_in_backward(params);
        if (!r) return py::none();
        return py::make_tuple(r->indices, r->reentrant);
      },
      py::arg("params"));
  m.def(
      "reduce_scatter_grads",
      [](const ReduceScatterFn& collective, const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& dests,
         int64_t rank, int64_t world, at::ScalarType comm_dtype, double averaging_scale, bool accumulate,
         bool divide_after) {
        auto r = oom_as_python([&] {  // [Note: out of memory]
          return reduce_scatter_grads(collective, grads, dests, rank, world, comm_dtype, averaging_scale, accumulate,
                                      divide_after);
        });
        return std::make_tuple(r.reduced, r.laid_out, r.writes);
      },
      py::arg("collective"), py::arg("grads"), py::arg("dests"), py::arg("rank"), py::arg("world"),
      py::arg("comm_dtype"), py::arg("averaging_scale"), py::arg("accumulate"),
      py::arg("divide_after"));  // [Note: gradient arithmetic] in reduce.h

  py::enum_<ClaimKind>(m, "ClaimKind")
      .value("FORWARD", ClaimKind::Forward)
      .value("BACKWARD", ClaimKind::Backward)
      .value("GATHERED", ClaimKind::Gathered)
      .value("FALLBACK", ClaimKind::Fallback)
      .value("PERSIST", ClaimKind::Persist)
      .value("DIRECT", ClaimKind::Direct)
      .value("RESIDENT", ClaimKind::Resident);
  m.attr("SHARED_OWNER") = kSharedOwner;
  m.attr("TOKEN_BASE") = kTokenBase;

  py::enum_<ParamState>(m, "ParamState")
      .value("PARTITIONED", ParamState::Partitioned)
      .value("GATHERED", ParamState::Gathered);

  py::class_<ParamHandle, HandlePtr>(m, "ParamHandle")
      .def_readonly("name", &ParamHandle::name)
      .def_readonly("ds_id", &ParamHandle::ds_id)
      .def_readonly("numel", &ParamHandle::numel)
      .def_readonly("persist", &ParamHandle::persist)
      .def_property_readonly("state", &ParamHandle::state)
      .def_property_readonly("claims", [](const ParamHandle& h) {
        py::list out;
        for (const auto& c : h.claims.items()) out.append(py::make_tuple(c.kind, c.owner));
        return out;
      });

  py::class_<FetchUnit, std::shared_ptr<FetchUnit>>(m, "FetchUnit")
      .def(py::init<std::vector<HandlePtr>>())
      .def_property_readonly("numel", &FetchUnit::numel)
      .def_property_readonly("partitioned", &FetchUnit::partitioned)
      .def("__len__", [](const FetchUnit& u) { return u.handles.size(); })
      .def_property_readonly("handles", [](const FetchUnit& u) { return u.handles; });

  // [Note: collective progress] in progress.h
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Aborted& e) {
      PyErr_SetString(e.type ? e.type : PyExc_RuntimeError, e.what());
    }
  });
  py::class_<Progress, std::shared_ptr<Progress>>(m, "Progress")
      .def(py::init<>())
      .def("begin", &Progress::begin, py::arg("descriptor"))
      .def(  // on an accelerator, `device`'s current stream gets the fence
          "end",
          [](Progress& p, int64_t index, const at::Device& device) {
            p.end(index, device.is_cpu() ? Fence() : Fence::record_current(device));
          },
          py::arg("index"), py::arg("device"))
      .def("wait", [](Progress& p, c10d::Work& work) { p.wait(work); }, py::arg("work"),
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &Progress::abort, py::arg("error_type"), py::arg("message"))
      .def_property_readonly("aborted", &Progress::aborted)
      .def("stalled_seconds", &Progress::stalled_seconds)
      .def("snapshot", &Progress::snapshot);

  py::class_<GatherEngine, std::shared_ptr<GatherEngine>>(m, "GatherEngine")
      .def(py::init<py::object, py::object>(), py::arg("status_available"), py::arg("status_not_available"))
      .def("make_handle", &GatherEngine::make_handle)
      .def("set_secondary", &GatherEngine::set_secondary, py::arg("handle"), py::arg("group"), py::arg("rank"),
           py::arg("world"), py::arg("status_available"))  // [Note: hpZ secondary partition]
      .def("conflict", &GatherEngine::conflict, py::arg("unit"), py::arg("kind"), py::arg("owner"),
           py::arg("to_claim"))
      .def(
          "unshard",  // [Note: out of memory]
          [](GatherEngine& e, const FetchUnit& unit, ClaimKind kind, int64_t owner, bool defer) {
            return oom_as_python([&] { return e.unshard(unit, kind, owner, defer); });
          },
          py::arg("unit"), py::arg("kind"), py::arg("owner"), py::arg("defer") = false)
      .def(
          "unshard_batch",
          [](GatherEngine& e, const std::vector<std::shared_ptr<FetchUnit>>& units, ClaimKind kind,
             const std::vector<int64_t>& owners, bool defer) {
            return oom_as_python([&] { return e.unshard_batch(units, kind, owners, defer); });
          },
          py::arg("units"), py::arg("kind"), py::arg("owners"), py::arg("defer") = false)
      .def("reshard", &GatherEngine::reshard, py::arg("unit"), py::arg("kind"), py::arg("owner"),
           py::arg("also_direct") = false)
      .def("drop_kinds", &GatherEngine::drop_kinds)
      .def("sweep", &GatherEngine::sweep)
      .def("sweep_step", &GatherEngine::sweep_step)  // [Note: persistent refresh]
      .def("drop_owners", &GatherEngine::drop_owners, py::arg("kind"), py::arg("owners"))
      .def("write_back", &GatherEngine::write_back)
      .def("set_residency", &GatherEngine::set_residency, py::arg("residency"))  // [Note: partition residency]
      .def_property_readonly("residency", &GatherEngine::residency)
      .def("set_disagree", &GatherEngine::set_disagree, py::arg("callback"))  // [Note: agree before the collective]
      .def("set_progress", &GatherEngine::set_progress, py::arg("progress"))  // [Note: collective progress]
      .def("destroy", &GatherEngine::destroy)
      .def("stale_references", &GatherEngine::stale_references)  // [Note: true release]
      .def_property_readonly("handles", &GatherEngine::handles)
      .def_property_readonly("live_numel", [](const GatherEngine& e) { return e.stats().live_numel; })
      .def("schedule", [](GatherEngine& e) {  // [Note: schedule fingerprint] in schedule.h
        const ScheduleLog& s = e.schedule();
        return py::make_tuple(s.count(), s.hash(), s.faults(), s.entries());
      })
      .def("take_schedule", [](GatherEngine& e) {  // ends the span: (count, hash, faults, entries logged)
        ScheduleLog& s = e.schedule();
        auto out = py::make_tuple(s.count(), s.hash(), s.faults(), static_cast<int64_t>(s.entries().size()));
        s.take();
        return out;
      })
      .def("taken_schedule", [](GatherEngine& e) { return e.schedule().taken(); })
      .def("note_reduce_scatter", [](GatherEngine& e, int64_t digest, int64_t first_id) {
        e.schedule().note_digest(digest, first_id);  // [Note: schedule fingerprint]
      }, py::arg("digest"), py::arg("first_id"))
      .def("note_fault", [](GatherEngine& e) { e.schedule().note_fault(); })
      .def("reset_schedule", [](GatherEngine& e) { e.schedule().reset(); })
      .def("stats", [](const GatherEngine& e) {
        const auto& s = e.stats();
        py::dict d;
        d["live_bytes"] = s.live_bytes;
        d["peak_live_bytes"] = s.peak_live_bytes;
        d["gathered_params"] = s.gathered_params;
        d["released_params"] = s.released_params;
        d["collectives"] = s.collectives;
        d["refilled"] = s.refilled;
        d["refreshed"] = s.refreshed;
        d["secondary_collectives"] = s.secondary_collectives;
        d["secondaries_made"] = s.secondaries_made;
        return d;
      });

  // -- AIO: file I/O of CPU tensors on C++ worker threads ([Note: aio and the GIL], aio.h) -----
  // Every call that can block releases the GIL; errors come back as values ([Note: aio errors]).
  using aio::AioHandle;
  py::class_<AioHandle, std::shared_ptr<AioHandle>>(m, "AioHandle")
      .def(py::init<int64_t, int64_t, bool, bool, int64_t>(), py::arg("block_size"), py::arg("queue_depth"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("intra_op_parallelism"))
      .def_property_readonly("block_size", &AioHandle::block_size)
      .def_property_readonly("queue_depth", &AioHandle::queue_depth)
      .def_property_readonly("single_submit", &AioHandle::single_submit)
      .def_property_readonly("overlap_events", &AioHandle::overlap_events)
      .def_property_readonly("intra_op_parallelism", &AioHandle::intra_op_parallelism)
      .def_property_readonly("num_threads", &AioHandle::num_threads)
      .def_property_readonly("native_aio", &AioHandle::native_aio)
      .def(
          "submit",
          [](AioHandle& h, const at::Tensor& buffer, const std::string& path, int64_t offset, bool read) {
            aio::Status s = h.submit(buffer, path, offset, read);
            return std::make_tuple(s.code, s.message, s.notice);
          },
          py::arg("buffer"), py::arg("path"), py::arg("file_offset"), py::arg("read"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "submit_fd",
          [](AioHandle& h, const at::Tensor& buffer, int fd, int64_t offset) {
            aio::Status s = h.submit_fd(buffer, fd, offset);
            return std::make_tuple(s.code, s.message, s.notice);
          },
          py::arg("buffer"), py::arg("fd"), py::arg("file_offset"), py::call_guard<py::gil_scoped_release>())
      .def("wait", &AioHandle::wait, py::call_guard<py::gil_scoped_release>())
      .def("take_errors", &AioHandle::take_errors)
      .def_property_readonly("pending", &AioHandle::pending)
      .def("close", &AioHandle::close, py::call_guard<py::gil_scoped_release>())
      .def(
          "new_locked",
          [](AioHandle& h, int64_t numel, const at::Tensor& example) {
            auto r = h.new_locked(numel, example);
            return std::make_tuple(r.first.code, r.first.message, r.second);  // tensor None: out of memory
          },
          py::arg("numel"), py::arg("example"))
      .def("is_locked", &AioHandle::is_locked, py::arg("tensor"));
  m.def(
      "aio_probe",
      [](const std::string& path) {
        aio::Probe p = aio::probe(path);
        return std::make_tuple(p.code, p.message, p.direct, p.mem_align, p.offset_align, p.fs);
      },
      py::arg("path"), py::call_guard<py::gil_scoped_release>());
  m.attr("AIO_INVALID") = aio::kInvalid;
  m.attr("AIO_SHORT") = aio::kShort;
  m.attr("AIO_CLOSED") = aio::kClosed;
}
