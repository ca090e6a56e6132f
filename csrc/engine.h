// GatherEngine: per-DeepSpeed-engine owner of handles, their gathered storages and the gather stream.
// One call per fetch unit gathers (unshard) or releases (reshard); no Python loop per parameter.
#pragma once
#include <memory>
#include <tuple>
#include <utility>
#include "agreement.h"
#include "collectives.h"
#include "residency.h"
#include "schedule.h"
#include "unit.h"

namespace z3ext {

struct EngineStats {
  int64_t live_bytes = 0;       // bytes of gathered storages currently holding memory
  int64_t live_numel = 0;       // their elements (the unit of stage3_max_live_parameters)
  int64_t peak_live_bytes = 0;
  int64_t gathered_params = 0;  // parameters made full since creation
  int64_t released_params = 0;
  int64_t collectives = 0;      // all-gathers issued
  int64_t refilled = 0;         // gathers into a storage a previous gather made ([Note: true release])
  int64_t refreshed = 0;        // persistent parameters re-gathered in place after a step ([Note: persistent refresh])
  int64_t secondary_collectives = 0;  // of `collectives`, those over an hpZ intra-node group
  int64_t secondaries_made = 0;       // hpZ secondary partitions copied out ([Note: hpZ secondary partition])
};

// [Note: released storage mark] A released storage is marked so that a read of its data raises naming
// the parameter (`release_data_and_set_meta_custom_data_ptr_error_msg_`), and the mark is cleared when
// the storage is re-filled. torch releases without `clear_data_ptr_access_error_msg_` (the device image's
// 2.11) cannot clear it, so there neither is set (chosen at compile time): a released storage is then only
// 0 bytes, as FSDP2's, and reads of it are not named.
template <typename S>
inline auto clear_access_error(S* s, int) -> decltype(s->clear_data_ptr_access_error_msg_(), void()) {
  s->clear_data_ptr_access_error_msg_();
}
template <typename S>
inline void clear_access_error(S*, long) {}
template <typename S>
inline auto mark_access_error(S* s, int, std::string msg)
    -> decltype(s->clear_data_ptr_access_error_msg_(), void()) {
  s->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(msg));
}
template <typename S>
inline void mark_access_error(S*, long, std::string) {}

class GatherEngine {
 public:
  static constexpr Claim kPersist{ClaimKind::Persist, kSharedOwner};

  GatherEngine(py::object status_available, py::object status_not_available)
      : available_(std::move(status_available)),
        not_available_(std::move(status_not_available)) {}

  HandlePtr make_handle(py::object param, std::string name, int64_t ds_id, int64_t numel,
                        int64_t partition_numel, std::vector<int64_t> shape,
                        c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t rank, int64_t world, bool persist) {
    auto h = std::make_shared<ParamHandle>();
    h->tensor = param.cast<at::Tensor>();
    h->param = std::move(param);
    h->name = std::move(name);
    h->ds_id = ds_id;
    h->numel = numel;
    h->partition_numel = partition_numel;
    h->shape = std::move(shape);
    h->group = std::move(group);
    h->rank = rank;
    h->world = world;
    h->persist = persist;
    handles_.push_back(h);
    return h;
  }

  // Gives `h` an hpZ secondary partition over `group` ([Note: hpZ secondary partition]);
  // `status_available`: DeepSpeed's PartitionedParamStatus.AVAILABLE, which a new one carries.
  void set_secondary(const HandlePtr& h, c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t rank, int64_t world,
                     py::object status_available) {
    const int64_t padded = h->world * h->partition_numel;
    if (world < 2 || padded % world != 0 || rank < 0 || rank >= world)
      throw std::runtime_error("z3ext: " + h->describe() + ": an hpZ group of " + std::to_string(world) +
                               " ranks (rank " + std::to_string(rank) + ") cannot split its " +
                               std::to_string(padded) + " padded elements");
    h->secondary = SecondaryPartition{std::move(group), rank, world, padded / world};
    secondary_available_ = std::move(status_available);
  }

  // Describes the first parameter of `unit` that (kind, owner) cannot claim (already held) or drop
  // (not held); empty when none. Python raises ClaimError with it: no C++ exception crosses the
  // binding for a user error (one did crash the CUDA build under torch 2.11's pybind11).
  std::string conflict(const FetchUnit& unit, ClaimKind kind, int64_t owner, bool to_claim) const {
    const Claim c{kind, owner};
    for (const auto& h : unit.handles) {
      if (to_claim && h->claims.holds(c))
        return "z3ext: " + h->describe() + " is already claimed by " + claim_kind_name(kind) + " owner " +
               std::to_string(owner) + "; overlapping claims by one owner are not allowed";
      if (!to_claim && !h->claims.holds(c))
        return "z3ext: " + h->describe() + " is not claimed by " + claim_kind_name(kind) + " owner " +
               std::to_string(owner) + " (claims: " + h->describe_claims() + ")";
    }
    return "";
  }

