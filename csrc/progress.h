// Progress: the recent collectives of one engine on this rank, for the hang watchdog (watchdog.py).
// [Note: collective progress] Every z3ext collective, all-gathers here and the Python side's through
// `begin`/`end`, leaves a record: its index (counted alike on every rank), its descriptor (the pre-agreement's:
// kind, hpZ, first ds_id, elements, tensors), when the host entered and left it and, on an accelerator, a fence
// behind it: the host never waits for the device, so there a collective is complete when its fence is. The
// last `kCapacity` are kept. The watchdog thread reads them (`snapshot`, `stalled_seconds`) and, when it has
// named what went wrong, `abort`s: a host wait on a gloo group wakes every `kSlice` and throws `Aborted`,
// which the bindings raise as the Python error the watchdog chose; every later `begin` throws it too (the
// engine is not usable any more). A few stores and a clock read per collective, one mutex nobody contends.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include "device.h"

namespace z3ext {
namespace py = pybind11;

// The watchdog's verdict thrown through C++: `type` is the Python exception class to raise (a borrowed
// reference to a class the Python side keeps alive).
struct Aborted : std::runtime_error {
  Aborted(PyObject* t, const std::string& message) : std::runtime_error(message), type(t) {}
  PyObject* type;
};

struct ProgressRecord {
  int64_t index = -1;
  std::array<int64_t, 5> desc{};  // kind, secondary, first ds_id, elements, tensors
  double start = 0;               // host clock (seconds) at begin
  double end = -1;                // at end; -1: the host is still in it
  Fence done;                     // complete on the device (empty: complete when the host left)
};

class Progress {
 public:
  static constexpr size_t kCapacity = 64;
  static constexpr std::chrono::milliseconds kSlice{100};

  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // A collective starts (throws the verdict once aborted).
  int64_t begin(const std::array<int64_t, 5>& desc) {
    throw_if_aborted();
    std::lock_guard<std::mutex> lock(mutex_);
    ProgressRecord& r = ring_[issued_ % kCapacity];
    r = ProgressRecord{};
    r.index = issued_;
    r.desc = desc;
    r.start = now();
    return issued_++;
  }

  // The host left collective `index`; `done` is a fence behind it (empty: complete now).
  void end(int64_t index, Fence done) {
    std::lock_guard<std::mutex> lock(mutex_);
    ProgressRecord& r = ring_[index % kCapacity];
    if (r.index != index) return;  // overwritten (more than kCapacity since)
    r.end = now();
    r.done = std::move(done);
    last_return_ = r.end;
  }

  // Blocks until `work` completes, waking every kSlice to throw the verdict once aborted (gloo: the host
  // waits for a collective; the caller has released the GIL).
  void wait(c10d::Work& work) {
    while (true) {
      throw_if_aborted();
      try {
        work.wait(kSlice);
        return;
      } catch (const std::exception&) {
        // Completed since the slice ran out (its "timed out" is stale), or failed (a closed connection): a
        // wait without a timeout returns, or throws the collective's own error, unless the watchdog's verdict
        // came first (a peer that raised it may have ended its process: [Note: verdict before exit]).
        if (work.isCompleted()) {
          throw_if_aborted();
          work.wait();
          return;
        }
      }
    }
  }

  void abort(py::object type, std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    abort_type_ = std::move(type);
    message_ = std::move(message);
    aborted_.store(true);
  }
  bool aborted() const { return aborted_.load(); }

  // Seconds the oldest incomplete collective has been pending (0: none).
  double stalled_seconds() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const double t = now();
    double oldest = 0;
    for (const auto& r : ring_) {
      if (r.index < 0 || (r.end >= 0 && r.done.done())) continue;
      oldest = std::max(oldest, t - r.start);
    }
    return oldest;
  }

  // (issued, seconds since the host last left a collective or -1, records oldest first: (index, kind,
  // secondary, first ds_id, elements, tensors, seconds since begin, state)) with state 0 complete, 1 the host
  // waiting in it, 2 left by the host but not complete on the device.
  py::tuple snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const double t = now();
    py::list records;
    const int64_t first = issued_ > static_cast<int64_t>(kCapacity) ? issued_ - kCapacity : 0;
    for (int64_t i = first; i < issued_; ++i) {
      const ProgressRecord& r = ring_[i % kCapacity];
      const int state = r.end < 0 ? 1 : (r.done.done() ? 0 : 2);
      records.append(py::make_tuple(r.index, r.desc[0], r.desc[1], r.desc[2], r.desc[3], r.desc[4], t - r.start,
                                    state));
    }
    return py::make_tuple(issued_, last_return_ < 0 ? -1.0 : t - last_return_, records);
  }

 private:
  void throw_if_aborted() const {
    if (!aborted_.load()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    throw Aborted(abort_type_.ptr(), message_);
  }

  mutable std::mutex mutex_;
  std::array<ProgressRecord, kCapacity> ring_{};
  int64_t issued_ = 0;
  double last_return_ = -1;
  std::atomic<bool> aborted_{false};
  py::object abort_type_;
  std::string message_;
};

}  // namespace z3ext
