// dequantize(): one copy back to bf16 or fp32, element times its block's decode factor (one fp32
// multiply, then the output rounding). A task is a unit of 16 consecutive elements of a copy row
// (one 16-byte FP8 load or one 8-byte FP4 load, two or four 16-byte stores); a unit never
// straddles a block (blocks are 16, 32 or 128 long and start at multiples of 16). Grid (x: CTAs
// per matrix, y: matrix), one wave; a thread carries its unit's (row, unit) from one task to the
// next with a carry, so the loop has no division. Rows whose units are not vector-aligned (FP8
// copies whose length is not a multiple of 16) take an element-by-element path.
#include <cstdint>

#include "device/cuda_check.h"
#include "moe/quantize.h"
#include "quant/launch_geometry.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"

namespace moe {

namespace quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnit = 16;

struct DequantParams {
  const uint8_t* data;
  const void* scale;
  int64_t rows, cols, block_rows, block_cols, scale_entries;
  int64_t units_per_row;
  bool vec;  // every unit is a whole, aligned vector
  ScaleLayout layout;
  const float* global_amax;
  void* out;
};

template <bool kFP32Out>
__device__ __forceinline__ void store_unit(void* out, int64_t pos, const float (&v)[kUnit]) {
  if constexpr (kFP32Out) {
    float4* o = reinterpret_cast<float4*>(static_cast<float*>(out) + pos);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  } else {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      w[i] = static_cast<uint32_t>(bf16_bits_from_float(v[2 * i])) |
             (static_cast<uint32_t>(bf16_bits_from_float(v[2 * i + 1])) << 16);
    uint4* o = reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + pos);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

template <QuantFormat F, bool kTwoD, bool kFP32Out>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(DequantParams p) {
  constexpr int kB = block_len<F>();
  const int64_t b = blockIdx.y;
  const int64_t U = p.units_per_row;
  const int64_t tasks = p.rows * U;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t step_r = stride / U, step_u = stride % U;
  int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  int64_t r = t / U, u = t % U;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[b]) : 1.0f;
  for (; t < tasks; t += stride) {
    const int64_t col = u * kUnit;
    const int64_t si =
        b * p.scale_entries + scale_index(p.layout, kTwoD ? r / kB : r, col / kB, p.block_rows, p.block_cols);
    const int64_t pos = (b * p.rows + r) * p.cols + col;
    float d;
    if constexpr (F == QuantFormat::kFP8Block) {
      d = static_cast<const float*>(p.scale)[si];
    } else if constexpr (F == QuantFormat::kMXFP8) {
      d = e8m0_to_float(static_cast<const uint8_t*>(p.scale)[si]);
    } else {
      d = __fdiv_rn(e4m3_to_float(static_cast<const uint8_t*>(p.scale)[si]), S);
    }
    float v[kUnit];
    if constexpr (F == QuantFormat::kNVFP4) {
      // cols % 16 == 0: a unit is 8 whole bytes at a multiple of 8 (4-byte loads when the data
      // pointer is only 4-byte aligned).
      uint32_t w[2];
      if (p.vec) {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(p.data + pos / 2));
        w[0] = q.x;
        w[1] = q.y;
      } else {
        w[0] = __ldg(reinterpret_cast<const uint32_t*>(p.data + pos / 2));
        w[1] = __ldg(reinterpret_cast<const uint32_t*>(p.data + pos / 2) + 1);
      }
#pragma unroll
      for (int i = 0; i < kUnit; ++i) v[i] = __fmul_rn(e2m1_decode((w[i / 8] >> (4 * (i % 8))) & 0xFu), d);
      store_unit<kFP32Out>(p.out, pos, v);
    } else if (p.vec) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(p.data + pos));
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < kUnit; ++i) v[i] = __fmul_rn(e4m3_decode((w[i / 4] >> (8 * (i % 4))) & 0xFFu), d);
      store_unit<kFP32Out>(p.out, pos, v);
    } else {
      const int n = static_cast<int>(p.cols - col < kUnit ? p.cols - col : kUnit);
      for (int i = 0; i < n; ++i) {
        const float x = __fmul_rn(e4m3_decode(p.data[pos + i]), d);
        if constexpr (kFP32Out)
          static_cast<float*>(p.out)[pos + i] = x;
        else
          static_cast<uint16_t*>(p.out)[pos + i] = bf16_bits_from_float(x);
      }
    }
    r += step_r;
    u += step_u;
    if (u >= U) {
      u -= U;
      ++r;
    }
  }
}

template <QuantFormat F, bool kTwoD>
void launch(const DequantParams& p, int64_t B, bool fp32_out, cudaStream_t stream) {
  const auto kernel = fp32_out ? dequantize_kernel<F, kTwoD, true> : dequantize_kernel<F, kTwoD, false>;
  const dim3 grid(
      one_wave_grid_x(reinterpret_cast<const void*>(kernel), kThreads, p.rows * p.units_per_row, kThreads, B),
      static_cast<unsigned>(B));
  kernel<<<grid, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace quant

void dequantize(const QuantConfig& config, const QuantizedTensor& q, bool columnwise, const TensorView& out,
                cudaStream_t stream) {
  using namespace quant;
  const DequantArgs a = check_dequantize_args(config, q, columnwise, out);
  const CopyArgs& c = a.copy;
  DequantParams p;
  p.data = static_cast<const uint8_t*>(c.data);
  p.scale = c.scale;
  p.rows = c.rows;
  p.cols = c.cols;
  p.block_rows = c.block_rows;
  p.block_cols = c.block_cols;
  p.scale_entries = c.scale_entries;
  p.units_per_row = (c.cols + kUnit - 1) / kUnit;
  const bool fp4 = config.format == QuantFormat::kNVFP4;
  // Units are whole vectors when rows are multiples of 16 elements and the data pointer is
  // aligned to one (16 bytes FP8, 8 bytes FP4); out is 16-byte aligned (checked).
  p.vec = c.cols % kUnit == 0 && reinterpret_cast<uintptr_t>(c.data) % (fp4 ? 8 : 16) == 0;
  p.layout = c.layout;
  p.global_amax = a.global_amax;
  p.out = a.out;
  if (a.B == 0 || p.rows == 0 || p.units_per_row == 0) return;
  const bool two_d = config.blocking == QuantBlocking::k2D;
  switch (config.format) {
    case QuantFormat::kFP8Block:
      two_d ? launch<QuantFormat::kFP8Block, true>(p, a.B, a.out_fp32, stream)
            : launch<QuantFormat::kFP8Block, false>(p, a.B, a.out_fp32, stream);
      break;
    case QuantFormat::kMXFP8:
      launch<QuantFormat::kMXFP8, false>(p, a.B, a.out_fp32, stream);
      break;
    case QuantFormat::kNVFP4:
      two_d ? launch<QuantFormat::kNVFP4, true>(p, a.B, a.out_fp32, stream)
            : launch<QuantFormat::kNVFP4, false>(p, a.B, a.out_fp32, stream);
      break;
  }
}

}  // namespace moe
