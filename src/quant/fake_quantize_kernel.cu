// fake_quantize_groups(): quantize-dequantize of token operands, each expert group a matrix of its
// own (see fake_quantize.h). The rules are quant_device.cuh's, so the values are bitwise those of
// moe::dequantize(moe::quantize(group)).
//
// - NVFP4 first reduces each group's global amax: a warp per row, one atomicMax of the fp32 bit
//   pattern per row into the group's zeroed word (order-independent, so deterministic).
// - Rowwise: a thread per (row, block of b columns) holds the block in registers (16-byte loads),
//   reduces its amax, encodes, decodes and stores it as bf16; one pass of CTAs (launch_geometry.h).
// - E4M3 is encoded and decoded by the hardware conversions, and the bf16 results rounded by it.
// - Columnwise: the row blocks start at each group's first row, so a small kernel first turns the
//   group sizes into a prefix of row-block counts; then a thread per (row block, column pair) reads
//   the block's rows of its two columns (one 32-bit word per row: a warp covers 128 contiguous
//   bytes of a row), reduces both amaxes, and reads them again (now from L1 / L2) to encode,
//   decode and store.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "moe/error.h"
#include "quant/fake_quantize.h"
#include "quant/quant_device.cuh"

namespace moe::quant {

namespace {

constexpr int kThreads = 256;
constexpr int kPrefixThreads = 1024;

struct Groups {
  const int32_t* g;  // [E + 1]
  int E;
  int64_t rows;
  // Offset i clamped to [0, rows].
  __device__ __forceinline__ int64_t at(int i) const {
    return min(rows, max(int64_t(0), static_cast<int64_t>(__ldg(g + i))));
  }
  // The group holding row r, or -1.
  __device__ __forceinline__ int of(int64_t r) const {
    if (r < at(0) || r >= at(E)) return -1;
    int lo = 0, hi = E;  // at(lo) <= r < at(hi)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (at(mid) <= r)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }
};

// A block's encode factor and decode factor from its amax (S: the NVFP4 global encode scale).
struct BlockCodec {
  float encode, decode;
};
template <QuantFormat F>
__device__ __forceinline__ BlockCodec block_codec(float amax, bool pow2, float S) {
  const BlockEncode b = block_encode<F>(amax, pow2, S);
  if constexpr (F == QuantFormat::kFP8Block) return {b.factor, b.scale_f32};
  if constexpr (F == QuantFormat::kMXFP8) return {b.factor, e8m0_to_float(b.scale_u8)};
  return {b.factor, __fdiv_rn(e4m3_to_float(b.scale_u8), S)};
}

// Two elements (a word of two bf16, the low one in block c0, the high one in c1) through the
// format: each code's value times its decode factor, as a word of two bf16. E4M3 goes through the
// hardware conversions both ways (the same codes as the software rule, NaN sign aside, which
// decodes to the same NaN); NVFP4 skips the NaN test of the E2M1 encoder when kNumbers (both
// blocks' products are numbers, products_are_numbers).
template <QuantFormat F, bool kNumbers = false>
__device__ __forceinline__ uint32_t fake_quantize_pair(uint32_t w, const BlockCodec& c0, const BlockCodec& c1) {
  const float p0 = __fmul_rn(bf16_word_lo(w), c0.encode), p1 = __fmul_rn(bf16_word_hi(w), c1.encode);
  if constexpr (F == QuantFormat::kNVFP4) {
    return bf16x2_bits(__fmul_rn(e2m1_decode(e2m1_code<kNumbers>(p0)), c0.decode),
                       __fmul_rn(e2m1_decode(e2m1_code<kNumbers>(p1)), c1.decode));
  } else {
    const float2 d = e4m3x2_to_float2(cvt_e4m3x2(p0, p1));
    return bf16x2_bits(__fmul_rn(d.x, c0.decode), __fmul_rn(d.y, c1.decode));
  }
}

__global__ void __launch_bounds__(kThreads) group_amax_kernel(const uint16_t* x, int64_t cols, Groups gr,
                                                              float* amax) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t chunks = cols / 8;
  for (int64_t r = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32; r < gr.rows; r += warps) {
    const int e = gr.of(r);  // the same for the whole warp
    if (e < 0) continue;
    const uint4* row = reinterpret_cast<const uint4*>(x + r * cols);
    uint32_t pairs = 0;
    for (int64_t c = lane; c < chunks; c += 32) {
      const uint4 v = __ldg(row + c);
      pairs = abs_max_pairs(abs_max_pairs(abs_max_pairs(abs_max_pairs(pairs, v.x), v.y), v.z), v.w);
    }
    const uint32_t bits = __reduce_max_sync(0xFFFFFFFFu, pairs_amax_bits(pairs));
    if (lane == 0 && bits != 0) atomicMax(reinterpret_cast<unsigned int*>(amax + e), bits);
  }
}

template <QuantFormat F>
__global__ void __launch_bounds__(kThreads) rowwise_kernel(const uint16_t* x, uint16_t* out, int64_t cols, Groups gr,
                                                           const float* amax, bool pow2) {
  constexpr int kB = block_len<F>(), kVecs = kB / 8;
  const int64_t nb = cols / kB, tasks = gr.rows * nb;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; t < tasks; t += stride) {
    const int64_t r = t / nb;
    const int e = gr.of(r);
    if (e < 0) continue;
    const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(amax[e]) : 1.0f;
    const uint4* src = reinterpret_cast<const uint4*>(x + t * kB);  // row r, block t % nb
    uint4 v[kVecs];
    uint32_t pairs = 0;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      v[i] = __ldg(src + i);
      pairs = abs_max_pairs(abs_max_pairs(abs_max_pairs(abs_max_pairs(pairs, v[i].x), v[i].y), v[i].z), v[i].w);
    }
    const BlockCodec c = block_codec<F>(__uint_as_float(pairs_amax_bits(pairs)), pow2, S);
    uint4* dst = reinterpret_cast<uint4*>(out + t * kB);
    with_numbers_tag(F == QuantFormat::kNVFP4 && products_are_numbers(c.encode), [&](auto numbers) {
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        uint32_t w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = fake_quantize_pair<F, decltype(numbers)::value>(w[k], c, c);
        dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    });
  }
}