  // Claims every parameter of `unit` for (kind, owner) (idempotently) and gathers those that are
  // partitioned. With `defer` (a prefetch), the compute stream does not wait for the gather yet
  // ([Note: deferred wait]); without it, it waits for every bucket the unit uses. Returns the
  // number of parameters gathered.
  int64_t unshard(const FetchUnit& unit, ClaimKind kind, int64_t owner, bool defer) {
    std::vector<ParamHandle*> need;
    Added added;
    claim(unit, Claim{kind, owner}, defer, need, added);  // a unit is in ds_id order, each parameter once
    if (!need.empty()) gather_or_roll_back(need, added, defer, kind != ClaimKind::Direct);
    return static_cast<int64_t>(need.size());
  }

  // Claims each unit for (kind, owners[i]) and gathers every partitioned parameter of all of them in
  // one collective per (group, dtype, device), deferred or not: a prefetch batch in one call, with no
  // transient combined unit or claim.
  int64_t unshard_batch(const std::vector<std::shared_ptr<FetchUnit>>& units, ClaimKind kind,
                        const std::vector<int64_t>& owners, bool defer) {
    if (units.size() != owners.size()) return -1;  // the coordinator passes one owner per unit
    std::vector<ParamHandle*> need;
    Added added;
    for (size_t i = 0; i < units.size(); ++i) claim(*units[i], Claim{kind, owners[i]}, defer, need, added);
    // ds_id order, each parameter once (an external parameter can be in several units).
    std::sort(need.begin(), need.end(), [](ParamHandle* a, ParamHandle* b) { return a->ds_id < b->ds_id; });
    need.erase(std::unique(need.begin(), need.end()), need.end());
    if (!need.empty()) gather_or_roll_back(need, added, defer, kind != ClaimKind::Direct);
    return static_cast<int64_t>(need.size());
  }

  // Drops (kind, owner) from every parameter of `unit`; releases those left without claims.
  // `also_direct` drops Direct claims too (a module release ends what a direct all_gather of its
  // parameters started, as in stock).
  int64_t reshard(const FetchUnit& unit, ClaimKind kind, int64_t owner, bool also_direct) {
    const Claim c{kind, owner};
    return drop_and_release(unit.handles, [&](ParamHandle& h) {
      h.claims.remove(c);
      if (also_direct) h.claims.remove_kind(ClaimKind::Direct);
      return true;
    });
  }

  // Drops every claim of `kinds` (any owner) from the unit's parameters; releases the unclaimed.
  int64_t drop_kinds(const FetchUnit& unit, const std::vector<ClaimKind>& kinds) {
    return drop_and_release(unit.handles, [&](ParamHandle& h) {
      for (auto k : kinds) h.claims.remove_kind(k);
      return true;
    });
  }

  // Drops the claims (kind, owner) for every owner in `owners` from every parameter of this engine;
  // releases the unclaimed. How a backward graph's holds end (coordinator.py [Note: graph claims]):
  // one pass over the handles, however many units the graph held.
  int64_t drop_owners(ClaimKind kind, const std::vector<int64_t>& owners) {
    if (owners.empty()) return 0;
    return drop_and_release(handles_, [&](ParamHandle& h) {
      bool dropped = false;
      for (auto o : owners) dropped = h.claims.remove(Claim{kind, o}) || dropped;
      return dropped;
    });
  }

  // Drops every claim of `kinds` held on any parameter of this engine; releases the unclaimed.
  int64_t sweep(const std::vector<ClaimKind>& kinds) {
    if (residency_) residency_->before_sweep();  // [Note: partition residency]
    return drop_and_release(handles_, [&](ParamHandle& h) {
      for (auto k : kinds) h.claims.remove_kind(k);
      return true;
    });
  }

  // The optimizer step's sweep: drops every claim of `kinds` (Persist excluded) and releases the
  // unclaimed. [Note: persistent refresh] Stock releases every parameter at the step, persistent ones
  // included, and its `_post_step` gathers the persistent ones again (`all_gather` of the list): per
  // parameter a release and a new gather (storage, `.data`, `ds_status`), 260 of them in a 6.7B GPT.
  // Here a persistent parameter held only by its Persist claim stays gathered through the step, in
  // its own storage, marked stale: the step rewrites its partition, not its gathered value. The next
  // claim of it (that `_post_step` gather, or a forward when the step was skipped) re-gathers it into
  // the same storage with the other stale ones, in one collective, without a new `.data` or
  // `ds_status`; in a world of one its `.data` views the partition and is never stale. Nothing reads
  // it between the step's sweep and that claim but the step, which reads partitions. Only the step's
  // sweep (coordinator `optimizer_step`): DeepSpeed's other releases of everything (a checkpoint's save
  // or load) drop Persist as stock does, whose module state saved there is partitioned. With a
  // partition-residency hook (NVMe) the Persist claims are dropped as stock drops them.
  int64_t sweep_step(const std::vector<ClaimKind>& kinds) {
    if (residency_) {
      std::vector<ClaimKind> all = kinds;
      all.push_back(ClaimKind::Persist);
      return sweep(all);
    }
    return drop_and_release(handles_, [&](ParamHandle& h) {
      for (auto k : kinds) h.claims.remove_kind(k);
      if (h.persist && h.bucket && h.full_live && h.claims.items().size() == 1 && h.claims.holds(kPersist))
        h.stale = true;
      return true;
    });
  }

