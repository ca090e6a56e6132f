// Gradient reduce-scatter: the mirror of the gather. A bucket of full gradients becomes this rank's
// partition of their average, written straight into the stage-3 optimizer's gradient partitions.
// [Note: gradient arithmetic] The result must equal stock DeepSpeed's bit for bit, so every step is
// the same ATen op, in the same dtype and order, as stage 3's `__avg_scatter_grads` +
// `reduce_scatter_coalesced` + `partition_grads` (DeepSpeed 0.19.8):
//   1. each gradient in the communication dtype (stock converts whole gradients, here chunk by chunk:
//      the same rounding), laid out rank-major with each parameter's chunk padded to ceil(numel/world);
//   2. `div_(world)` (stock's pre-divide inside reduce_scatter_coalesced), one op over the whole buffer
//      (stage 3 refuses gradient_predivide_factor != 1 with reduce-scatter, z3ext's only mode), or
//      after step 3 over this rank's shard ([Note: divide after the reduce]);
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
// [Note: direct slices] A slice of one gradient whose numel is a multiple of the world is its own
// rank-major layout (chunk r of the flat gradient is rank r's): it goes to the collective without a
// layout copy, divided out of place (the gradient stays intact for [Note: failed pass]) or, where the
// shard is divided after the reduce, as it is. The output is a chunk of its own for the same reason.
// [Note: divide after the reduce] Step 2 over the whole buffer is a pass of its own on the device
// (at GPT 6.7B, 13 GB read and written per step: 12 ms of a 150 ms step at simulated world 8 on an H200).
// For a power-of-two world, x / world is exact (an exponent change) and a sum's rounding is invariant
// under a power-of-two scale, so the sum of the pre-divided inputs equals the sum divided afterwards,
// bit for bit, in the same summation order (the collective's, whatever it is): the shard is divided
// after the collective, 1/world of stock's pass. Exceptions: values under the smallest normal number
// (pre-dividing rounds a subnormal quotient; dividing after keeps its bits) and sums past the largest
// finite number (an overflow stock's pre-divided sum avoids). For fp32 and bf16 (range 1e-38..3e38)
// neither occurs in gradients; fp16's range (6e-5..65504) is where they occur, so an fp16 reduction
// keeps stock's pre-divide (the caller decides: `divide_after`). Checked bitwise against stock on CPU
// with gradients of log-uniform magnitudes down to 1e-30 (tests/test_gradients.py). NCCL's PREMUL_SUM
// (the collective scaling each input) is not used: torch 2.11's `_make_nccl_premul_sum` packs the factor
// as a 4-byte float that NCCL reads 2 bytes of for a bf16 reduction (0 for every power of two: all-zero
// gradients; pytorch issue 190745).
#pragma once
#include <torch/extension.h>
#include <functional>
#include <vector>

#include "device.h"

namespace z3ext {

struct ReduceScatterResult {
  int64_t reduced;    // parameters whose partition on this rank received data
  int64_t laid_out;   // elements of the layout buffer; 0 for a direct slice or one rank ([Note: direct slices])
  int64_t writes;     // tensors written into the partitions: a run of partitions counts once ([Note: partition runs])
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

// [Note: partition runs] DeepSpeed's gradient partitions are consecutive views of one flat buffer
// (`grad_partitions_flat_buffer`, parameters in sub-group order, which is ds_id order within a sub-group),
// and a bucket's parameters sit in `mine` back to back, in ds_id order. Consecutive parameters whose
// whole partitions receive data (no padding on this rank) and lie back to back in the buffer are written
// by one copy (or add) of a range of `mine` into a range of the buffer, converted first where the
// dtypes differ: the same elements, operands and ops as one conversion and copy per parameter, without
// two or three views on the host for each parameter (a 32-layer GPT has ~390). Anything else (a
// partition with padding on this rank, a gap) is written on its own.
struct PartitionRun {
  int64_t start = 0;  // in `mine`
  int64_t len = 0;
  at::Tensor first;   // the run's first partition

