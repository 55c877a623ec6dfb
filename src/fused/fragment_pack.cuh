// Epilogue helpers of the fused kernels for the WGMMA 64xNx16 accumulator fragment: packing fp32
// pairs to bf16 and a 4 x 4 transpose across the lanes of a quad, so that each lane ends up with 8
// consecutive columns of a row (one 16-byte vector) instead of 4 scattered column pairs.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "kernels/activation_math.cuh"

namespace moe::fused {

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Four packed pairs as the library's 16-byte vector, unpacked by its helper.
__device__ __forceinline__ void unpack_bf16x8(const uint32_t (&w)[4], float (&v)[kernels::kVec]) {
  kernels::unpack<__nv_bfloat16>(make_uint4(w[0], w[1], w[2], w[3]), v);
}

// 4 x 4 transpose of 32-bit words across the lanes of a quad (j = lane % 4): afterwards out[s] of
// lane j is in[j] of lane s. In round k lane s sends in[(s - k) % 4] and lane j receives from lane
// (j + k) % 4; register indices stay static (selects), so nothing goes to local memory. Every lane
// of the warp must take part.
__device__ __forceinline__ void quad_transpose(const uint32_t (&in)[4], uint32_t (&out)[4], int j, int lane) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int send = (j - k) & 3, from = (j + k) & 3;
    uint32_t v = in[0];
    v = send == 1 ? in[1] : v;
    v = send == 2 ? in[2] : v;
    v = send == 3 ? in[3] : v;
    const uint32_t got = __shfl_sync(kernels::kFullMask, v, (lane & ~3) | from);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (q == from) out[q] = got;
  }
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

}  // namespace moe::fused