  // Writes each gathered parameter's current full value into this rank's partition (ds_tensor).
  // Partitions out of memory are made resident first and written out after ([Note: partition residency]).
  void write_back(const FetchUnit& unit) {
    py::object ids;  // the gathered parameters' ds_ids, for the residency hook only
    if (residency_) {
      py::list gathered;
      for (const auto& h : unit.handles)
        if (h->bucket) gathered.append(h->ds_id);
      ids = std::move(gathered);
      residency_->before_write_back(ids);
    }
    for (const auto& h : unit.handles) {
      if (!h->bucket) continue;
      h->bucket->wait_ready(h->tensor.device());
      at::Tensor part = h->param.attr("ds_tensor").cast<at::Tensor>();
      at::Tensor full = h->tensor.detach().reshape({-1});
      int64_t start = h->rank * h->partition_numel;
      if (start >= h->numel) continue;
      int64_t n = std::min(h->partition_numel, h->numel - start);
      at::NoGradGuard no_grad;
      part.reshape({-1}).narrow(0, 0, n).copy_(full.narrow(0, start, n));
      if (h->secondary) make_secondaries({h.get()}, false);  // stock rewrites it too ([Note: hpZ secondary partition])
      h->stale = false;  // its partition is its gathered value now
    }
    if (residency_) residency_->after_write_back(ids);
  }

  // Installs (or, with None, removes) the partition-residency hook ([Note: partition residency]).
  void set_residency(py::object residency) {
    residency_.reset();
    if (!residency.is_none()) residency_ = std::make_unique<Residency>(std::move(residency));
  }
  py::object residency() const { return residency_ ? residency_->obj : py::none(); }

  // Installs (or, with None, removes) the callback that raises when the ranks' next all-gathers differ on
  // a gloo group ([Note: agree before the collective] in agreement.h).
  void set_disagree(py::object callback) { disagree_ = std::move(callback); }

  // The record of this engine's collectives that the hang watchdog reads ([Note: collective progress]).
  void set_progress(std::shared_ptr<Progress> progress) { progress_ = std::move(progress); }

  // Releases everything: every claim dropped, every storage emptied.
  void destroy() {
    residency_.reset();  // its Python references go while Python is up
    disagree_ = py::none();
    progress_.reset();
    for (const auto& h : handles_) {
      h->claims.clear();
      if (h->bucket) release(*h);
    }
    handles_.clear();
  }

  // Names of released parameters whose (empty) gathered storage something besides z3ext still
  // references: a view kept from a forward or a GatheredParameters block, an autograd graph not
  // freed. It holds no memory ([Note: true release]) but reading it raises.
  std::vector<std::string> stale_references() const {
    std::vector<std::string> names;
    for (const auto& h : handles_)
      if ((!h->bucket && h->full.defined() && h->full.storage().use_count() > 1 + owns_view(*h)) ||
          (h->user_storage.has_value() && !h->user_storage->expired()))
        names.push_back(h->name);
    return names;
  }

  const EngineStats& stats() const { return stats_; }
  ScheduleLog& schedule() { return schedule_; }
  const std::vector<HandlePtr>& handles() const { return handles_; }

 private:
  // [Note: one release routine] Every way claims end (reshard, drop_kinds, drop_owners, sweep) goes
  // through here: `drop(handle)` removes claims and says whether the handle is to be checked; a
  // checked handle left without claims and still gathered is released ([Note: true release]).
  template <class Handles, class Drop>
  int64_t drop_and_release(const Handles& handles, Drop&& drop) {
    std::vector<ParamHandle*> released;
    for (const auto& h : handles)
      if (drop(*h) && h->claims.empty() && h->bucket) released.push_back(h.get());
    if (released.empty()) return 0;
    if (secondary_available_) make_secondaries(released, true);  // before their storages are emptied
    for (auto* h : released) release(*h);
    return static_cast<int64_t>(released.size());
  }

  // Claims one unshard call added, so that a gather that raises can take them back.
  using Added = std::vector<std::pair<ParamHandle*, Claim>>;

