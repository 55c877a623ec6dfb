// Epilogue helpers of the fused kernels for the WGMMA 64xNx16 accumulator fragment: packing fp32
// pairs to bf16, a 4 x 4 transpose across the lanes of a quad, so that each lane ends up with 8
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
// lane j is in[j] of lane s. Two butterfly stages: swap the off-diagonal 2 x 2 blocks with the lane
// two away, then transpose each 2 x 2 block with the neighbouring lane. Register indices stay
// static (selects), so nothing goes to local memory: 4 shuffles and 12 selects. j must be
// lane % 4 (the partners come from the lane id). Every lane of the warp must take part.
__device__ __forceinline__ void quad_transpose(const uint32_t (&in)[4], uint32_t (&out)[4], int j) {
  const bool hi = (j & 2) != 0, odd = (j & 1) != 0;
  // Stage 1: lanes 0-1 send words 2-3 to lanes 2-3, which send words 0-1 back.
  const uint32_t s0 = __shfl_xor_sync(kernels::kFullMask, hi ? in[0] : in[2], 2);
  const uint32_t s1 = __shfl_xor_sync(kernels::kFullMask, hi ? in[1] : in[3], 2);
  const uint32_t t0 = hi ? s0 : in[0], t1 = hi ? s1 : in[1];
  const uint32_t t2 = hi ? in[2] : s0, t3 = hi ? in[3] : s1;
  // Stage 2: lanes j and j ^ 1 transpose their 2 x 2 blocks (words 0-1, words 2-3): even lanes send
  // words 1 and 3, odd lanes words 0 and 2.
  const uint32_t u0 = __shfl_xor_sync(kernels::kFullMask, odd ? t0 : t1, 1);
  const uint32_t u1 = __shfl_xor_sync(kernels::kFullMask, odd ? t2 : t3, 1);
  out[0] = odd ? u0 : t0;
  out[1] = odd ? t1 : u0;
  out[2] = odd ? u1 : t2;
  out[3] = odd ? t3 : u1;
}

// A lane's 4 column pairs of one 32-column block of the accumulator -- accumulators first + 4 q and
// first + 4 q + 1, q < 4 -- packed to bf16 pairs and quad-transposed: out is 8 consecutive columns
// (j = lane % 4; every lane must take part).
template <class Acc>
__device__ __forceinline__ void pack_transpose_pairs(const Acc& acc, int first, int j, uint32_t (&out)[4]) {
  uint32_t in[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) in[q] = pack_bf16x2(acc(first + 4 * q), acc(first + 4 * q + 1));
  quad_transpose(in, out, j);
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

}  // namespace moe::fused
