// Pool of flat gather buffers, keyed by (numel, dtype, device).
// [Note: pool reuse hazard] A released buffer may still be referenced by a reader we do not own
// (autograd saving `weight.t()`, an autocast cache, a user's `.detach()`). Recycling it would
// corrupt that reader silently. The pool therefore takes a buffer back only when it holds the sole
// reference to the buffer's storage; otherwise the buffer is orphaned: the reader keeps it alive
// and the allocator frees it when the reader is done, exactly as stock ZeRO-3 frees by dropping.
#pragma once
#include <deque>
#include <map>
#include <tuple>
#include "device.h"

namespace z3ext {

struct PoolStats {
  int64_t cached_bytes = 0;   // held by the pool, free for reuse
  int64_t acquired = 0;       // buffers handed out
  int64_t reused = 0;         // of which came from the free list
  int64_t orphaned = 0;       // given back while another reader held the storage
  int64_t evicted = 0;        // dropped because the pool was over budget
};

class BufferPool {
 public:
  explicit BufferPool(int64_t budget_bytes) : budget_bytes_(budget_bytes) {}

  // Returns a 1-D buffer; the current stream waits for the fence of a reused buffer.
  at::Tensor acquire(int64_t numel, at::ScalarType dtype, const at::Device& device) {
    stats_.acquired++;
    auto it = free_.find(Key{numel, dtype, device.str()});
    if (it != free_.end() && !it->second.empty()) {
      Entry e = std::move(it->second.front());
      it->second.pop_front();
      stats_.cached_bytes -= bytes(e.buffer);
      stats_.reused++;
      e.fence.wait_on_current(device);
      return e.buffer;
    }
    return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }

  // Takes a buffer back, guarded by `fence` (readers done once it completes). Returns false when
  // the buffer was orphaned instead (another reader still holds its storage).
  bool give_back(at::Tensor buffer, Fence fence) {
    if (buffer.storage().use_count() > 1) {  // see [Note: pool reuse hazard]
      stats_.orphaned++;
      return false;
    }
    int64_t b = bytes(buffer);
    if (b > budget_bytes_) {
      drop(buffer, fence);
      stats_.evicted++;
      return true;
    }
    while (stats_.cached_bytes + b > budget_bytes_ && evict_one()) {
    }
    Key k{buffer.numel(), buffer.scalar_type(), buffer.device().str()};
    free_[k].push_back(Entry{std::move(buffer), std::move(fence)});
    stats_.cached_bytes += b;
    return true;
  }

  void clear() {
    for (auto& kv : free_)
      for (auto& e : kv.second) e.fence.synchronize();
    free_.clear();
    stats_.cached_bytes = 0;
  }

  const PoolStats& stats() const { return stats_; }
  int64_t budget_bytes() const { return budget_bytes_; }

 private:
  using Key = std::tuple<int64_t, at::ScalarType, std::string>;
  struct Entry {
    at::Tensor buffer;
    Fence fence;
  };
  static int64_t bytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

  // Frees a buffer to the caching allocator. It was allocated on the compute stream but may last
  // have been written on the gather stream: the compute stream waits for that write (a device-side
  // wait, no host block, so the host keeps running ahead), and the allocator only reuses the memory
  // in compute-stream order, after that wait.
  static void drop(const at::Tensor& buffer, const Fence& fence) { fence.wait_on_current(buffer.device()); }

  bool evict_one() {
    for (auto& kv : free_) {
      if (kv.second.empty()) continue;
      Entry e = std::move(kv.second.front());
      kv.second.pop_front();
      drop(e.buffer, e.fence);
      stats_.cached_bytes -= bytes(e.buffer);
      stats_.evicted++;
      return true;
    }
    return false;
  }

  int64_t budget_bytes_;
  std::map<Key, std::deque<Entry>> free_;
  PoolStats stats_;
};

}  // namespace z3ext
