// quantize(): x is read once, with 16-byte vector loads, and quantized from registers.
//
// - Rowwise copy only, 1-D blocks (activations): quantize_rows_kernel. A block of b elements of a
//   row is b / 8 consecutive lanes, each holding one 16-byte vector (8 bf16): the block amax is a
//   shuffle reduction inside those lanes, each lane stores its 8 codes (8 bytes FP8, 4 bytes FP4)
//   and the block's first lane the scale (NVFP4: a lane holds a whole 1 x 16 block). A warp covers
//   512 contiguous bytes of x per load; the grid is one pass over the blocks (launch_geometry.h),
//   two blocks per lane in flight.
// - Anything with a columnwise copy or 2-D blocks: quantize_tile_kernel (quantize_tile.cuh, shared
//   with the fused activation quantize), one 128 x 128 tile of x per CTA. The tile is loaded into registers (8 vectors per thread) and stored to shared memory
//   (16-byte chunks, XOR-swizzled so that both the stores and the column reads are free of bank
//   conflicts). After one barrier the rowwise copy is quantized from shared memory, 16 elements
//   per thread, and each lane reads 16 consecutive rows of two adjacent columns (one 32-bit word
//   per row), so a columnwise block (128, 32 or 16 rows) is 8, 2 or 1 lanes of a warp and its amax
//   a shuffle reduction, and the lane stores 16 codes of each column as one 16-byte (FP8) or 8-byte
//   (FP4) vector. 2-D blocks take their factors from the tile's block amaxes (a 16 x 16 NVFP4
//   block is one warp's load).
// - NVFP4 first reduces the global amax of each matrix (a read of x at full bandwidth; a max over
//   fp32 bit patterns, so the result does not depend on the order of the atomics).
// No allocation, no synchronisation: capturable in a CUDA graph.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"
#include "quant/quantize_tile.cuh"
#include "quant/quantize_fp32.h"

namespace moe {

namespace quant {
namespace {

constexpr int kRowUnroll = 2;  // blocks per lane in flight in quantize_rows_kernel

// ---- rowwise copy, 1-D blocks ----------------------------------------------------------------

// Chunks of 8 elements per lane: NVFP4 gives each lane a whole 1 x 16 block (two chunks), so the
// block amax needs no shuffle and the block's scale arithmetic runs once per 16 elements (the
// kernel is bound by instruction issue there, not by memory); FP8 and MXFP8 blocks are 16 and 4
// lanes of one chunk.
template <QuantFormat F>
constexpr int row_lane_chunks() {
  return F == QuantFormat::kNVFP4 ? 2 : 1;
}

// Grid (x: CTAs per matrix, y: matrix). A task is one 1 x b block (row m, block j) of a matrix.
// A CTA takes kRowUnroll * G consecutive tasks (G lane groups per CTA; a group is kGroup lanes),
// group g tasks g, g + G, ... of them, all loads in flight before the stores; with a capped grid
// it moves on by the grid's span. The task's (m, j) is carried from one task to the next by
// adding (G / block_cols, G % block_cols) with a carry. The loop bound is uniform over the CTA,
// so the shuffles always see every lane; tasks past the end compute on zeros and store nothing.
template <QuantFormat F, bool kSR>
__global__ void __launch_bounds__(kThreads, kSR ? 3 : 5) quantize_rows_kernel(QuantParams p) {
  constexpr int kB = block_len<F>();
  constexpr int kLaneChunks = row_lane_chunks<F>();
  constexpr int kGroup = kB / (8 * kLaneChunks);  // lanes per block
  constexpr int kGroupsPerCta = kThreads / kGroup;
  constexpr int kTasksPerCta = kRowUnroll * kGroupsPerCta;
  const int64_t b = blockIdx.y;
  const int64_t bc = p.row.block_cols;
  const int64_t tasks = p.M * bc;
  const int sub = threadIdx.x % kGroup;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[b]) : 1.0f;
  const uint16_t* xb = p.x + b * p.M * p.K;
  const int64_t step_m = kGroupsPerCta / bc, step_j = kGroupsPerCta % bc;
  for (int64_t cta_first = static_cast<int64_t>(blockIdx.x) * kTasksPerCta; cta_first < tasks;
       cta_first += static_cast<int64_t>(gridDim.x) * kTasksPerCta) {
    const int64_t t = cta_first + threadIdx.x / kGroup;  // the group's first task
    int64_t m = t / bc, j = t % bc;
    uint4 v[kRowUnroll][kLaneChunks];
    int64_t tm[kRowUnroll], tj[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      tm[u] = m;
      tj[u] = j;
      const int64_t k = (j * kGroup + sub) * 8 * kLaneChunks;
#pragma unroll
      for (int c = 0; c < kLaneChunks; ++c) {
        v[u][c] = make_uint4(0, 0, 0, 0);
        if (t + u * kGroupsPerCta < tasks && k + 8 * c < p.K) v[u][c] = load_chunk(xb + m * p.K + k + 8 * c);
      }
      m += step_m;
      j += step_j;
      if (j >= bc) {
        j -= bc;
        ++m;
      }
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      uint32_t a = chunk_amax_bits(v[u][0]);
#pragma unroll
      for (int c = 1; c < kLaneChunks; ++c) a = max(a, chunk_amax_bits(v[u][c]));
      const float amax = __uint_as_float(group_max<kGroup>(a));
      const BlockEncode e = block_encode<F>(amax, p.pow2, S);
      if (t + u * kGroupsPerCta >= tasks) continue;  // after the shuffle
      const int64_t k = (tj[u] * kGroup + sub) * 8 * kLaneChunks;
      if (sub == 0) store_block_scale<F>(p.row, b, tm[u], tj[u], e);
      const int64_t pos = (b * p.M + tm[u]) * p.K + k;
      if constexpr (kLaneChunks == 2) {
        // NVFP4 (K % 16 == 0): the block's 16 codes.
        store_fp4_block(p, pos, fp4_chunk_codes<kSR>(p, v[u][0], e.factor, pos),
                        fp4_chunk_codes<kSR>(p, v[u][1], e.factor, pos + 8));
      } else if (k < p.K) {
        *reinterpret_cast<uint2*>(p.row.data + pos) = fp8_chunk_codes(v[u][0], e.factor);
      }
    }
  }
}

// ---- NVFP4 global amax -----------------------------------------------------------------------

// Grid (x: CTAs per matrix, y: matrix): max of |x| bit patterns over 16-byte vectors, four loads
// in flight per thread, then one atomicMax per CTA into the zeroed word of the matrix.
__global__ void __launch_bounds__(kThreads) global_amax_kernel(const uint16_t* x, int64_t chunks_per_matrix,
                                                                float* amax) {
  constexpr int kUnroll = 4;
  const int64_t b = blockIdx.y;
  const uint16_t* xb = x + b * chunks_per_matrix * 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  uint32_t a = 0;  // two 16-bit halves
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < chunks_per_matrix;
       i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = i + u * stride < chunks_per_matrix ? load_chunk(xb + (i + u * stride) * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      a = abs_max_pairs(a, v[u].x);
      a = abs_max_pairs(a, v[u].y);
      a = abs_max_pairs(a, v[u].z);
      a = abs_max_pairs(a, v[u].w);
    }
  }
  uint32_t bits = __reduce_max_sync(0xFFFFFFFFu, pairs_amax_bits(a));
  __shared__ uint32_t warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) bits = max(bits, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax + b), bits);
  }
}

