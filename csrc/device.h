// Device synchronisation for z3ext: a dedicated gather stream and events on CUDA, nothing on CPU.
// [Note: z3ext streams] Gathers run on one stream per engine. Gathered storages get their memory on
// the compute (current) stream before switching, so the caching allocator ties it to the stream that
// reads it; the gather stream waits for the compute stream's work queued so far, then writes it
// before the unit's ready event. Freeing it ([Note: true release], engine.h) first makes the compute
// stream wait for that event, never record_stream.
#pragma once
#include <torch/extension.h>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#ifdef Z3EXT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace z3ext {

// A tensor as one flat run: itself when it is one already (partitions and most gradients are; a reshape is a
// dispatched op, ~2.9k instructions on the 2-core VM, per parameter and gather or flush).
inline at::Tensor flat_of(const at::Tensor& t) { return t.dim() == 1 && t.is_contiguous() ? t : t.reshape({-1}); }

#ifdef Z3EXT_WITH_CUDA
// [Note: event pool] Every gather batch records two events (the compute stream's point its gather
// stream waits for, and the gather's completion); a new CUDAEvent is a cudaEventCreate at its first
// record and a cudaEventDestroy when the last fence holding it goes. Events come from a pool per device
// instead and return to it when no fence holds them: nothing can wait on an event no fence holds, and a
// wait already queued (cudaStreamWaitEvent) is on the record it saw, not on later ones.
class EventPool {
 public:
  static std::shared_ptr<at::cuda::CUDAEvent> take(c10::DeviceIndex device) {
    EventPool& pool = instance();
    at::cuda::CUDAEvent* event = nullptr;
    {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      auto& free = pool.free_[device];
      if (!free.empty()) {
        event = free.back();
        free.pop_back();
      }
    }
    if (event == nullptr) event = new at::cuda::CUDAEvent(cudaEventDisableTiming);
    return std::shared_ptr<at::cuda::CUDAEvent>(event, [device](at::cuda::CUDAEvent* e) { instance().give(device, e); });
  }

 private:
  static constexpr size_t kMaxFree = 256;
  // Never destroyed: a fence held by a Python object can outlive static destruction at exit.
  static EventPool& instance() {
    static EventPool* pool = new EventPool();
    return *pool;
  }
  void give(c10::DeviceIndex device, at::cuda::CUDAEvent* event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free = free_[device];
      if (free.size() < kMaxFree) {
        free.push_back(event);
        return;
      }
    }
    delete event;
  }
  std::mutex mutex_;
  std::unordered_map<c10::DeviceIndex, std::vector<at::cuda::CUDAEvent*>> free_;
};
#endif

// An event recorded on some stream; empty on CPU, where every operation is synchronous.
class Fence {
 public:
  Fence() = default;
  static Fence record_current(const at::Device& device) {
    Fence f;
#ifdef Z3EXT_WITH_CUDA
    if (device.is_cuda()) {
      f.event_ = EventPool::take(device.index());  // [Note: event pool]
      f.event_->record(c10::cuda::getCurrentCUDAStream(device.index()));
    }
#endif
    return f;
  }
  // Makes the current stream of `device` wait for this fence (no host block).
  void wait_on_current(const at::Device& device) const {
#ifdef Z3EXT_WITH_CUDA
    if (event_ && device.is_cuda()) event_->block(c10::cuda::getCurrentCUDAStream(device.index()));
#endif
  }
  bool done() const {
#ifdef Z3EXT_WITH_CUDA
    return !event_ || event_->query();
#else
    return true;
#endif
  }
  void synchronize() const {
#ifdef Z3EXT_WITH_CUDA
    if (event_) event_->synchronize();
#endif
  }

 private:
#ifdef Z3EXT_WITH_CUDA
  std::shared_ptr<at::cuda::CUDAEvent> event_;
#endif
};

// Runs `fn` with the engine's gather stream current (CUDA) or as is (CPU).
class GatherStream {
 public:
  template <typename Fn>
  void run(const at::Device& device, Fn&& fn) {
#ifdef Z3EXT_WITH_CUDA
    if (device.is_cuda()) {
      if (!stream_ || stream_->device_index() != device.index())
        stream_ = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index());
      // The gather reads partitions the compute stream may have just written (optimizer step).
      Fence inputs = Fence::record_current(device);
      c10::cuda::CUDAStreamGuard guard(*stream_);
      inputs.wait_on_current(device);
      fn();
      return;
    }
#endif
    fn();
  }

 private:
#ifdef Z3EXT_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream_;
#endif
};

}  // namespace z3ext
