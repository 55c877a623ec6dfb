// dequantize(): one copy back to bf16 or fp32, element times its block's decode factor (one fp32
// multiply, then the output rounding). A unit is 16 consecutive elements of a copy row (one
// 16-byte FP8 load or one 8-byte FP4 load, two or four 16-byte stores); a unit never straddles a
// block (blocks are 16, 32 or 128 long and start at multiples of 16). Grid (x: CTAs per matrix,
// y: matrix), one pass (launch_geometry.h says why), two units per thread with both loads issued
// before the stores. E4M3 codes and the bf16 output use the hardware conversions (exact, and
// round to nearest even): the instruction count, not the memory, limited the software ones. Rows
// whose units are not vector-aligned (FP8 copies whose length is not a multiple of 16) take an
// element-by-element path.
#include <cstdint>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"

namespace moe {

namespace quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnit = 16;
constexpr int kUnitsPerThread = 2;  // both loads in flight before the stores
constexpr int kUnitsPerCta = kUnitsPerThread * kThreads;

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
    for (int i = 0; i < 8; ++i) w[i] = bf16x2_bits(v[2 * i], v[2 * i + 1]);
    uint4* o = reinterpret_cast<uint4*>(static_cast<uint16_t*>(out) + pos);
    o[0] = make_uint4(w[0], w[1], w[2], w[3]);
    o[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// The decode factor of the block holding element (r, col) of matrix b.
template <QuantFormat F, bool kTwoD>
__device__ __forceinline__ float block_factor(const DequantParams& p, int64_t b, int64_t r, int64_t col, float S) {
  constexpr int kB = block_len<F>();
  const int64_t si =
      b * p.scale_entries + scale_index(p.layout, kTwoD ? r / kB : r, col / kB, p.block_rows, p.block_cols);
  if constexpr (F == QuantFormat::kFP8Block) {
    return static_cast<const float*>(p.scale)[si];
  } else if constexpr (F == QuantFormat::kMXFP8) {
    return e8m0_to_float(static_cast<const uint8_t*>(p.scale)[si]);
  } else {
    return __fdiv_rn(e4m3_to_float(static_cast<const uint8_t*>(p.scale)[si]), S);
  }
}

// A CTA takes kUnitsPerCta consecutive units, thread i units i and i + kThreads of them (each
// load instruction covers contiguous memory); with a capped grid it moves on by the grid's span.
template <QuantFormat F, bool kTwoD, bool kFP32Out>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(DequantParams p) {
  const int64_t b = blockIdx.y;
  const int64_t U = p.units_per_row;
  const int64_t tasks = p.rows * U;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[b]) : 1.0f;
  const int64_t step_r = kThreads / U, step_u = kThreads % U;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kUnitsPerCta + threadIdx.x; first < tasks;
       first += static_cast<int64_t>(gridDim.x) * kUnitsPerCta) {
    int64_t r = first / U, u = first % U;
    int64_t pos[kUnitsPerThread];
    float d[kUnitsPerThread];
    uint4 q[kUnitsPerThread];
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      pos[k] = -1;
      if (first + k * kThreads < tasks) {
        const int64_t col = u * kUnit;
        pos[k] = (b * p.rows + r) * p.cols + col;
        d[k] = block_factor<F, kTwoD>(p, b, r, col, S);
        if constexpr (F == QuantFormat::kNVFP4) {
          // cols % 16 == 0: a unit is 8 whole bytes at a multiple of 8 (4-byte loads when the data
          // pointer is only 4-byte aligned).
          const uint32_t* w = reinterpret_cast<const uint32_t*>(p.data + pos[k] / 2);
          if (p.vec) {
            const uint2 v = __ldg(reinterpret_cast<const uint2*>(w));
            q[k] = make_uint4(v.x, v.y, 0, 0);
          } else {
            q[k] = make_uint4(__ldg(w), __ldg(w + 1), 0, 0);
          }
        } else if (p.vec) {
          q[k] = __ldg(reinterpret_cast<const uint4*>(p.data + pos[k]));
        }
      }
      r += step_r;
      u += step_u;
      if (u >= U) {
        u -= U;
        ++r;
      }
    }
#pragma unroll
    for (int k = 0; k < kUnitsPerThread; ++k) {
      if (pos[k] < 0) continue;
      float v[kUnit];
      if constexpr (F == QuantFormat::kNVFP4) {
        const uint32_t w[2] = {q[k].x, q[k].y};
#pragma unroll
        for (int i = 0; i < kUnit; ++i)
          v[i] = __fmul_rn(e2m1_decode((w[i / 8] >> (4 * (i % 8))) & 0xFu), d[k]);
        store_unit<kFP32Out>(p.out, pos[k], v);
      } else if (p.vec) {
        const uint32_t w[4] = {q[k].x, q[k].y, q[k].z, q[k].w};
#pragma unroll
        for (int i = 0; i < kUnit; i += 2) {
          const float2 e = e4m3x2_to_float2(w[i / 4] >> (8 * (i % 4)));
          v[i] = __fmul_rn(e.x, d[k]);
          v[i + 1] = __fmul_rn(e.y, d[k]);
        }
        store_unit<kFP32Out>(p.out, pos[k], v);
      } else {
        const int64_t col = pos[k] % p.cols;
        const int n = static_cast<int>(p.cols - col < kUnit ? p.cols - col : kUnit);
        for (int i = 0; i < n; ++i) {
          const float x = __fmul_rn(e4m3_decode(p.data[pos[k] + i]), d[k]);
          if constexpr (kFP32Out)
            static_cast<float*>(p.out)[pos[k] + i] = x;
          else
            static_cast<uint16_t*>(p.out)[pos[k] + i] = bf16_bits_from_float(x);
        }
      }
    }
  }
}

template <QuantFormat F, bool kTwoD>
void launch(const DequantParams& p, int64_t B, bool fp32_out, cudaStream_t stream) {
  const auto kernel = fp32_out ? dequantize_kernel<F, kTwoD, true> : dequantize_kernel<F, kTwoD, false>;
  const dim3 grid(one_pass_grid_x(p.rows * p.units_per_row, kUnitsPerCta), static_cast<unsigned>(B));
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
