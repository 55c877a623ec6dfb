// quantize(): one fused kernel per format reads each 128 x 128 tile of x once into shared memory
// and writes the rowwise copy (1 x b blocks, or the tile's b x b blocks) and the columnwise copy
// (b x 1 blocks stored transposed, or the transposed b x b blocks) from it. NVFP4 first reduces the
// global amax of each matrix (a max over fp32 bit patterns, so the result does not depend on the
// order of the atomics). No allocation, no synchronisation: capturable in a CUDA graph.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "device/cuda_check.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"

namespace moe {

namespace quant {
namespace {

constexpr int kTile = 128;         // tile rows and columns
constexpr int kPitch = kTile + 2;  // bf16 per shared row: odd word pitch (65), conflict-free column reads
constexpr int kThreads = 256;

struct CopyParams {
  uint8_t* data;
  void* scale;
  int64_t rows, cols, block_rows, block_cols, scale_entries;
};

struct TileParams {
  const __nv_bfloat16* x;
  int64_t M, K;
  CopyParams row, col;  // data == nullptr: copy not produced
  ScaleLayout layout;
  bool pow2;
  const float* global_amax;  // NVFP4
  uint64_t seed, offset;
};

CopyParams copy_params(const CopyArgs& a) {
  return CopyParams{static_cast<uint8_t*>(a.enabled ? a.data : nullptr), a.scale, a.rows, a.cols,
                    a.block_rows, a.block_cols, a.scale_entries};
}

template <QuantFormat F>
__device__ __forceinline__ void store_scale(const CopyParams& c, ScaleLayout layout, int64_t b, int64_t r, int64_t j,
                                            const BlockEncode& e) {
  const int64_t i = b * c.scale_entries + scale_index(layout, r, j, c.block_rows, c.block_cols);
  if constexpr (F == QuantFormat::kFP8Block)
    static_cast<float*>(c.scale)[i] = e.scale_f32;
  else
    static_cast<uint8_t*>(c.scale)[i] = e.scale_u8;
}

// Max over the lanes of aligned groups of `width` lanes (a power of two <= 32).
__device__ __forceinline__ uint32_t group_max(uint32_t v, int width) {
  for (int s = width / 2; s > 0; s /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  return v;
}

__device__ __forceinline__ float bf16_at(const uint16_t* tile, int r, int c) {
  return __uint_as_float(static_cast<uint32_t>(tile[r * kPitch + c]) << 16);
}

template <QuantFormat F, bool kTwoD, bool kSR>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(TileParams p) {
  constexpr int kB = F == QuantFormat::kFP8Block ? 128 : (F == QuantFormat::kMXFP8 ? 32 : 16);
  constexpr int kBlocksPerSide = kTile / kB;  // 2-D blocks per tile side: 1 (FP8) or 8 (NVFP4)
  constexpr int kChunksPerRow = kTile / 8;    // 16-byte chunks of 8 bf16
  constexpr int kGroup = kB / 8;              // lanes sharing a 1 x b block in the rowwise pass
  __shared__ __align__(16) uint16_t tile[kTile * kPitch];
  __shared__ uint32_t blk_amax[kTwoD ? kBlocksPerSide * kBlocksPerSide : 1];
  __shared__ float blk_factor[kTwoD ? kBlocksPerSide * kBlocksPerSide : 1];

  const int64_t b = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[b]) : 1.0f;
  const __nv_bfloat16* xb = p.x + b * p.M * p.K;

  if (kTwoD && tid < kBlocksPerSide * kBlocksPerSide) blk_amax[tid] = 0;
  // Load the tile (zeros outside x: they never raise an amax).
  for (int id = tid; id < kTile * kChunksPerRow; id += kThreads) {
    const int r = id / kChunksPerRow, c = (id % kChunksPerRow) * 8;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m0 + r < p.M && k0 + c < p.K) v = *reinterpret_cast<const uint4*>(xb + (m0 + r) * p.K + k0 + c);
    uint32_t* dst = reinterpret_cast<uint32_t*>(tile + r * kPitch + c);  // 4-byte aligned (pitch 260 bytes)
    dst[0] = v.x;
    dst[1] = v.y;
    dst[2] = v.z;
    dst[3] = v.w;
  }
  __syncthreads();

  if constexpr (kTwoD) {
    for (int id = tid; id < kTile * kChunksPerRow; id += kThreads) {
      const int r = id / kChunksPerRow, c = (id % kChunksPerRow) * 8;
      uint32_t a = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) a = max(a, abs_bits(bf16_at(tile, r, c + i)));
      atomicMax(&blk_amax[(r / kB) * kBlocksPerSide + c / kB], a);  // order-independent
    }
    __syncthreads();
    if (tid < kBlocksPerSide * kBlocksPerSide) {
      const int br = tid / kBlocksPerSide, bc = tid % kBlocksPerSide;
      const BlockEncode e = block_encode<F>(__uint_as_float(blk_amax[tid]), p.pow2, S);
      blk_factor[tid] = e.factor;
      const int64_t gr = m0 / kB + br, gc = k0 / kB + bc;  // block coordinates in the matrix
      if (gr * kB < p.M && gc * kB < p.K) {
        if (p.row.data) store_scale<F>(p.row, p.layout, b, gr, gc, e);
        if (p.col.data) store_scale<F>(p.col, p.layout, b, gc, gr, e);
      }
    }
    __syncthreads();
  }