// prefix[e] = row blocks of the groups before e (b rows each, the last one of a group partial);
// prefix[E] = all of them. One CTA.
__global__ void __launch_bounds__(kPrefixThreads) row_block_prefix_kernel(Groups gr, int b, int32_t* prefix) {
  using Scan = cub::BlockScan<int32_t, kPrefixThreads>;
  __shared__ typename Scan::TempStorage tmp;
  int32_t carry = 0;
  for (int base = 0; base < gr.E; base += kPrefixThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int64_t n = e < gr.E ? max(int64_t(0), gr.at(e + 1) - gr.at(e)) : 0;
    const int32_t count = static_cast<int32_t>((n + b - 1) / b);
    int32_t before = 0, total = 0;
    Scan(tmp).ExclusiveSum(count, before, total);
    if (e < gr.E) prefix[e] = carry + before;
    carry += total;
    __syncthreads();  // tmp is reused by the next chunk
  }
  if (threadIdx.x == 0) prefix[gr.E] = carry;
}

template <QuantFormat F>
__global__ void __launch_bounds__(kThreads) columnwise_kernel(const uint16_t* x, uint16_t* out, int64_t cols,
                                                              Groups gr, const int32_t* prefix, const float* amax,
                                                              bool pow2) {
  constexpr int kB = block_len<F>();
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x, pairs = cols / 2;
  if (pair >= pairs) return;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x) + pair;
  uint32_t* dst = reinterpret_cast<uint32_t*>(out) + pair;
  const int32_t total = __ldg(prefix + gr.E);
  for (int32_t q = blockIdx.y; q < total; q += gridDim.y) {
    int lo = 0, hi = gr.E;  // prefix[lo] <= q < prefix[hi]: q is a block of group lo
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (__ldg(prefix + mid) <= q)
        lo = mid;
      else
        hi = mid;
    }
    const int64_t start = gr.at(lo) + static_cast<int64_t>(q - __ldg(prefix + lo)) * kB;
    const int64_t end = min(start + kB, gr.at(lo + 1));
    uint32_t acc = 0;
    for (int64_t r = start; r < end; ++r) acc = abs_max_pairs(acc, __ldg(src + r * pairs));
    const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(amax[lo]) : 1.0f;
    const BlockCodec c0 = block_codec<F>(__uint_as_float(acc << 16), pow2, S);
    const BlockCodec c1 = block_codec<F>(__uint_as_float(acc & 0xFFFF0000u), pow2, S);
    const bool numbers = F == QuantFormat::kNVFP4 && products_are_numbers(c0.encode) && products_are_numbers(c1.encode);
    with_numbers_tag(numbers, [&](auto tag) {
      for (int64_t r = start; r < end; ++r)
        dst[r * pairs] = fake_quantize_pair<F, decltype(tag)::value>(__ldg(src + r * pairs), c0, c1);
    });
  }
}