  // Adds claim `c` (and Persist where due) to the unit's parameters, recording each added claim in
  // `added`; the partitioned ones go to `need`, and without `defer` the compute stream waits for the
  // gathered ones' buckets.
  void claim(const FetchUnit& unit, const Claim& c, bool defer, std::vector<ParamHandle*>& need, Added& added) {
    for (const auto& h : unit.handles) {
      if (!h->claims.holds(c)) {
        h->claims.add(c);
        added.emplace_back(h.get(), c);
      }
      if (c.kind == ClaimKind::Forward || c.kind == ClaimKind::Backward || c.kind == ClaimKind::Fallback)
        h->module_claimed = true;  // autograd may save views of it: true release ([Note: user views])
      if (h->persist && !h->claims.holds(kPersist)) {
        h->claims.add(kPersist);
        added.emplace_back(h.get(), kPersist);
      }
      if (!h->bucket || h->stale) {
        need.push_back(h.get());  // partitioned, or re-gathered in place ([Note: persistent refresh])
      } else if (!defer) {
        h->bucket->wait_ready(h->tensor.device());
      }
    }
  }

  // [Note: gather rollback] A gather can raise part-way: the allocator is out of memory for the k-th
  // storage (c10::OutOfMemoryError, torch.OutOfMemoryError in Python: csrc/oom.h), or a collective
  // fails. The call is then undone before the error propagates, so the engine is as before it: the
  // claims it added are dropped, storages it filled but never handed to their parameter are emptied
  // again, and parameters an earlier collective of the same call gathered are released when left
  // unclaimed. Without it the filled storages stayed counted live and their memory held until the next
  // gather of the same parameters, and the stale claims outlived the step. HF's and users' retry with
  // a smaller batch then starts from the engine a fresh one would be (tests/test_faults.py).
  // `secondary_ok`: a module's gather, which reads hpZ secondary partitions where they exist.
  void gather_or_roll_back(const std::vector<ParamHandle*>& need, const Added& added, bool defer, bool secondary_ok) {
    try {
      gather_resident(need, defer, secondary_ok);
    } catch (...) {
      schedule_.note_fault();  // [Note: schedule fingerprint] in schedule.h
      for (const auto& [h, c] : added) h->claims.remove(c);
      for (auto* h : need) {
        if (h->stale) {
          continue;  // still gathered under its Persist claim, still stale: the next claim retries
        } else if (h->bucket) {
          if (h->claims.empty()) release(*h);
        } else {
          reshard_storage(*h);  // filled, not adopted (no-op when never filled)
        }
      }
      throw;
    }
  }

  // Gathers `need` (partitioned, claimed, each once, in ds_id order). With a residency hook, in
  // the parts it names, each made resident before and handed back after its gather
  // ([Note: partition residency]); without one (no partition out of memory), one null check.
  void gather_resident(const std::vector<ParamHandle*>& need, bool defer, bool secondary_ok) {
    if (!residency_) {
      gather(need, defer, secondary_ok);
      return;
    }
    py::list ids;
    for (auto* h : need) ids.append(h->ds_id);
    py::object parts = residency_->parts(ids);
    if (parts.is_none()) {  // every partition of `need` is in memory
      gather(need, defer, secondary_ok);
      return;
    }
    for (auto& part : split_parts(need, parts)) {
      py::list part_ids;
      for (auto* h : part) part_ids.append(h->ds_id);
      residency_->before_gather(part_ids);
      gather(part, defer, secondary_ok);
      residency_->after_gather(part_ids);
    }
  }

  // The parts a residency hook named for `need` (lists of ds_ids), each in ds_id order; they must
  // cover `need` exactly once.
  static std::vector<std::vector<ParamHandle*>> split_parts(const std::vector<ParamHandle*>& need,
                                                            const py::object& parts) {
    std::vector<std::pair<int64_t, ParamHandle*>> by_id;
    by_id.reserve(need.size());
    for (auto* h : need) by_id.emplace_back(h->ds_id, h);
    std::sort(by_id.begin(), by_id.end());
    std::vector<bool> taken(by_id.size(), false);
    std::vector<std::vector<ParamHandle*>> out;
    size_t covered = 0;
    for (const auto& part : parts) {
      out.emplace_back();
      for (const auto& item : part) {
        const int64_t id = item.cast<int64_t>();
        auto it = std::lower_bound(by_id.begin(), by_id.end(), std::make_pair(id, static_cast<ParamHandle*>(nullptr)));
        if (it == by_id.end() || it->first != id || taken[it - by_id.begin()])
          throw std::runtime_error("z3ext: the partition-residency hook's parts name ds_id " + std::to_string(id) +
                                   " that is not to be gathered, or twice");
        taken[it - by_id.begin()] = true;
        out.back().push_back(it->second);
        ++covered;
      }
      std::sort(out.back().begin(), out.back().end(),
                [](ParamHandle* a, ParamHandle* b) { return a->ds_id < b->ds_id; });
      if (out.back().empty()) out.pop_back();
    }
    if (covered != need.size())
      throw std::runtime_error("z3ext: the partition-residency hook's parts leave " +
                               std::to_string(need.size() - covered) + " parameters to be gathered out");
    return out;
  }

  struct GatherGroup {
    bool secondary;  // over the hpZ intra-node group, from secondary partitions
    std::vector<std::pair<ParamHandle*, at::Tensor>> params;  // (handle, the partition it gathers from)
  };

