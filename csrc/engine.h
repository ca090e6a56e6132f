// GatherEngine: per-DeepSpeed-engine owner of handles, the buffer pool and the gather stream.
// One call per fetch unit gathers (unshard) or releases (reshard); no Python loop per parameter.
#pragma once
#include <memory>
#include <tuple>
#include <utility>
#include "collectives.h"
#include "pool.h"
#include "residency.h"
#include "unit.h"

namespace z3ext {

struct EngineStats {
  int64_t live_bytes = 0;       // bytes of gathered buckets currently held
  int64_t live_numel = 0;       // their elements (the unit of stage3_max_live_parameters)
  int64_t peak_live_bytes = 0;
  int64_t gathered_params = 0;  // parameters made full since creation
  int64_t released_params = 0;
  int64_t collectives = 0;      // all-gathers issued
};

class GatherEngine {
 public:
  static constexpr Claim kPersist{ClaimKind::Persist, kSharedOwner};

  GatherEngine(int64_t pool_budget_bytes, py::object status_available, py::object status_not_available)
      : pool_(pool_budget_bytes),
        available_(std::move(status_available)),
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
    claim(unit, Claim{kind, owner}, defer, need);  // a unit is in ds_id order, each parameter once
    if (!need.empty()) gather_resident(need, defer);
    return static_cast<int64_t>(need.size());
  }