  // Rowwise copy: each thread one chunk of 8 elements per step; 1-D blocks are kGroup lanes.
  if (p.row.data) {
    for (int id = tid; id < kTile * kChunksPerRow; id += kThreads) {
      const int r = id / kChunksPerRow, c = (id % kChunksPerRow) * 8;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = bf16_at(tile, r, c + i);
      const int64_t m = m0 + r, k = k0 + c;
      float factor;
      if constexpr (kTwoD) {
        factor = blk_factor[(r / kB) * kBlocksPerSide + c / kB];
      } else {
        uint32_t a = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) a = max(a, abs_bits(v[i]));
        a = group_max(a, kGroup);  // every lane takes part: the loop trip count is uniform
        const BlockEncode e = block_encode<F>(__uint_as_float(a), p.pow2, S);
        factor = e.factor;
        if ((id % kGroup) == 0 && m < p.M && k < p.K) store_scale<F>(p.row, p.layout, b, m, k / kB, e);
      }
      if (m >= p.M || k >= p.K) continue;
      const int64_t pos = (b * p.M + m) * p.K + k;  // flat position of the first element
      if constexpr (F == QuantFormat::kNVFP4) {
        uint32_t packed = 0;
        if constexpr (kSR) {
          const Philox4 r0 = sr_bits4(p.seed, p.offset, 0, static_cast<uint64_t>(pos) / 4);
          const Philox4 r1 = sr_bits4(p.seed, p.offset, 0, static_cast<uint64_t>(pos) / 4 + 1);
#pragma unroll
          for (int i = 0; i < 8; ++i)
            packed |= static_cast<uint32_t>(e2m1_from_float_sr(__fmul_rn(v[i], factor), i < 4 ? r0.v[i] : r1.v[i - 4]))
                      << (4 * i);
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            packed |= static_cast<uint32_t>(e2m1_from_float_rn(__fmul_rn(v[i], factor))) << (4 * i);
        }
        *reinterpret_cast<uint32_t*>(p.row.data + pos / 2) = packed;
      } else {
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          lo |= static_cast<uint32_t>(encode_e4m3(v[i], factor)) << (8 * i);
          hi |= static_cast<uint32_t>(encode_e4m3(v[i + 4], factor)) << (8 * i);
        }
        *reinterpret_cast<uint2*>(p.row.data + pos) = make_uint2(lo, hi);
      }
    }
  }

  // Columnwise copy: a warp per column of the tile, lane l holding rows l, l + 32, l + 64, l + 96;
  // the copy is stored [K, M], so a column of x is a row of the copy.
  if (p.col.data) {
    for (int kk = warp; kk < kTile; kk += kThreads / 32) {
      const int64_t k = k0 + kk;
      if (k >= p.K) break;  // uniform over the warp
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = bf16_at(tile, lane + 32 * i, kk);
      float factor[4];
      if constexpr (kTwoD) {
#pragma unroll
        for (int i = 0; i < 4; ++i) factor[i] = blk_factor[((lane + 32 * i) / kB) * kBlocksPerSide + kk / kB];
      } else if constexpr (kB == 128) {
        uint32_t a = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) a = max(a, abs_bits(v[i]));
        a = group_max(a, 32);
        const BlockEncode e = block_encode<F>(__uint_as_float(a), p.pow2, S);
        if (lane == 0) store_scale<F>(p.col, p.layout, b, k, m0 / kB, e);
#pragma unroll
        for (int i = 0; i < 4; ++i) factor[i] = e.factor;
      } else {
        constexpr int kWidth = kB;  // 32 (MXFP8) or 16 (NVFP4) lanes per block
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t a = group_max(abs_bits(v[i]), kWidth);
          const BlockEncode e = block_encode<F>(__uint_as_float(a), p.pow2, S);
          const int64_t m = m0 + lane + 32 * i;
          if (lane % kWidth == 0 && m < p.M) store_scale<F>(p.col, p.layout, b, k, m / kB, e);
          factor[i] = e.factor;
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t m = m0 + lane + 32 * i;
        const int64_t pos = (b * p.K + k) * p.M + m;  // position in the columnwise copy
        if constexpr (F == QuantFormat::kNVFP4) {
          uint32_t nib;
          if constexpr (kSR) {
            // 2-D blocks round both copies with the rowwise position's bits (exact transpose).
            const uint64_t idx = kTwoD ? static_cast<uint64_t>((b * p.M + m) * p.K + k) : static_cast<uint64_t>(pos);
            const Philox4 r = sr_bits4(p.seed, p.offset, kTwoD ? 0 : 1, idx / 4);
            nib = e2m1_from_float_sr(__fmul_rn(v[i], factor[i]), r.v[idx % 4]);
          } else {
            nib = e2m1_from_float_rn(__fmul_rn(v[i], factor[i]));
          }
          const uint32_t odd = __shfl_down_sync(0xFFFFFFFFu, nib, 1);  // M % 16 == 0: pairs never straddle
          if (lane % 2 == 0 && m < p.M) p.col.data[pos / 2] = static_cast<uint8_t>(nib | (odd << 4));
        } else {
          if (m < p.M) p.col.data[pos] = encode_e4m3(v[i], factor[i]);
        }
      }
    }
  }
}