  // Gathers `params` (all partitioned), grouped by (process group, dtype, device, persistence) in
  // ds_id order; with `secondary_ok`, from hpZ secondary partitions where DeepSpeed's attribute holds
  // one (not for a stale persistent parameter: the step rewrote its primary, and the secondary is
  // dropped only after that re-gather, [Note: hpZ secondary partition]).
  // [Note: persistent buckets] Persistent parameters are gathered in collectives of their own: a
  // bucket's fence is shared by its parameters, and a persistent one is never released.
  void gather(const std::vector<ParamHandle*>& params, bool defer, bool secondary_ok) {
    using Key = std::tuple<c10d::ProcessGroup*, at::ScalarType, at::Device, bool>;
    std::vector<Key> keys;
    std::vector<GatherGroup> groups;
    for (auto* h : params) {
      py::object source;
      const bool secondary = secondary_ok && h->secondary && !h->stale &&
                             !(source = h->param.attr(attr_names().ds_secondary_tensor)).is_none();
      at::Tensor part = secondary ? source.cast<at::Tensor>() : h->param.attr(attr_names().ds_tensor).cast<at::Tensor>();
      const int64_t expected = secondary ? h->secondary->partition_numel : h->partition_numel;
      if (part.numel() != expected)
        throw std::runtime_error("z3ext: " + h->describe() + " has a " + (secondary ? "secondary (hpZ) " : "") +
                                 "partition of " + std::to_string(part.numel()) + " elements, expected " +
                                 std::to_string(expected) +
                                 " (quantized or offloaded-to-NVMe partitions are not supported)");
      c10d::ProcessGroup* pg = secondary ? h->secondary->group.get() : h->group.get();
      // The parameter's dtype, not its partition's: a partition may be the fp32 master ([Note: partition is
      // the master] in master.py), cast into the rank's block of the gathered storage.
      Key key{pg, h->tensor.scalar_type(), h->tensor.device(), h->persist};
      auto it = std::find(keys.begin(), keys.end(), key);
      if (it == keys.end()) {
        keys.push_back(key);
        groups.push_back(GatherGroup{secondary, {}});
        groups.back().params.emplace_back(h, std::move(part));
      } else {
        groups[it - keys.begin()].params.emplace_back(h, std::move(part));
      }
    }
    for (auto& g : groups) gather_group(g.params, defer, g.secondary);
  }

