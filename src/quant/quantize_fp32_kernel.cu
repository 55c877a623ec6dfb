// quantize() of fp32 x: fp32 master weights straight into the quantized copies the GEMMs read
// (quantized primary weights), without a bf16 rounding on the way.
//
// FP8 block 128x128 (quantize_fp32_tile_kernel): one CTA per 128 x 128 tile (= one block): each
// thread loads 16 float4 of the tile, the block's amax is a max over |x| bit patterns
// (NaN-propagating, order-independent), and the thread encodes its own values into the rowwise
// copy. With 2-D blocks the columnwise copy is the exact transpose of the rowwise codes (one scale
// per tile), so the codes go through shared memory once and are stored again along the tile's
// columns, 16 bytes per store where M allows.
//
// Every other format and blocking (quantize_fp32_block_kernel): one thread per block -- a 1 x b
// block of a row (rowwise), a b x 1 block of a column (columnwise) or a 16 x 16 block (NVFP4 2-D,
// both copies) -- reads its values twice (amax, then encode; the second read hits L1 / L2). Master
// weights are quantized once per optimizer step, so this simple form is enough. NVFP4 first
// reduces each matrix's global amax over the fp32 values.
//
// No allocation, no synchronisation: capturable in a CUDA graph.
#include <cstdint>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "quant/quant_device.cuh"
#include "quant/quantize_fp32.h"

namespace moe::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;
constexpr int kVecPerThread = kTile * kTile / 4 / kThreads;  // float4 loads: 16

// The code tile in shared memory: row r is 32 words; word w of row r sits at w ^ swizzle(r). A
// column read (below) touches rows 16 g + t of 8 groups g at once: the swizzle puts them in 8
// different banks.
__device__ __forceinline__ int code_swizzle(int r) { return (r >> 4) & 7; }

struct Fp32TileParams {
  const float* x;
  int64_t M, K;
  uint8_t *row, *col;  // nullptr: copy not produced
  float *row_scale, *col_scale;
  int64_t row_scale_cols, col_scale_cols;  // row-major scale tensors [row blocks, column blocks]
  bool col_vec;                            // columnwise rows start 16-byte aligned (M % 16 == 0)
  bool pow2;
};

__global__ void __launch_bounds__(kThreads) quantize_fp32_tile_kernel(Fp32TileParams p) {
  __shared__ uint32_t codes[kTile * kTile / 4];
  __shared__ uint32_t warp_amax[kThreads / 32];
  const int64_t b = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile, k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float* xb = p.x + b * p.M * p.K;

  // Load i of a thread: tile row tid / 32 + 8 i, columns 4 (tid % 32) .. + 3 (a warp reads 512
  // contiguous bytes of one row).
  float4 v[kVecPerThread];
  uint32_t a = 0;
#pragma unroll
  for (int i = 0; i < kVecPerThread; ++i) {
    const int64_t m = m0 + tid / 32 + 8 * i, k = k0 + 4 * lane;
    v[i] = make_float4(0.f, 0.f, 0.f, 0.f);  // outside x: zeros never raise the amax
    if (m < p.M && k < p.K) v[i] = __ldg(reinterpret_cast<const float4*>(xb + m * p.K + k));  // K % 8 == 0
    a = max(a, max(max(__float_as_uint(v[i].x) & 0x7FFFFFFFu, __float_as_uint(v[i].y) & 0x7FFFFFFFu),
                   max(__float_as_uint(v[i].z) & 0x7FFFFFFFu, __float_as_uint(v[i].w) & 0x7FFFFFFFu)));
  }
  a = __reduce_max_sync(0xFFFFFFFFu, a);
  if (lane == 0) warp_amax[warp] = a;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) a = max(a, warp_amax[w]);
  const BlockEncode e = block_encode<QuantFormat::kFP8Block>(__uint_as_float(a), p.pow2, 1.0f);
  if (tid == 0) {
    const int64_t gr = m0 / kTile, gc = k0 / kTile;
    const int64_t row_blocks = (p.M + kTile - 1) / kTile, col_blocks = (p.K + kTile - 1) / kTile;
    if (p.row) p.row_scale[b * row_blocks * p.row_scale_cols + gr * p.row_scale_cols + gc] = e.scale_f32;
    if (p.col) p.col_scale[b * col_blocks * p.col_scale_cols + gc * p.col_scale_cols + gr] = e.scale_f32;
  }

