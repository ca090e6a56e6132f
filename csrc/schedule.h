// ScheduleLog: what this rank's gather engine sent to its collectives, as a fingerprint ranks compare.
// [Note: schedule fingerprint] Every rank must issue the same collectives in the same order (DESIGN.md);
// NCCL does not check, and a mismatch is a hang or silent garbage. Each all-gather mixes its parameters'
// ds_ids, element counts, dtype and group (world or hpZ node) into a running 64-bit hash and a count; the
// first `kMaxEntries` collectives since the last check are kept one by one (their own hash and first
// ds_id) so that a mismatch can be named. Each gradient reduce-scatter is noted the same way, its parameters'
// (ds_id, elements) salted apart from any gather (`kReduceScatter` in place of the dtype): the fixed gradient
// layout makes every rank's the same by construction, and the check holds it to that. Python compares the
// fingerprint across ranks (schedule.py) and resets the log. A few integer operations per parameter gathered: nothing beside the collective.
// It also counts the ops that raised on this rank and were rolled back (a gather out of memory, a
// backward pass that raised): a fault on one rank only leaves that rank a collective behind, and the
// count tells the ranks apart even where their schedules realign ([Note: one-rank faults] in schedule.py).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace z3ext {

class ScheduleLog {
 public:
  static constexpr size_t kMaxEntries = 4096;
  static constexpr int64_t kReduceScatter = -2;  // the `dtype` a gradient reduce-scatter is noted with

  // One collective over `ids` (ds_id, numel pairs); `dtype` and `secondary` tell it apart further.
  template <typename It>
  void note(It first, It last, int64_t dtype, bool secondary) {
    const auto [h, first_id] = digest(first, last, dtype, secondary);
    note_digest(h, first_id);
  }

  // One collective's own hash and first ds_id, for a caller that notes the same collective often (a gradient
  // bucket of the fixed layout: its digest is computed once).
  template <typename It>
  static std::pair<int64_t, int64_t> digest(It first, It last, int64_t dtype, bool secondary) {
    uint64_t h = mix(0x9e3779b97f4a7c15ULL, static_cast<uint64_t>(dtype) * 2 + (secondary ? 1 : 0));
    int64_t first_id = -1;
    for (It it = first; it != last; ++it) {
      if (first_id < 0) first_id = it->first;
      h = mix(h, static_cast<uint64_t>(it->first));
      h = mix(h, static_cast<uint64_t>(it->second));
    }
    return {static_cast<int64_t>(h), first_id};
  }

  void note_digest(int64_t h, int64_t first_id) {
    hash_ = mix(hash_, static_cast<uint64_t>(h));
    ++count_;
    if (entries_.size() < kMaxEntries) entries_.emplace_back(h, first_id);
  }

  void note_fault() { ++faults_; }

  int64_t count() const { return count_; }
  int64_t faults() const { return faults_; }
  int64_t hash() const { return static_cast<int64_t>(hash_); }
  const std::vector<std::pair<int64_t, int64_t>>& entries() const { return entries_; }

  void reset() {
    hash_ = 0;
    count_ = 0;
    faults_ = 0;
    entries_.clear();
  }

  // Ends a span: its entries are kept aside (read only when the ranks disagree: copying 4096 pairs into
  // Python at every check was most of its host time) and a new span starts.
  void take() {
    entries_.swap(taken_);
    reset();
  }
  const std::vector<std::pair<int64_t, int64_t>>& taken() const { return taken_; }

 private:
  static uint64_t mix(uint64_t h, uint64_t v) {  // splitmix64 of the pair: order-sensitive
    uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  uint64_t hash_ = 0;
  int64_t count_ = 0;
  int64_t faults_ = 0;
  std::vector<std::pair<int64_t, int64_t>> entries_;  // (the collective's hash, its first ds_id)
  std::vector<std::pair<int64_t, int64_t>> taken_;    // the last span's, set aside by take()
};

}  // namespace z3ext