  // Claims each unit for (kind, owners[i]) and gathers every partitioned parameter of all of them in
  // one collective per (group, dtype, device), deferred or not: a prefetch batch in one call, with no
  // transient combined unit or claim.
  int64_t unshard_batch(const std::vector<std::shared_ptr<FetchUnit>>& units, ClaimKind kind,
                        const std::vector<int64_t>& owners, bool defer) {
    if (units.size() != owners.size()) return -1;  // the coordinator passes one owner per unit
    std::vector<ParamHandle*> need;
    for (size_t i = 0; i < units.size(); ++i) claim(*units[i], Claim{kind, owners[i]}, defer, need);
    // ds_id order, each parameter once (an external parameter can be in several units).
    std::sort(need.begin(), need.end(), [](ParamHandle* a, ParamHandle* b) { return a->ds_id < b->ds_id; });
    need.erase(std::unique(need.begin(), need.end()), need.end());
    if (!need.empty()) gather_resident(need, defer);
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
    }
    if (residency_) residency_->after_write_back(ids);
  }

  // Installs (or, with None, removes) the partition-residency hook ([Note: partition residency]).
  void set_residency(py::object residency) {
    residency_.reset();
    if (!residency.is_none()) residency_ = std::make_unique<Residency>(std::move(residency));
  }
  py::object residency() const { return residency_ ? residency_->obj : py::none(); }

  // Releases everything: every claim dropped, every bucket back, the pool emptied.
  void destroy() {
    residency_.reset();  // its Python references go while Python is up
    for (const auto& h : handles_) {
      h->claims.clear();
      if (h->bucket) release(*h);
    }
    handles_.clear();
    pool_.clear();
  }

  // Names of parameters whose released buffers are still referenced outside z3ext (see
  // [Note: pool reuse hazard]); entries whose storage has since died are forgotten.
  std::vector<std::string> live_orphans() {
    prune_orphans();
    std::vector<std::string> names;
    for (const auto& o : orphans_) names.insert(names.end(), o.names.begin(), o.names.end());
    return names;
  }

  int64_t orphan_records() const { return static_cast<int64_t>(orphans_.size()); }

  const EngineStats& stats() const { return stats_; }
  const PoolStats& pool_stats() const { return pool_.stats(); }
  int64_t pool_budget_bytes() const { return pool_.budget_bytes(); }
  const std::vector<HandlePtr>& handles() const { return handles_; }

 private:
  // [Note: one release routine] Every way claims end (reshard, drop_kinds, drop_owners, sweep) goes
  // through here: `drop(handle)` removes claims and says whether the handle is to be checked; a
  // checked handle left without claims and still gathered is released (its buffer back to the pool).
  template <class Handles, class Drop>
  int64_t drop_and_release(const Handles& handles, Drop&& drop) {
    int64_t released = 0;
    for (const auto& h : handles) {
      if (drop(*h) && h->claims.empty() && h->bucket) {
        release(*h);
        ++released;
      }
    }
    return released;
  }

  // Adds claim `c` (and Persist where due) to the unit's parameters; the partitioned ones go to
  // `need`, and without `defer` the compute stream waits for the gathered ones' buckets.
  void claim(const FetchUnit& unit, const Claim& c, bool defer, std::vector<ParamHandle*>& need) {
    for (const auto& h : unit.handles) {
      if (!h->claims.holds(c)) h->claims.add(c);
      if (h->persist && !h->claims.holds(kPersist)) h->claims.add(kPersist);
      if (!h->bucket) {
        need.push_back(h.get());
      } else if (!defer) {
        h->bucket->wait_ready(h->tensor.device());
      }
    }
  }

  // Gathers `need` (partitioned, claimed, each once, in ds_id order). With a residency hook, in
  // the parts it names, each made resident before and handed back after its gather
  // ([Note: partition residency]); without one (no partition out of memory), one null check.
  void gather_resident(const std::vector<ParamHandle*>& need, bool defer) {
    if (!residency_) {
      gather(need, defer);
      return;
    }
    py::list ids;
    for (auto* h : need) ids.append(h->ds_id);
    py::object parts = residency_->parts(ids);
    if (parts.is_none()) {  // every partition of `need` is in memory
      gather(need, defer);
      return;
    }
    for (auto& part : split_parts(need, parts)) {
      py::list part_ids;
      for (auto* h : part) part_ids.append(h->ds_id);
      residency_->before_gather(part_ids);
      gather(part, defer);
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

  // Gathers `params` (all partitioned), grouped by (process group, dtype, device, persistence) in
  // ds_id order.
  // [Note: persistent buckets] A bucket's buffer lives until its last parameter is released, and a
  // persistent parameter is never released: sharing a bucket with it would pin the whole bucket
  // (a prefetch batch: tens of millions of elements) for the engine's life. Persistent parameters
  // are gathered into buckets of their own.
  void gather(const std::vector<ParamHandle*>& params, bool defer) {
    using Key = std::tuple<c10d::ProcessGroup*, at::ScalarType, std::string, bool>;
    std::vector<Key> keys;
    std::vector<std::vector<std::pair<ParamHandle*, at::Tensor>>> groups;  // (handle, its partition)
    for (auto* h : params) {
      at::Tensor part = h->param.attr("ds_tensor").cast<at::Tensor>();
      if (part.numel() != h->partition_numel)
        throw std::runtime_error("z3ext: " + h->describe() + " has a partition of " + std::to_string(part.numel()) +
                                 " elements, expected " + std::to_string(h->partition_numel) +
                                 " (quantized or offloaded-to-NVMe partitions are not supported)");
      Key key{h->group.get(), part.scalar_type(), h->tensor.device().str(), h->persist};
      auto it = std::find(keys.begin(), keys.end(), key);
      if (it == keys.end()) {
        keys.push_back(key);
        groups.emplace_back();
        groups.back().emplace_back(h, std::move(part));
      } else {
        groups[it - keys.begin()].emplace_back(h, std::move(part));
      }
    }
    for (auto& g : groups) gather_group(g, defer);
  }

  // [Note: parameter-major buckets] A bucket's buffer holds its parameters one after another, each
  // as the `world` partitions of its padded flat tensor, so a parameter is a view of the buffer.
  // One coalesced all-gather fills it: input i is parameter i's partition itself and output i its
  // slice of the buffer. No staging buffer, no copy-in, no copy-out: on a host-bound forward each
  // copy kernel cost more launch time than bandwidth, and the staging buffer doubled the transient
  // memory of a batch. The GPU pays instead: NCCL runs a coalesced gather of several tensors at about
  // half the bandwidth of one flat buffer (bench/allgather_forms.py, bench/NOTES.md v14), which shows
  // only where the gather, not the host, bounds a forward. Partitions on another device than the
  // bucket (NVMe offload reads them into host buffers) are first copied into the rank's own block of
  // their output and gathered in place.
  void gather_group(std::vector<std::pair<ParamHandle*, at::Tensor>>& params, bool defer) {
    at::NoGradGuard no_grad;
    ParamHandle& first = *params.front().first;
    const at::Device device = first.tensor.device();
    const at::ScalarType dtype = params.front().second.scalar_type();
    const int64_t world = first.world;
    int64_t per_rank = 0;
    for (auto& hp : params) per_rank += hp.first->partition_numel;

    auto bucket = std::make_shared<Bucket>();
    // [Note: world of one] In a group of one rank a partition is its whole (padded) parameter: the
    // parameter becomes a view of it: no buffer, no copy, no stream work, no memory beyond the partition.
    // (Partitions on another device, NVMe offload's host buffers, are still copied.)
    if (world == 1) {
      bool same_device = true;
      for (auto& hp : params) same_device = same_device && hp.second.device() == device;
      if (same_device) {
        for (auto& [h, part] : params) {
          h->tensor.set_data(part.reshape({-1}).narrow(0, 0, h->numel).view(h->shape));
          adopt(*h, bucket);
        }
        stats_.gathered_params += static_cast<int64_t>(params.size());
        return;
      }
    }
    // Allocated on the compute stream: see [Note: z3ext streams].
    at::Tensor buf = pool_.acquire(world * per_rank, dtype, device);
    Fence ready;
    stream_.run(device, [&] {
      std::vector<at::Tensor> flat;
      flat.reserve(params.size());
      for (auto& hp : params) flat.push_back(hp.second.reshape({-1}));
      if (world == 1) {
        // Partitions on another device (above: same-device ones are viewed): copied back to back.
        int64_t off = 0;
        for (auto& f : flat) {
          buf.narrow(0, off, f.numel()).copy_(f, /*non_blocking=*/true);
          off += f.numel();
        }
      } else {
        std::vector<at::Tensor> outs;
        outs.reserve(params.size());
        int64_t off = 0;
        for (size_t i = 0; i < params.size(); ++i) {
          const int64_t n = params[i].first->partition_numel;
          outs.push_back(buf.narrow(0, off, world * n));
          if (flat[i].device() != device) {
            at::Tensor mine = outs.back().narrow(0, params[i].first->rank * n, n);
            mine.copy_(flat[i], /*non_blocking=*/true);
            flat[i] = mine;
          }
          off += world * n;
        }
        if (outs.size() == 1) {
          all_gather_into(*first.group, outs[0], flat[0]);
        } else {
          all_gather_coalesced_into(*first.group, outs, flat);
        }
        stats_.collectives++;
      }
      ready = Fence::record_current(device);
    });
    if (defer) {
      bucket->ready = ready;
      bucket->pending = true;
    } else {
      ready.wait_on_current(device);
    }
    bucket->buffer = buf;
    int64_t off = 0;
    for (auto& hp : params) {
      ParamHandle* h = hp.first;
      h->tensor.set_data(buf.narrow(0, off, h->numel).view(h->shape));
      adopt(*h, bucket);
      off += world * h->partition_numel;
    }
    stats_.gathered_params += static_cast<int64_t>(params.size());
    stats_.live_bytes += buf.numel() * buf.element_size();
    stats_.live_numel += buf.numel();
    stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  }

  // `h` (its data already set) is gathered into `bucket`.
  void adopt(ParamHandle& h, const std::shared_ptr<Bucket>& bucket) {
    h.param.attr("ds_status") = available_;
    h.bucket = bucket;
    bucket->live++;
    bucket->names.push_back(h.name);
  }

  void release(ParamHandle& h) {
    const at::Device device = h.tensor.device();
    // A prefetch released unused: its buffer is reusable only after the gather that wrote it.
    h.bucket->wait_ready(device);
    h.tensor.set_data(at::empty({0}, h.tensor.options()));
    h.param.attr("ds_status") = not_available_;
    std::shared_ptr<Bucket> bucket = std::move(h.bucket);
    h.bucket.reset();
    stats_.released_params++;
    if (--bucket->live == 0 && bucket->buffer.defined()) {  // no buffer: [Note: world of one]
      stats_.live_bytes -= bucket->buffer.numel() * bucket->buffer.element_size();
      stats_.live_numel -= bucket->buffer.numel();
      at::Tensor buf = std::move(bucket->buffer);
      bucket->buffer.reset();
      c10::weak_intrusive_ptr<c10::StorageImpl> storage(buf.storage().getWeakStorageImpl());
      if (!pool_.give_back(std::move(buf), Fence::record_current(device))) {
        orphans_.push_back(Orphan{std::move(bucket->names), std::move(storage)});
        // Bounded whatever the config: records whose storage died are dropped whenever the list
        // doubles since the last prune (amortised O(1) per release).
        if (orphans_.size() >= 2 * orphans_pruned_size_ + 64) {
          prune_orphans();
          orphans_pruned_size_ = orphans_.size();
        }
      }
    }
  }

  struct Orphan {
    std::vector<std::string> names;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::vector<Orphan> orphans_;
  size_t orphans_pruned_size_ = 0;

  void prune_orphans() {
    orphans_.erase(std::remove_if(orphans_.begin(), orphans_.end(),
                                  [](const Orphan& o) { return o.storage.expired(); }),
                   orphans_.end());
  }

  BufferPool pool_;
  GatherStream stream_;
  py::object available_;
  py::object not_available_;
  std::vector<HandlePtr> handles_;
  EngineStats stats_;
  std::unique_ptr<Residency> residency_;  // null: every partition is in memory
};

}  // namespace z3ext