  // [Note: parameter-major buckets] One coalesced all-gather fills a bucket: input i is parameter
  // i's partition itself and output i the parameter's own gathered storage (`full`: the `world`
  // partitions of its padded flat tensor), so a parameter is a view of its storage. No staging
  // buffer, no copy-in, no copy-out: on a host-bound forward each copy kernel cost more launch time
  // than bandwidth, and a staging buffer doubled the transient memory of a batch. The GPU pays
  // instead: NCCL runs a coalesced gather of several tensors at about half the bandwidth of one flat
  // buffer (bench/allgather_forms.py, bench/NOTES.md v14), which shows only where the gather, not the
  // host, bounds a forward. One storage per parameter (not per bucket) is what lets a unit be
  // released and re-filled on its own ([Note: true release]). Partitions on another device than the
  // parameter (NVMe offload reads them into host buffers) are first copied into the rank's own block
  // of their output and gathered in place.
  void gather_group(std::vector<std::pair<ParamHandle*, at::Tensor>>& params, bool defer, bool secondary) {
    at::NoGradGuard no_grad;
    ParamHandle& first = *params.front().first;
    const at::Device device = first.tensor.device();
    const at::ScalarType dtype = first.tensor.scalar_type();
    const int64_t world = secondary ? first.secondary->world : first.world;
    c10d::ProcessGroup& pg = secondary ? *first.secondary->group : *first.group;

    auto bucket = std::make_shared<Bucket>();
    // [Note: world of one] In a group of one rank a partition is its whole (padded) parameter: the
    // parameter becomes a view of it: no buffer, no copy, no stream work, no memory beyond the partition.
    // (Partitions on another device, NVMe offload's host buffers, and fp32 masters of a bf16 or fp16
    // parameter are still copied.)
    if (world == 1) {
      bool same_device = true;
      for (auto& hp : params)
        same_device = same_device && hp.second.device() == device && hp.second.scalar_type() == dtype;
      if (same_device) {
        for (auto& [h, part] : params) {
          h->tensor.set_data(flat_of(part).narrow(0, 0, h->numel).view(h->shape));
          adopt(*h, bucket);
        }
        stats_.gathered_params += static_cast<int64_t>(params.size());
        return;
      }
    }
    // Storages are (re)filled with memory on the compute stream: see [Note: z3ext streams].
    std::vector<at::Tensor> outs;
    outs.reserve(params.size());
    for (auto& hp : params)
      outs.push_back(hp.first->stale ? hp.first->full : unshard_storage(*hp.first, dtype, device));
    Fence ready;
    int64_t ended = -1;  // the progress record of this gather's collective ([Note: collective progress])
    stream_.run(device, [&] {
      std::vector<at::Tensor> flat;
      flat.reserve(params.size());
      for (auto& hp : params) flat.push_back(flat_of(hp.second));
      if (world == 1) {
        // Partitions on another device (above: same-device ones are viewed).
        for (size_t i = 0; i < params.size(); ++i) outs[i].copy_(flat[i], /*non_blocking=*/true);
      } else {
        // Partitions on another device or of another dtype (the fp32 master of a bf16 parameter, [Note:
        // partition is the master] in master.py) are copied (cast) into the rank's block and gathered in place;
        // the casts of one bucket in one multi-tensor copy (one kernel on CUDA for a dtype pair).
        std::vector<at::Tensor> cast_dst, cast_src;
        for (size_t i = 0; i < params.size(); ++i) {
          const bool moved = flat[i].device() != device;
          if (moved || flat[i].scalar_type() != dtype) {
            const ParamHandle& h = *params[i].first;
            const int64_t n = secondary ? h.secondary->partition_numel : h.partition_numel;
            at::Tensor mine = outs[i].narrow(0, (secondary ? h.secondary->rank : h.rank) * n, n);
            if (moved) {
              mine.copy_(flat[i], /*non_blocking=*/true);
            } else {
              cast_dst.push_back(mine);
              cast_src.push_back(flat[i]);
            }
            flat[i] = mine;
          }
        }
        if (cast_dst.size() == 1) {
          cast_dst[0].copy_(cast_src[0]);
        } else if (!cast_dst.empty()) {
          at::_foreach_copy_(cast_dst, cast_src);
        }
        int64_t issued = 1;
        int64_t numel = 0;
        {  // [Note: schedule fingerprint] in schedule.h
          std::vector<std::pair<int64_t, int64_t>> ids;
          ids.reserve(params.size());
          for (auto& hp : params) {
            ids.emplace_back(hp.first->ds_id, hp.first->numel);
            numel += hp.first->numel;
          }
          schedule_.note(ids.begin(), ids.end(), static_cast<int64_t>(dtype), secondary);
        }
        const Descriptor desc{1, secondary ? 1 : 0, params.front().first->ds_id, numel,
                              static_cast<int64_t>(params.size())};
        const bool gloo = is_gloo(pg);
        Progress* watch = gloo ? progress_.get() : nullptr;  // [Note: collective progress] in progress.h
        const int64_t record = progress_ ? progress_->begin(desc) : -1;
        try {
          if (!disagree_.is_none() && gloo) agree_before(pg, desc, disagree_, watch);  // [Note: agree before the collective]
          if (outs.size() == 1) {
            all_gather_into(pg, outs[0], flat[0], watch);
          } else if (coalesces(pg, device)) {
            all_gather_coalesced_into(pg, outs, flat, watch);
          } else {  // [Note: gloo on CUDA tensors] in collectives.h
            for (size_t i = 0; i < outs.size(); ++i) all_gather_into(pg, outs[i], flat[i], watch);
            issued = static_cast<int64_t>(outs.size());
          }
        } catch (...) {
          if (progress_) progress_->end(record, Fence());  // not pending: it raised
          throw;
        }
        ended = record;
        stats_.collectives += issued;
        if (secondary) stats_.secondary_collectives += issued;
      }
      ready = Fence::record_current(device);
      if (ended >= 0) progress_->end(ended, ready);  // complete with the gather's own fence
    });
    if (defer) {
      bucket->ready = ready;
      bucket->pending = true;
    } else {
      ready.wait_on_current(device);
    }
    for (size_t i = 0; i < params.size(); ++i) {
      ParamHandle* h = params[i].first;
      if (h->stale) {  // its `.data` already views `full`, which the collective re-filled
        h->bucket = bucket;
        h->stale = false;
        stats_.refreshed++;
        continue;
      }
      h->tensor.set_data(gathered_view(*h));
      adopt(*h, bucket);
      stats_.gathered_params++;
    }
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  }