#pragma unroll
  for (int i = 0; i < kVecPerThread; ++i) {
    const int r = tid / 32 + 8 * i;
    const int64_t m = m0 + r, k = k0 + 4 * lane;
    const uint32_t q = encode_e4m3x4(v[i].x, v[i].y, v[i].z, v[i].w, e.factor);
    if (p.row && m < p.M && k < p.K) *reinterpret_cast<uint32_t*>(p.row + (b * p.M + m) * p.K + k) = q;
    if (p.col) codes[r * 32 + (lane ^ code_swizzle(r))] = q;
  }
  if (!p.col) return;
  __syncthreads();

  // Columnwise copy [K, M]: store j of a thread writes tile column c = tid / 8 + 32 j, rows
  // 16 (tid % 8) .. + 15, gathered from the code tile's column (4 threads share each word read).
#pragma unroll
  for (int j = 0; j < kTile / 32; ++j) {
    const int c = tid / 8 + 32 * j, r0 = 16 * (tid % 8);
    const int64_t k = k0 + c, m = m0 + r0;
    if (k >= p.K || m >= p.M) continue;
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int t = 0; t < 16; ++t) {
      const int r = r0 + t;
      const uint32_t word = codes[r * 32 + ((c / 4) ^ code_swizzle(r))];
      w[t / 4] |= ((word >> (8 * (c % 4))) & 0xFFu) << (8 * (t % 4));
    }
    uint8_t* dst = p.col + (b * p.K + k) * p.M + m;
    if (p.col_vec && m + 16 <= p.M) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int t = 0; t < 16 && m + t < p.M; ++t) dst[t] = static_cast<uint8_t>(w[t / 4] >> (8 * (t % 4)));
    }
  }
}

// ---- any format, one thread per block ----------------------------------------------------------

struct Fp32BlockParams {
  const float* x;
  int64_t M, K;
  CopyArgs row, col;  // enabled copies: data, scale, layout, block grid, scale entries per matrix
  bool two_d, pow2;
  const float* global_amax;  // NVFP4, one per matrix
};

// Element (r, col) of one copy [rows, cols] of matrix b: its code at the packed position.
template <QuantFormat F>
__device__ __forceinline__ void store_code(const CopyArgs& c, int64_t b, int64_t r, int64_t col, float v,
                                           float factor) {
  const int64_t pos = (b * c.rows + r) * c.cols + col;
  uint8_t* data = static_cast<uint8_t*>(c.data);
  if constexpr (F == QuantFormat::kNVFP4) {
    const uint8_t nib = e2m1_from_float_rn(__fmul_rn(v, factor));
    // Both nibbles of a byte belong to one block (blocks start at even positions), so the thread
    // that owns the block owns the byte: a read-modify-write without races.
    uint8_t& byte = data[pos / 2];
    byte = pos % 2 == 0 ? static_cast<uint8_t>((byte & 0xF0u) | nib) : static_cast<uint8_t>((byte & 0x0Fu) | (nib << 4));
  } else {
    data[pos] = encode_e4m3(v, factor);
  }
}

// Tasks of one matrix, in order: the rowwise copy's blocks (1-D: M x ceil(K / b); 2-D: the
// ceil(M / b) x ceil(K / b) tiles, which write both copies), then the columnwise copy's 1-D blocks
// (K x ceil(M / b)).
template <QuantFormat F>
__global__ void __launch_bounds__(kThreads) quantize_fp32_block_kernel(Fp32BlockParams p) {
  constexpr int kB = block_len<F>();
  const int64_t b = blockIdx.y;
  const float* xb = p.x + b * p.M * p.K;
  const int64_t mb = (p.M + kB - 1) / kB, kb = (p.K + kB - 1) / kB;
  const int64_t row_tasks = p.two_d ? mb * kb : (p.row.enabled ? p.M * kb : 0);
  const int64_t col_tasks = !p.two_d && p.col.enabled ? p.K * mb : 0;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[b]) : 1.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < row_tasks + col_tasks; t += stride) {
    // The block: rows [m0, m1) x columns [k0, k1) of x.
    int64_t m0, m1, k0, k1;
    if (t < row_tasks && p.two_d) {
      m0 = t / kb * kB, k0 = t % kb * kB, m1 = min(p.M, m0 + kB), k1 = min(p.K, k0 + kB);
    } else if (t < row_tasks) {
      m0 = t / kb, m1 = m0 + 1, k0 = t % kb * kB, k1 = min(p.K, k0 + kB);
    } else {
      const int64_t u = t - row_tasks;
      k0 = u / mb, k1 = k0 + 1, m0 = u % mb * kB, m1 = min(p.M, m0 + kB);
    }
    uint32_t amax = 0;
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = k0; k < k1; ++k) amax = max(amax, abs_bits(__ldg(xb + m * p.K + k)));
    const BlockEncode e = block_encode<F>(__uint_as_float(amax), p.pow2, S);
    if (t < row_tasks) {
      if (p.row.enabled) store_block_scale<F>(p.row, b, p.two_d ? m0 / kB : m0, k0 / kB, e);
      if (p.two_d && p.col.enabled) store_block_scale<F>(p.col, b, k0 / kB, m0 / kB, e);
    } else {
      store_block_scale<F>(p.col, b, k0, m0 / kB, e);
    }
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = k0; k < k1; ++k) {
        const float v = __ldg(xb + m * p.K + k);
        if (t < row_tasks) {
          if (p.row.enabled) store_code<F>(p.row, b, m, k, v, e.factor);
          if (p.two_d && p.col.enabled) store_code<F>(p.col, b, k, m, v, e.factor);
        } else {
          store_code<F>(p.col, b, k, m, v, e.factor);
        }
      }
  }
}