// Per-matrix global amax (NVFP4): max of |x| bit patterns, atomicMax into a zeroed word.
__global__ void __launch_bounds__(kThreads) global_amax_kernel(const __nv_bfloat16* x, int64_t per_matrix,
                                                                float* amax) {
  const int64_t b = blockIdx.y;
  const uint4* v = reinterpret_cast<const uint4*>(x + b * per_matrix);
  const int64_t n = per_matrix / 8;
  uint32_t a = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint4 w = v[i];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // two bf16 per word; |x| as fp32 bits
      a = max(a, (words[j] << 16) & 0x7FFFFFFFu);
      a = max(a, words[j] & 0x7FFF0000u);
    }
  }
  a = __reduce_max_sync(0xFFFFFFFFu, a);
  __shared__ uint32_t warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = a;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) a = max(a, warp_max[w]);
    atomicMax(reinterpret_cast<unsigned int*>(amax + b), a);
  }
}

template <QuantFormat F, bool kTwoD, bool kSR>
void launch_tile(const TileParams& p, int64_t B, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.K + kTile - 1) / kTile), static_cast<unsigned>((p.M + kTile - 1) / kTile),
                  static_cast<unsigned>(B));
  quantize_tile_kernel<F, kTwoD, kSR><<<grid, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

int sm_count() {
  int dev = 0, sms = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

}  // namespace
}  // namespace quant

void quantize(const QuantConfig& config, const TensorView& x, const QuantizedTensor& out, cudaStream_t stream) {
  using namespace quant;
  const QuantArgs a = check_quantize_args(config, x, out);
  const int scale_bytes = config.format == QuantFormat::kFP8Block ? 4 : 1;
  // Layout padding is part of the output: zero it (a memset node when captured).
  for (const CopyArgs* c : {&a.row, &a.col})
    if (c->enabled && c->scale_padded && a.B > 0)
      MOE_CUDA_CHECK(cudaMemsetAsync(c->scale, 0, static_cast<size_t>(a.B * c->scale_entries * scale_bytes), stream));
  if (config.format == QuantFormat::kNVFP4 && a.B > 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(a.global_amax, 0, static_cast<size_t>(a.B) * sizeof(float), stream));
    const int64_t per_matrix = a.M * a.K;
    if (per_matrix > 0) {
      const int64_t want = (per_matrix / 8 + kThreads - 1) / kThreads;
      const int64_t cap = std::max<int64_t>(1, 4 * sm_count() / std::max<int64_t>(1, a.B));
      const dim3 grid(static_cast<unsigned>(std::min(want, cap)), static_cast<unsigned>(a.B));
      global_amax_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(a.x), per_matrix,
                                                          a.global_amax);
      MOE_CUDA_CHECK_LAUNCH();
    }
  }
  if (a.B == 0 || a.M == 0 || a.K == 0) return;
  TileParams p;
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.M = a.M;
  p.K = a.K;
  p.row = copy_params(a.row);
  p.col = copy_params(a.col);
  p.layout = config.scale_layout;
  p.pow2 = config.pow2_scale;
  p.global_amax = a.global_amax;
  p.seed = config.seed;
  p.offset = config.offset;
  const bool two_d = config.blocking == QuantBlocking::k2D;
  switch (config.format) {
    case QuantFormat::kFP8Block:
      two_d ? launch_tile<QuantFormat::kFP8Block, true, false>(p, a.B, stream)
            : launch_tile<QuantFormat::kFP8Block, false, false>(p, a.B, stream);
      break;
    case QuantFormat::kMXFP8:
      launch_tile<QuantFormat::kMXFP8, false, false>(p, a.B, stream);
      break;
    case QuantFormat::kNVFP4:
      if (config.stochastic_rounding)
        two_d ? launch_tile<QuantFormat::kNVFP4, true, true>(p, a.B, stream)
              : launch_tile<QuantFormat::kNVFP4, false, true>(p, a.B, stream);
      else
        two_d ? launch_tile<QuantFormat::kNVFP4, true, false>(p, a.B, stream)
              : launch_tile<QuantFormat::kNVFP4, false, false>(p, a.B, stream);
      break;
  }
}

}  // namespace moe