  // [Note: true release] A released parameter returns its gathered memory to the allocator at once,
  // whatever still references it: autograd's saved `weight.t()` of nn.Linear, the weight saved by
  // conv, bmm or matmul, a tied or external parameter saved by another module, a `.detach()` view.
  // (Before, `.data` was swapped for the empty placeholder and the buffer was merely dropped, so
  // every saved view kept its whole buffer alive until backward consumed it: the hold bound and
  // `hold_for_backward: false` bounded nothing.) As in FSDP2 (`_fsdp_param.py` free_storage /
  // alloc_storage), each parameter has one gathered storage for the handle's life (`full`):
  // - release (free_storage): `.data` becomes the empty placeholder (DeepSpeed's NOT_AVAILABLE
  //   invariant), the storage's data pointer is dropped (its memory goes back to the allocator:
  //   glibc on CPU, the caching allocator on CUDA) and its size set to 0 bytes; the storage is
  //   marked so that any read of its data raises an error naming the parameter (torch's
  //   custom data-pointer error, the one FakeTensor uses). Creating a new view of it raises torch's
  //   own "out of bounds for storage of size 0". Never garbage, never a silent zero.
  // - gather (alloc_storage): the same storage gets fresh memory of its full size from its own
  //   allocator on the compute stream, the mark is cleared, and the all-gather writes into it; every
  //   view saved earlier sees the gathered values again. The write goes through `full`, a tensor of
  //   z3ext's own, never through the parameter: the parameter's version counter (shared by the
  //   views autograd saved of it) does not move, so the re-fill cannot trip autograd's "modified by
  //   an inplace operation" check (FSDP2, which copies into the parameter itself, needs
  //   `_unsafe_preserve_version_counter` for that).
  // Before an autograd node that saved such a view runs, the parameter is gathered again: a held
  // module still holds it (graphs.py [Note: graph claims]); one that was not held gets it from its
  // backward claim, gathered when its outputs' gradient arrives; recomputation gathers as a forward.
  // CUDA: the memory is allocated on the compute stream; the gather stream writes it only after
  // waiting for the compute stream's work queued before the allocation ([Note: z3ext streams]),
  // and before freeing it the compute stream waits for the gather that wrote it (`wait_ready`), so
  // the caching allocator, which reuses a block in its stream's order, never hands it out while the
  // gather stream still writes it. No record_stream. No pool: the caching allocator already
  // recycles blocks on CUDA, and a pool would keep released memory the rest of the program could
  // use (on CPU a re-fill of 64 MiB pays fresh pages from glibc: about 3x the copy on the 2-core
  // test VM; CPU runs are tests, not the target).
  at::Tensor unshard_storage(ParamHandle& h, at::ScalarType dtype, const at::Device& device) {
    const int64_t numel = h.world * h.partition_numel;  // = secondary world * its partition ([Note: hpZ secondary partition])
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    if (!h.module_claimed && h.full.defined() && !h.parked.defined()) {
      h.parked = h.full;  // a user's gather leaves the module storage released ([Note: user views])
      h.full = at::Tensor();
    }
    if (!h.full.defined() || h.full.scalar_type() != dtype || h.full.device() != device || h.full.numel() != numel) {
      h.full = at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
    } else {
      c10::StorageImpl* s = h.full.storage().unsafeGetStorageImpl();
      clear_access_error(s, 0);
      s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
      s->set_nbytes(nbytes);
      stats_.refilled++;
    }
    h.full_live = true;
    stats_.live_bytes += nbytes;
    stats_.live_numel += numel;
    return h.full;
  }