template <QuantFormat F>
void launch(bool columnwise, const uint16_t* x, uint16_t* out, int64_t cols, const Groups& gr, bool pow2,
            float* amax, int32_t* prefix, cudaStream_t s) {
  if (F == QuantFormat::kNVFP4) {
    MOE_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float) * gr.E, s));
    const unsigned ctas =  // a warp per row
        one_wave_grid_x(reinterpret_cast<const void*>(group_amax_kernel), kThreads, gr.rows, kThreads / 32);
    group_amax_kernel<<<ctas, kThreads, 0, s>>>(x, cols, gr, amax);
    MOE_CUDA_CHECK_LAUNCH();
  }
  constexpr int kB = block_len<F>();
  if (!columnwise) {
    const unsigned ctas = one_pass_grid_x(gr.rows * (cols / kB), kThreads);  // a thread per (row, block)
    rowwise_kernel<F><<<ctas, kThreads, 0, s>>>(x, out, cols, gr, amax, pow2);
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  row_block_prefix_kernel<<<1, kPrefixThreads, 0, s>>>(gr, kB, prefix);
  MOE_CUDA_CHECK_LAUNCH();
  // Every group adds at most one partial block to rows / b.
  const int64_t blocks_bound = (gr.rows + kB - 1) / kB + gr.E;
  const dim3 grid(static_cast<unsigned>((cols / 2 + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(blocks_bound, 65535)));
  columnwise_kernel<F><<<grid, kThreads, 0, s>>>(x, out, cols, gr, prefix, amax, pow2);
  MOE_CUDA_CHECK_LAUNCH();
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

size_t fake_quantize_workspace_bytes(int groups) {
  return align_up(sizeof(float) * groups) + align_up(sizeof(int32_t) * (groups + 1));
}

void fake_quantize_groups(const QuantConfig& config, bool columnwise, const TensorView& x,
                          const TensorView& group_offsets, const TensorView& out, void* workspace, cudaStream_t s) {
  MOE_CHECK(config.blocking == QuantBlocking::k1D, "argument 'config.blocking': token operands take 1-D blocks");
  MOE_CHECK(!config.stochastic_rounding, "argument 'config.stochastic_rounding': not offered for token operands");
  MOE_CHECK(!config.pow2_scale || config.format == QuantFormat::kFP8Block,
            "argument 'config.pow2_scale': only for fp8_block");
  MOE_CHECK(x.ndim == 2, "argument 'x': expected a matrix [rows, cols], got shape ", x.shape_string());
  const int64_t rows = x.shape[0], cols = x.shape[1];
  check_device_tensor(x, "x", DType::kBF16, {rows, cols}, 16);
  check_device_tensor(out, "out", DType::kBF16, {rows, cols}, 16);
  {  // in place, or apart: a partial overlap would read values another thread already replaced
    const auto* xb = static_cast<const char*>(x.data);
    const auto* ob = static_cast<const char*>(out.data);
    const int64_t bytes = rows * cols * 2;
    MOE_CHECK(xb == ob || ob + bytes <= xb || xb + bytes <= ob, "argument 'out': must be x itself or not overlap it");
  }
  MOE_CHECK(group_offsets.ndim == 1 && group_offsets.shape[0] >= 2, "argument 'group_offsets': expected [E + 1] ",
            "with E >= 1, got shape ", group_offsets.shape_string());
  check_device_tensor(group_offsets, "group_offsets", DType::kInt32, {group_offsets.shape[0]}, 4);
  const int b = quant_block_size(config.format);
  MOE_CHECK(columnwise ? cols % 8 == 0 : cols % b == 0, "argument 'x': expected cols a multiple of ",
            columnwise ? 8 : b, " (", columnwise ? "16-byte rows" : "whole row blocks", "), got ", cols);
  MOE_CHECK(rows < (int64_t(1) << 31), "argument 'x': expected rows < 2^31, got ", rows);
  const int E = static_cast<int>(group_offsets.shape[0] - 1);
  MOE_CHECK(workspace != nullptr || rows == 0 || cols == 0, "argument 'workspace': expected ",
            fake_quantize_workspace_bytes(E), " bytes of device memory");
  if (rows == 0 || cols == 0) return;
  float* amax = static_cast<float*>(workspace);
  int32_t* prefix = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + align_up(sizeof(float) * E));
  const Groups gr{group_offsets.ptr<const int32_t>(), E, rows};
  const auto* xs = static_cast<const uint16_t*>(x.data);
  auto* os = static_cast<uint16_t*>(out.data);
  switch (config.format) {
    case QuantFormat::kFP8Block:
      return launch<QuantFormat::kFP8Block>(columnwise, xs, os, cols, gr, config.pow2_scale, amax, prefix, s);
    case QuantFormat::kMXFP8:
      return launch<QuantFormat::kMXFP8>(columnwise, xs, os, cols, gr, false, amax, prefix, s);
    case QuantFormat::kNVFP4:
      return launch<QuantFormat::kNVFP4>(columnwise, xs, os, cols, gr, false, amax, prefix, s);
  }
  MOE_CHECK(false, "argument 'config.format': unknown format ", int(config.format));
}

}  // namespace moe::quant
