// dequantize(): one copy back to bf16 or fp32, element times its block's decode factor (one fp32
// multiply, then the output rounding). A thread per chunk of 8 elements of a copy row; a chunk
// never straddles a block (blocks are multiples of 8 long and start at multiples of 8).
#include <cstdint>

#include "device/cuda_check.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"

namespace moe {

namespace quant {
namespace {

constexpr int kThreads = 256;

struct DequantParams {
  const uint8_t* data;
  const void* scale;
  int64_t rows, cols, block_rows, block_cols, scale_entries;
  int64_t chunks_per_row, chunks;  // over all matrices
  ScaleLayout layout;
  const float* global_amax;
  void* out;
};

template <QuantFormat F, bool kTwoD, bool kFP32Out>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(DequantParams p) {
  constexpr int kB = F == QuantFormat::kFP8Block ? 128 : (F == QuantFormat::kMXFP8 ? 32 : 16);
  for (int64_t id = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; id < p.chunks;
       id += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row_all = id / p.chunks_per_row;  // b * rows + r
    const int64_t b = row_all / p.rows, r = row_all % p.rows;
    const int64_t col = (id % p.chunks_per_row) * 8;
    const int64_t si =
        b * p.scale_entries + scale_index(p.layout, kTwoD ? r / kB : r, col / kB, p.block_rows, p.block_cols);
    float d;
    if constexpr (F == QuantFormat::kFP8Block) {
      d = static_cast<const float*>(p.scale)[si];
    } else if constexpr (F == QuantFormat::kMXFP8) {
      d = e8m0_to_float(static_cast<const uint8_t*>(p.scale)[si]);
    } else {
      d = __fdiv_rn(e4m3_to_float(static_cast<const uint8_t*>(p.scale)[si]), nvfp4_global_scale(p.global_amax[b]));
    }
    const int64_t pos = row_all * p.cols + col;
    const int n = p.cols - col < 8 ? static_cast<int>(p.cols - col) : 8;  // a partial chunk: FP8 only
    float v[8];
    if constexpr (F == QuantFormat::kNVFP4) {
      const uint32_t packed = *reinterpret_cast<const uint32_t*>(p.data + pos / 2);  // cols % 16 == 0
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(e2m1_to_float((packed >> (4 * i)) & 0xFu), d);
    } else if (n == 8 && pos % 8 == 0) {
      const uint2 w = *reinterpret_cast<const uint2*>(p.data + pos);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = __fmul_rn(e4m3_to_float(static_cast<uint8_t>((i < 4 ? w.x : w.y) >> (8 * (i % 4)))), d);
    } else {
      for (int i = 0; i < 8; ++i) v[i] = i < n ? __fmul_rn(e4m3_to_float(p.data[pos + i]), d) : 0.0f;
    }
    if constexpr (kFP32Out) {
      float* o = static_cast<float*>(p.out) + pos;
      if (n == 8 && pos % 4 == 0) {
        reinterpret_cast<float4*>(o)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(o)[1] = make_float4(v[4], v[5], v[6], v[7]);
      } else {
        for (int i = 0; i < n; ++i) o[i] = v[i];
      }
    } else {
      uint16_t* o = static_cast<uint16_t*>(p.out) + pos;
      if (n == 8 && pos % 8 == 0) {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          w[i] = static_cast<uint32_t>(bf16_bits_from_float(v[2 * i])) |
                 (static_cast<uint32_t>(bf16_bits_from_float(v[2 * i + 1])) << 16);
        *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
        for (int i = 0; i < n; ++i) o[i] = bf16_bits_from_float(v[i]);
      }
    }
  }
}

template <QuantFormat F, bool kTwoD>
void launch(const DequantParams& p, bool fp32_out, cudaStream_t stream) {
  int dev = 0, sms = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t want = (p.chunks + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(want < 16LL * sms ? want : 16LL * sms);
  if (fp32_out)
    dequantize_kernel<F, kTwoD, true><<<grid, kThreads, 0, stream>>>(p);
  else
    dequantize_kernel<F, kTwoD, false><<<grid, kThreads, 0, stream>>>(p);
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
  p.chunks_per_row = (c.cols + 7) / 8;
  p.chunks = a.B * c.rows * p.chunks_per_row;
  p.layout = config.scale_layout;
  p.global_amax = a.global_amax;
  p.out = a.out;
  if (p.chunks == 0) return;
  const bool two_d = config.blocking == QuantBlocking::k2D;
  switch (config.format) {
    case QuantFormat::kFP8Block:
      two_d ? launch<QuantFormat::kFP8Block, true>(p, a.out_fp32, stream)
            : launch<QuantFormat::kFP8Block, false>(p, a.out_fp32, stream);
      break;
    case QuantFormat::kMXFP8:
      launch<QuantFormat::kMXFP8, false>(p, a.out_fp32, stream);
      break;
    case QuantFormat::kNVFP4:
      two_d ? launch<QuantFormat::kNVFP4, true>(p, a.out_fp32, stream)
            : launch<QuantFormat::kNVFP4, false>(p, a.out_fp32, stream);
      break;
  }
}

}  // namespace moe