  // [Note: user views] Only a gather that a module's forward, backward or an eager fallback frame
  // claimed is released for real: autograd saved its views, and the module's backward claim re-fills
  // them. A gather that only user code claimed (a GatheredParameters block, `param.all_gather()`,
  // persistence) has no re-fill path, and users keep what they read there (`param.detach().cpu()` is
  // the same tensor on CPU; DeepSpeed's zero_to_fp32 tests do exactly that): its storage is released
  // as stock releases, by dropping z3ext's reference (memory returns once nothing else holds it). Such a
  // gather is made into a new storage, the module storage (released, its autograd views waiting for
  // their re-fill) parked meanwhile and put back at the release.
  void reshard_storage(ParamHandle& h) {
    if (!h.full_live) return;  // [Note: world of one]: a view of the partition, which stays
    h.full_live = false;
    const int64_t nbytes = static_cast<int64_t>(h.full.storage().nbytes());
    stats_.live_bytes -= nbytes;
    stats_.live_numel -= h.full.numel();
    const bool module_claimed = h.module_claimed;
    h.module_claimed = false;
    if (h.parked.defined() || !module_claimed) {  // dropped as stock drops: its readers keep its bytes
      h.user_storage = h.full.storage().getWeakStorageImpl();  // leak_check names it while a reader holds it
      h.full_view = at::Tensor();  // z3ext keeps no reference to it
      h.full = h.parked;  // the module storage (released, 0 bytes) or none
      h.parked = at::Tensor();
      return;
    }
    c10::StorageImpl* s = h.full.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(nullptr, h.full.device()));  // frees the memory
    s->set_nbytes(0);
    if (h.released_msg.empty())
      h.released_msg = "z3ext: " + h.describe() +
                       " was released (ZeRO-3): this tensor is a view of its gathered storage, which holds no memory "
                       "until the parameter is gathered again. Read it inside the module's forward, a "
                       "GatheredParameters block, or keep a .clone()";
    mark_access_error(s, 0, h.released_msg);
  }

  // [Note: handle views] A gather sets a parameter's `.data` to a parameter-shaped view of its gathered
  // storage `full`, a release to an empty placeholder (DeepSpeed's NOT_AVAILABLE `.data`). Each view or
  // `at::empty({0})` is a dispatcher call and a new TensorImpl (on the CPU VM ~5k instructions per
  // parameter of the ~16k a gather cost; on the H200's host `aten::empty` was 6 us a call under the
  // profiler, once per parameter per release). Since `full` keeps one StorageImpl for the handle's life
  // ([Note: true release]), both are made once and set again (set_data copies their metadata into the
  // parameter; the parameter's version counter stays its own). The view is made again when `full` is
  // another storage (a user-only gather's, [Note: user views], dropped with it at its release), the
  // placeholder when the parameter's dtype or device changed or something grew its storage.
  const at::Tensor& gathered_view(ParamHandle& h) {
    if (!h.full_view.defined() ||
        h.full_view.storage().unsafeGetStorageImpl() != h.full.storage().unsafeGetStorageImpl() ||
        h.full_view.scalar_type() != h.full.scalar_type())
      h.full_view = h.full.narrow(0, 0, h.numel).view(h.shape);
    return h.full_view;
  }

  const at::Tensor& placeholder(ParamHandle& h) {
    const at::Tensor& data = h.tensor;
    if (!h.placeholder.defined() || h.placeholder.scalar_type() != data.scalar_type() ||
        h.placeholder.device() != data.device() || h.placeholder.storage().nbytes() != 0)
      h.placeholder = at::empty({0}, data.options());
    return h.placeholder;
  }

  // 1 when z3ext's cached view (gathered_view) references `full`'s storage.
  static int owns_view(const ParamHandle& h) {
    return h.full_view.defined() &&
           h.full_view.storage().unsafeGetStorageImpl() == h.full.storage().unsafeGetStorageImpl();
  }

  // Sets the hpZ secondary partitions of `hs` (gathered, about to be released or written back) to
  // their chunks of the gathered storages, made as stock's `_partition_param_sec` makes them,
  // attributes included. `missing_only`: a release, which makes one only where there is none.
  void make_secondaries(const std::vector<ParamHandle*>& hs, bool missing_only) {
    std::vector<ParamHandle*> need;
    for (auto* h : hs)
      if (h->secondary && h->full_live && (!missing_only || h->param.attr("ds_secondary_tensor").is_none()))
        need.push_back(h);
    while (!need.empty()) {  // one call per (dtype, device) of the primary partitions; one in practice
      at::Tensor like = need.front()->param.attr("ds_tensor").cast<at::Tensor>();
      std::vector<ParamHandle*> now, later;
      std::vector<at::Tensor> fulls;
      std::vector<int64_t> numels;
      std::vector<const SecondaryPartition*> layouts;
      for (auto* h : need) {
        at::Tensor part = h == need.front() ? like : h->param.attr("ds_tensor").cast<at::Tensor>();
        if (part.scalar_type() != like.scalar_type() || part.device() != like.device() ||
            h->tensor.scalar_type() != need.front()->tensor.scalar_type()) {
          later.push_back(h);
          continue;
        }
        h->bucket->wait_ready(h->tensor.device());  // the gather that wrote it
        now.push_back(h);
        fulls.push_back(h->full);  // 1-D already
        numels.push_back(h->numel);
        layouts.push_back(&*h->secondary);
      }
      // The parameter's dtype: the primary partition may be the fp32 master ([Note: partition is the master]).
      std::vector<at::Tensor> made =
          copy_secondaries_out(fulls, numels, layouts, like.options().dtype(need.front()->tensor.scalar_type()));
      for (size_t i = 0; i < now.size(); ++i) {
        py::object sec = py::cast(std::move(made[i]));
        sec.attr("ds_numel") = now[i]->secondary->partition_numel;
        sec.attr("status") = secondary_available_;
        sec.attr("final_location") = py::none();
        now[i]->param.attr("ds_secondary_tensor") = sec;
      }
      stats_.secondaries_made += static_cast<int64_t>(now.size());
      need.swap(later);
    }
  }

  // `h` (its data already set) is gathered into `bucket`.
  void adopt(ParamHandle& h, const std::shared_ptr<Bucket>& bucket) {
    h.param.attr(attr_names().ds_status) = available_;
    h.bucket = bucket;
  }

  void release(ParamHandle& h) {
    const at::Device device = h.tensor.device();
    // A prefetch released unused: its memory is free for reuse only after the gather that wrote it.
    h.bucket->wait_ready(device);
    h.tensor.set_data(placeholder(h));
    h.param.attr(attr_names().ds_status) = not_available_;
    h.bucket.reset();
    h.stale = false;
    stats_.released_params++;
    reshard_storage(h);
  }

  GatherStream stream_;
  py::object available_;
  py::object not_available_;
  py::object secondary_available_;  // PartitionedParamStatus.AVAILABLE, set with the first secondary
  std::vector<HandlePtr> handles_;
  EngineStats stats_;
  ScheduleLog schedule_;  // [Note: schedule fingerprint]
  std::unique_ptr<Residency> residency_;  // null: every partition is in memory
  py::object disagree_ = py::none();      // [Note: agree before the collective]; None: no exchange
  std::shared_ptr<Progress> progress_;    // [Note: collective progress]; null: no watchdog
};

}  // namespace z3ext