template <QuantFormat F, bool kSR>
void launch_rows(const QuantParams& p, int64_t B, cudaStream_t stream) {
  constexpr int kGroup = block_len<F>() / (8 * row_lane_chunks<F>());
  const int64_t tasks = p.M * p.row.block_cols;
  const dim3 grid(one_pass_grid_x(tasks, kRowUnroll * (kThreads / kGroup)), static_cast<unsigned>(B));
  quantize_rows_kernel<F, kSR><<<grid, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

template <QuantFormat F, bool kSR>
void launch_format(const QuantParams& p, bool two_d, int64_t B, cudaStream_t stream) {
  if (!two_d && !p.col.data)
    launch_rows<F, kSR>(p, B, stream);
  else if (two_d)
    launch_tile<F, F != QuantFormat::kMXFP8, kSR>(p, B, stream);  // MXFP8 has no 2-D blocks (validated)
  else
    launch_tile<F, false, kSR>(p, B, stream);
}

}  // namespace
}  // namespace quant

void quantize(const QuantConfig& config, const TensorView& x, const QuantizedTensor& out, cudaStream_t stream) {
  using namespace quant;
  const QuantArgs a = check_quantize_args(config, x, out);
  zero_scale_padding(config, a, stream);
  if (config.format == QuantFormat::kNVFP4 && a.B > 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(a.global_amax, 0, static_cast<size_t>(a.B) * sizeof(float), stream));
    const int64_t chunks = a.M * a.K / 8;  // K % 8 == 0
    if (a.x_fp32) {
      global_amax_fp32(a, stream);
    } else if (chunks > 0) {
      const dim3 grid(one_wave_grid_x(reinterpret_cast<const void*>(global_amax_kernel), kThreads, chunks, 4 * kThreads,
                                      a.B),
                      static_cast<unsigned>(a.B));
      global_amax_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const uint16_t*>(a.x), chunks, a.global_amax);
      MOE_CUDA_CHECK_LAUNCH();
    }
  }
  if (a.B == 0 || a.M == 0 || a.K == 0) return;
  if (a.x_fp32) {
    if (config.format == QuantFormat::kFP8Block && config.blocking == QuantBlocking::k2D)
      return quantize_fp32_tiles(a, config.pow2_scale, stream);
    return quantize_fp32_blocks(a, config, stream);
  }
  const QuantParams p = quant_params(config, a);
  const bool two_d = config.blocking == QuantBlocking::k2D;
  switch (config.format) {
    case QuantFormat::kFP8Block:
      launch_format<QuantFormat::kFP8Block, false>(p, two_d, a.B, stream);
      break;
    case QuantFormat::kMXFP8:
      launch_format<QuantFormat::kMXFP8, false>(p, two_d, a.B, stream);
      break;
    case QuantFormat::kNVFP4:
      if (config.stochastic_rounding)
        launch_format<QuantFormat::kNVFP4, true>(p, two_d, a.B, stream);
      else
        launch_format<QuantFormat::kNVFP4, false>(p, two_d, a.B, stream);
      break;
  }
}

}  // namespace moe