  bool extends(int64_t off, const at::Tensor& dest) const {
    return len > 0 && off == start + len &&
           dest.storage().unsafeGetStorageImpl() == first.storage().unsafeGetStorageImpl() &&
           dest.storage_offset() == first.storage_offset() + len;
  }
  void close(const at::Tensor& mine, std::vector<at::Tensor>& parts, std::vector<at::Tensor>& outs) {
    if (len > 0) {
      at::Tensor part = mine.narrow(0, start, len);
      if (part.scalar_type() != first.scalar_type()) part = part.to(first.scalar_type());  // one for the run
      parts.push_back(part);
      outs.push_back(len == first.numel() ? first : first.as_strided({len}, {1}));
    }
    len = 0;
    first = at::Tensor();
  }
};

// Step 3's collective: sum-reduce-scatter `input` (world * output.numel()) into `output`, this rank's
// slice of `input`, returning once the current stream may read it. The caller passes DeepSpeed's
// `deepspeed.comm.reduce_scatter_fn`, the call stock makes, so DeepSpeed's comms logger and anything
// that counts DeepSpeed's collectives see it ([Note: comms logger] in comms.py).
using ReduceScatterFn = std::function<void(at::Tensor, at::Tensor)>;

// Step 1: `flat` laid out rank-major in `buf` ([world, per_rank]), each chunk zero-padded (stock leaves the
// padding uninitialised: it is summed and dropped): one `_chunk_cat`, FSDP2's layout kernel, so the host
// work is O(parameters), never O(parameters x world) ([Note: layout cost]). A gradient not yet in the
// communication dtype is converted whole first, as stock converts it.
inline void lay_out(at::Tensor& buf, const std::vector<at::Tensor>& flat, int64_t world, int64_t per_rank,
                    at::ScalarType comm_dtype) {
  std::vector<at::Tensor> srcs;
  srcs.reserve(flat.size());
  for (const auto& f : flat) {
    if (f.numel() > 0) srcs.push_back(f.scalar_type() == comm_dtype ? f : f.to(comm_dtype));  // empty: no columns
  }
  if (!srcs.empty()) {
    at::Tensor grid = buf.view({world, per_rank});
    at::_chunk_cat_out(grid, srcs, /*dim=*/0, /*num_chunks=*/world);
  }
}

// `grads[i]` is a full gradient (numel of the parameter), `dests[i]` this rank's gradient partition
// (at least ceil(numel/world) elements). An averaging_scale of 0 means "not applied". `divide_after`:
// divide this rank's reduced shard, not the inputs ([Note: divide after the reduce]). Runs on the
// current stream; on CUDA the gradients are marked as used by it (they were made on the compute stream).
inline ReduceScatterResult reduce_scatter_grads(const ReduceScatterFn& collective, const std::vector<at::Tensor>& grads,
                                                const std::vector<at::Tensor>& dests, int64_t rank, int64_t world,
                                                at::ScalarType comm_dtype, double averaging_scale, bool accumulate,
                                                bool divide_after) {
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
  for (size_t i = 0; i < grads.size(); ++i) flat[i] = flat_of(grads[i]);
  // [Note: world of one] One rank: no collective and nothing to lay out; stock's `div_(1)` and
  // averaging are exact identities, so each gradient goes straight into its partition (one
  // multi-tensor kernel per dtype pair where dtypes allow).
  if (world == 1 && averaging_scale == 0.0) {
    std::vector<at::Tensor> srcs, dsts;
    int64_t reduced = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (flat[i].numel() == 0) continue;
      at::Tensor src = flat[i].scalar_type() == comm_dtype ? flat[i] : flat[i].to(comm_dtype);
      at::Tensor dest = flat_of(dests[i]).narrow(0, 0, src.numel());
      if (src.scalar_type() != dest.scalar_type()) src = src.to(dest.scalar_type());
      srcs.push_back(src);
      dsts.push_back(dest);
      ++reduced;
    }
    write_partitions(dsts, srcs, accumulate);
    return {reduced, 0, static_cast<int64_t>(dsts.size())};
  }
  TORCH_CHECK(!divide_after || ((world & (world - 1)) == 0 && comm_dtype != at::kHalf),
              "z3ext reduce_scatter_grads: dividing after the reduce is exact only for a power-of-two world and "
              "not fp16, not world ", world, " in ", comm_dtype);
  at::Tensor buf, mine;
  int64_t laid_out = 0;
  if (grads.size() == 1 && flat[0].numel() == world * per_rank) {  // [Note: direct slices]
    const at::Tensor& f = flat[0];
    const bool converted = f.scalar_type() != comm_dtype;
    buf = converted ? f.to(comm_dtype) : f;
    if (!divide_after) buf = converted ? buf.div_(world) : buf.div(world);  // 2.
    mine = at::empty({per_rank}, buf.options());
    if (world > 1) collective(mine, buf);  // 3.
  } else {
    buf = at::empty({world * per_rank}, grads.front().options().dtype(comm_dtype));
    lay_out(buf, flat, world, per_rank, comm_dtype);  // 1.
    laid_out = buf.numel();
    if (!divide_after) buf.div_(world);  // 2.
    mine = buf.narrow(0, rank * per_rank, per_rank);
    if (world > 1) collective(mine, buf);  // 3.
  }
  if (divide_after) mine.div_(world);  // 2. [Note: divide after the reduce]
  // 4.
  if (averaging_scale != 0.0) mine.mul_(averaging_scale);
  // 5. [Note: partition runs]
  int64_t reduced = 0;
  std::vector<at::Tensor> parts, outs;
  PartitionRun run;
  int64_t off = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = grads[i].numel();
    const int64_t len = std::max<int64_t>(0, std::min(chunk[i], n - rank * chunk[i]));
    if (len > 0) {
      ++reduced;
      const at::Tensor& d = dests[i];
      const bool whole = len == chunk[i] && d.dim() == 1 && d.numel() == len && d.stride(0) == 1;
      if (whole && run.extends(off, d)) {
        run.len += len;
      } else {
        run.close(mine, parts, outs);
        if (whole) {
          run = PartitionRun{off, len, d};
        } else {
          at::Tensor part = mine.narrow(0, off, len);
          at::Tensor dest = flat_of(d).narrow(0, 0, len);
          if (part.scalar_type() != dest.scalar_type()) part = part.to(dest.scalar_type());
          parts.push_back(part);
          outs.push_back(dest);
        }
      }
    }
    off += chunk[i];
  }
  run.close(mine, parts, outs);
  write_partitions(outs, parts, accumulate);
  return {reduced, laid_out, static_cast<int64_t>(outs.size())};
}

}  // namespace z3ext
