// Device synchronisation for z3ext: a dedicated gather stream and events on CUDA, nothing on CPU.
// [Note: z3ext streams] Gathers run on one stream per engine. Gathered storages get their memory on
// the compute (current) stream before switching, so the caching allocator ties it to the stream that
// reads it; the gather stream waits for the compute stream's work queued so far, then writes it
// before the unit's ready event. Freeing it ([Note: true release], engine.h) first makes the compute
// stream wait for that event, never record_stream.
#pragma once
#include <torch/extension.h>
#include <memory>
#include <optional>

#ifdef Z3EXT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace z3ext {

// An event recorded on some stream; empty on CPU, where every operation is synchronous.
class Fence {
 public:
  Fence() = default;
  static Fence record_current(const at::Device& device) {
    Fence f;
#ifdef Z3EXT_WITH_CUDA
    if (device.is_cuda()) {
      f.event_ = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
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
