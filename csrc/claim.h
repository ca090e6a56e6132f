// Claims: who holds a full parameter. A claim is a (kind, owner) pair.
// [Note: claims] A parameter is released only when its last claim is dropped. Explicit owners
// (a GatheredParameters block) claim strictly: the same owner twice is an error naming the
// parameter (checked through GatherEngine::conflict before claiming). Module hooks claim idempotently, as stock ZeRO-3's `ds_active_sub_modules` set does,
// because a module may legitimately run its pre-hook again (loops, tied modules) before release.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace z3ext {

enum class ClaimKind : uint8_t {
  Forward = 0,   // a module's forward is running
  Backward = 1,  // a module's backward needs the parameter
  Gathered = 2,  // a GatheredParameters block
  Fallback = 3,  // an eager frame that Dynamo skipped (DeepCompile)
  Persist = 4,   // a persistent (small) parameter, held between steps
  Direct = 5,    // a direct `param.all_gather()` call, dropped by `param.partition()`
  Resident = 6,  // kept by a no_grad forward for the next one ([Note: generation residency] in resident_set.py)
};

inline const char* claim_kind_name(ClaimKind k) {
  switch (k) {
    case ClaimKind::Forward: return "forward";
    case ClaimKind::Backward: return "backward";
    case ClaimKind::Gathered: return "gathered";
    case ClaimKind::Fallback: return "fallback";
    case ClaimKind::Persist: return "persist";
    case ClaimKind::Direct: return "direct";
    case ClaimKind::Resident: return "resident";
  }
  return "?";
}

// [Note: claim owners] An owner is an int64 whose meaning depends on the kind; defined here and in
// deepspeed_z3ext/claims.py, nowhere else:
// - Forward: the ds_id of the module whose forward runs (prefetched units: the module they are for);
// - Backward: a token >= kTokenBase, one per autograd graph or per module call (graphs.py);
// - Fallback: the id of a DeepCompile forward graph (fallback.py), its own kind, so ids never collide;
// - Gathered, Direct, Persist, Resident: kSharedOwner. All GatheredParameters blocks share it, so overlapping
//   blocks are a duplicate claim (an error, as stock forbids them); a direct all_gather() is ended by
//   the next partition() or module release, whoever gathered it; persistence is one claim.
constexpr int64_t kSharedOwner = 0;
constexpr int64_t kTokenBase = int64_t(1) << 40;  // above any module ds_id

struct Claim {
  ClaimKind kind;
  int64_t owner;
  bool operator==(const Claim& o) const { return kind == o.kind && owner == o.owner; }
};

// A handful of claims per parameter at most: a flat vector beats a hash set.
class ClaimSet {
 public:
  bool holds(const Claim& c) const {
    for (const auto& x : claims_)
      if (x == c) return true;
    return false;
  }
  void add(const Claim& c) { claims_.push_back(c); }
  bool remove(const Claim& c) {
    for (size_t i = 0; i < claims_.size(); ++i)
      if (claims_[i] == c) {
        claims_[i] = claims_.back();
        claims_.pop_back();
        return true;
      }
    return false;
  }
  int remove_kind(ClaimKind k) {
    int n = 0;
    for (size_t i = 0; i < claims_.size();) {
      if (claims_[i].kind == k) {
        claims_[i] = claims_.back();
        claims_.pop_back();
        ++n;
      } else {
        ++i;
      }
    }
    return n;
  }
  void clear() { claims_.clear(); }
  bool empty() const { return claims_.empty(); }
  const std::vector<Claim>& items() const { return claims_; }

 private:
  std::vector<Claim> claims_;
};

}  // namespace z3ext
