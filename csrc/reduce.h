// Gradient reduce-scatter: the mirror of the gather. A bucket of full gradients becomes this rank's
// partition of their average, written straight into the stage-3 optimizer's gradient partitions.
// [Note: gradient arithmetic] The result must equal stock DeepSpeed's bit for bit, so every step is
// the same ATen op, in the same dtype and order, as stage 3's `__avg_scatter_grads` +
// `reduce_scatter_coalesced` + `partition_grads` (DeepSpeed 0.19.8):
//   1. each gradient in the communication dtype (stock converts whole gradients, here chunk by chunk:
//      the same rounding), laid out rank-major with each parameter's chunk padded to ceil(numel/world);
//   2. `div_(world)` (stock's pre-divide inside reduce_scatter_coalesced), one op over the whole buffer
//      (stage 3 refuses gradient_predivide_factor != 1 with reduce-scatter, z3ext's only mode);
//   3. one reduce-scatter (sum) for the bucket;
//   4. `mul_(averaging_scale)` when given (AutoEP experts), then the accumulation dtype;
//   5. per parameter with real data on this rank: `copy_` into its partition (first micro-step) or
//      `add_` (gradient accumulation).
// [Note: layout cost] A layout of one narrow per parameter per rank (world x parameters tensors and a
// multi-tensor copy over them) grows with the world: z3ext's backward doubled from a simulated world of 8
// to 64 on a 0.94B GPT with it. `_chunk_cat` writes the same bytes (pure copies and zeros) from the
// parameters' flat gradients in one kernel, whatever the world.
// Elementwise ops over a buffer give what per-tensor ops give, and the layout only decides which
// elements meet in the sum (the same ones on every rank: the caller sorts by ds_id).
// [Note: fused layout] Steps 1 and 2 are two passes over the whole bucket (a copy, then `div_` reading
// and writing it again): at a 6.7B GPT's world of 8, 27 GB of memory traffic per step for the divide
// alone. A gradient of at least `fused_min_numel` elements that splits evenly over the ranks and is
// already in the communication dtype is laid out by its divide: one `div_out` from its [world, chunk]
// view into its columns of the [world, per_rank] grid, the same elementwise op on the same values as
// `div_` over the buffer, so the same bits, and one pass instead of two. Its columns come after the
// `_chunk_cat` ones (same layout on every rank: chosen by size alone), which is still one kernel for
// all the small gradients, followed by `div_` over their columns only. Per such gradient it costs one
// op on the host, so only large ones take it (grads.py FUSED_LAYOUT_MIN_NUMEL).
#pragma once
#include <torch/extension.h>
#include <functional>
#include <vector>

#include "device.h"

namespace z3ext {

struct ReduceScatterResult {
  int64_t reduced;    // parameters whose partition on this rank received data
  int64_t buffer_numel;
  int64_t fused = 0;  // gradients laid out by their divide ([Note: fused layout])
};

// Step 5: `copy_` (first micro-step) or `add_` (accumulation) of each part into its partition, as
// multi-tensor kernels (elementwise, the same results as one op per tensor).
inline void write_partitions(std::vector<at::Tensor>& dests, std::vector<at::Tensor>& parts, bool accumulate) {
  if (dests.empty()) return;
  if (accumulate) {
    at::_foreach_add_(dests, parts);
  } else {
    at::_foreach_copy_(dests, parts, /*non_blocking=*/true);
  }
}

// Step 3's collective: sum-reduce-scatter `input` (world * output.numel()) into `output`, this rank's
// slice of `input`, returning once the current stream may read it. The caller passes DeepSpeed's
// `deepspeed.comm.reduce_scatter_fn`, the call stock makes, so DeepSpeed's comms logger and anything
// that counts DeepSpeed's collectives see it ([Note: comms logger] in comms.py).
using ReduceScatterFn = std::function<void(at::Tensor, at::Tensor)>;

// `grads[i]` is a full gradient (numel of the parameter), `dests[i]` this rank's gradient partition
// (at least ceil(numel/world) elements). An averaging_scale of 0 means "not applied". Runs on the
// current stream; on CUDA the gradients are marked as used by it (they were made on the compute stream).
inline ReduceScatterResult reduce_scatter_grads(const ReduceScatterFn& collective, const std::vector<at::Tensor>& grads,
                                                const std::vector<at::Tensor>& dests, int64_t rank, int64_t world,
                                                at::ScalarType comm_dtype, double averaging_scale, bool accumulate,
                                                int64_t fused_min_numel) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(grads.size() == dests.size(), "z3ext reduce_scatter_grads: ", grads.size(), " gradients but ",
              dests.size(), " partitions");
  TORCH_CHECK(!grads.empty(), "z3ext reduce_scatter_grads: empty bucket");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "z3ext reduce_scatter_grads: rank ", rank, " of ", world);
  std::vector<int64_t> chunk(grads.size());
  int64_t per_rank = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    chunk[i] = (grads[i].numel() + world - 1) / world;
    TORCH_CHECK(dests[i].numel() >= chunk[i], "z3ext reduce_scatter_grads: gradient partition of ", dests[i].numel(),
                " elements for a chunk of ", chunk[i]);
    per_rank += chunk[i];
  }
  const at::Device device = grads.front().device();