// Grid (x: CTAs per matrix, y: matrix): the max of |x| bit patterns of each fp32 matrix, one
// atomicMax per warp into the matrix's zeroed word.
__global__ void __launch_bounds__(kThreads) global_amax_fp32_kernel(const float* x, int64_t per_matrix, float* amax) {
  const int64_t b = blockIdx.y;
  const float* xb = x + b * per_matrix;
  uint32_t a = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < per_matrix;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    a = max(a, abs_bits(__ldg(xb + i)));
  a = __reduce_max_sync(0xFFFFFFFFu, a);
  if (threadIdx.x % 32 == 0 && a != 0) atomicMax(reinterpret_cast<unsigned int*>(amax + b), a);
}

template <QuantFormat F>
void launch_blocks(const Fp32BlockParams& p, int64_t B, cudaStream_t stream) {
  constexpr int kB = block_len<F>();
  const int64_t mb = (p.M + kB - 1) / kB, kb = (p.K + kB - 1) / kB;
  const int64_t tasks = (p.two_d ? mb * kb : (p.row.enabled ? p.M * kb : 0)) + (!p.two_d && p.col.enabled ? p.K * mb : 0);
  const auto kernel = quantize_fp32_block_kernel<F>;
  const dim3 grid(one_wave_grid_x(reinterpret_cast<const void*>(kernel), kThreads, tasks, kThreads, B),
                  static_cast<unsigned>(B));
  kernel<<<grid, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_fp32_tiles(const QuantArgs& a, bool pow2, cudaStream_t stream) {
  Fp32TileParams p;
  p.x = static_cast<const float*>(a.x);
  p.M = a.M;
  p.K = a.K;
  p.row = a.row.enabled ? static_cast<uint8_t*>(a.row.data) : nullptr;
  p.col = a.col.enabled ? static_cast<uint8_t*>(a.col.data) : nullptr;
  p.row_scale = static_cast<float*>(a.row.scale);
  p.col_scale = static_cast<float*>(a.col.scale);
  p.row_scale_cols = a.row.block_cols;
  p.col_scale_cols = a.col.block_cols;
  p.col_vec = a.col.enabled && a.M % 16 == 0 && reinterpret_cast<uintptr_t>(a.col.data) % 16 == 0;
  p.pow2 = pow2;
  const dim3 grid(static_cast<unsigned>((a.K + kTile - 1) / kTile), static_cast<unsigned>((a.M + kTile - 1) / kTile),
                  static_cast<unsigned>(a.B));
  quantize_fp32_tile_kernel<<<grid, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void quantize_fp32_blocks(const QuantArgs& a, const QuantConfig& c, cudaStream_t stream) {
  Fp32BlockParams p;
  p.x = static_cast<const float*>(a.x);
  p.M = a.M;
  p.K = a.K;
  p.row = a.row;
  p.col = a.col;
  p.two_d = c.blocking == QuantBlocking::k2D;
  p.pow2 = c.pow2_scale;
  p.global_amax = a.global_amax;
  switch (c.format) {
    case QuantFormat::kFP8Block: return launch_blocks<QuantFormat::kFP8Block>(p, a.B, stream);
    case QuantFormat::kMXFP8: return launch_blocks<QuantFormat::kMXFP8>(p, a.B, stream);
    case QuantFormat::kNVFP4: return launch_blocks<QuantFormat::kNVFP4>(p, a.B, stream);
  }
}

void global_amax_fp32(const QuantArgs& a, cudaStream_t stream) {
  const int64_t per_matrix = a.M * a.K;
  if (per_matrix == 0) return;
  const dim3 grid(
      one_wave_grid_x(reinterpret_cast<const void*>(global_amax_fp32_kernel), kThreads, per_matrix, kThreads, a.B),
      static_cast<unsigned>(a.B));
  global_amax_fp32_kernel<<<grid, kThreads, 0, stream>>>(static_cast<const float*>(a.x), per_matrix, a.global_amax);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::quant