#ifdef Z3EXT_WITH_CUDA
  if (device.is_cuda()) {
    const c10::Stream current = c10::cuda::getCurrentCUDAStream(device.index());
    for (const auto& g : grads) g.record_stream(current);
  }
#endif
  std::vector<at::Tensor> flat(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) flat[i] = grads[i].reshape({-1});
  // [Note: world of one] One rank: no collective and nothing to lay out; stock's `div_(1)` and
  // averaging are exact identities, so each gradient goes straight into its partition (one
  // multi-tensor kernel per dtype pair where dtypes allow).
  if (world == 1 && averaging_scale == 0.0) {
    std::vector<at::Tensor> srcs, dsts;
    int64_t reduced = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (flat[i].numel() == 0) continue;
      at::Tensor src = flat[i].scalar_type() == comm_dtype ? flat[i] : flat[i].to(comm_dtype);
      at::Tensor dest = dests[i].reshape({-1}).narrow(0, 0, src.numel());
      if (src.scalar_type() != dest.scalar_type()) src = src.to(dest.scalar_type());
      srcs.push_back(src);
      dsts.push_back(dest);
      ++reduced;
    }
    write_partitions(dsts, srcs, accumulate);
    return {reduced, 0};
  }
  at::Tensor buf = at::empty({world * per_rank}, grads.front().options().dtype(comm_dtype));
  at::Tensor grid = buf.view({world, per_rank});
  // Columns: the `_chunk_cat` gradients first, then the fused ones ([Note: fused layout]).
  std::vector<char> fused(grads.size(), 0);
  int64_t cat_cols = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = flat[i].numel();
    fused[i] = n > 0 && n >= fused_min_numel && n % world == 0 && flat[i].scalar_type() == comm_dtype;
    if (!fused[i]) cat_cols += chunk[i];
  }
  std::vector<int64_t> col(grads.size());
  for (int64_t i = 0, cat = 0, big = cat_cols; i < static_cast<int64_t>(grads.size()); ++i) {
    col[i] = fused[i] ? big : cat;
    (fused[i] ? big : cat) += chunk[i];
  }
  // 1. rank-major layout, each chunk zero-padded (stock leaves the padding uninitialised: it is summed and
  // dropped): one `_chunk_cat` over a [world, columns] view, FSDP2's layout kernel, so the host work is
  // O(parameters), never O(parameters x world) ([Note: layout cost]). A gradient not yet in the
  // communication dtype is converted whole first, as stock converts it.
  std::vector<at::Tensor> srcs;
  srcs.reserve(flat.size());
  for (size_t i = 0; i < flat.size(); ++i) {
    const auto& f = flat[i];
    if (f.numel() > 0 && !fused[i]) srcs.push_back(f.scalar_type() == comm_dtype ? f : f.to(comm_dtype));
  }
  const bool all_cat = cat_cols == per_rank;
  if (!srcs.empty()) {
    if (all_cat) {
      at::_chunk_cat_out(grid, srcs, /*dim=*/0, /*num_chunks=*/world);
    } else {  // the fused columns follow: lay the others out in a [world, cat_cols] block, then copy it in
      at::Tensor block = at::empty({world, cat_cols}, buf.options());
      at::_chunk_cat_out(block, srcs, /*dim=*/0, /*num_chunks=*/world);
      block.div_(world);  // 2. for these columns
      grid.narrow(1, 0, cat_cols).copy_(block);
    }
  }
  // 2.
  if (all_cat) {
    buf.div_(world);
  } else {
    for (size_t i = 0; i < grads.size(); ++i)
      if (fused[i]) {
        at::Tensor cols = grid.narrow(1, col[i], chunk[i]);
        at::div_out(cols, flat[i].view({world, chunk[i]}), world);
      }
  }
  // 3.
  at::Tensor mine = buf.narrow(0, rank * per_rank, per_rank);
  if (world > 1) collective(mine, buf);
  // 4.
  if (averaging_scale != 0.0) mine.mul_(averaging_scale);
  // 5.
  int64_t reduced = 0;
  std::vector<at::Tensor> parts, outs;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = grads[i].numel();
    const int64_t len = std::max<int64_t>(0, std::min(chunk[i], n - rank * chunk[i]));
    if (len > 0) {
      at::Tensor part = mine.narrow(0, col[i], len);
      at::Tensor dest = dests[i].reshape({-1}).narrow(0, 0, len);
      if (part.scalar_type() != dest.scalar_type()) part = part.to(dest.scalar_type());
      parts.push_back(part);
      outs.push_back(dest);
      ++reduced;
    }
  }
  write_partitions(outs, parts, accumulate);
  int64_t n_fused = 0;
  for (char f : fused) n_fused += f;
  return {reduced, buf.numel(), n_fused};
}

}  // namespace z3ext
