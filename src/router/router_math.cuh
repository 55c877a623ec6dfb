// Device helpers of the router kernels: one warp holds one token row, lane l owning experts
// l, l + 32, ... (NJ of them, E <= 32 * NJ). Every warp reduction is a fixed butterfly, so results
// do not depend on scheduling.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "router/router_kernels.h"

namespace moe::kernels::router {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Register j of a lane, by a runtime j (unrolled compare: keeps the array in registers).
template <int NJ>
__device__ __forceinline__ float pick(const float (&r)[NJ], int j) {
  float out = 0.0f;
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
    if (jj == j) out = r[jj];
  return out;
}
template <int NJ>
__device__ __forceinline__ void add_at(float (&r)[NJ], int j, float v) {
#pragma unroll
  for (int jj = 0; jj < NJ; ++jj)
    if (jj == j) r[jj] += v;
}

// The value of expert e from its owner lane (all lanes call it with the same e >= 0).
template <int NJ>
__device__ __forceinline__ float from_owner(const float (&r)[NJ], int e) {
  return __shfl_sync(kFull, pick<NJ>(r, e / 32), e % 32);
}

// Loads row t of the logits (lanes past E get -inf and never count).
template <int NJ>
__device__ __forceinline__ void load_row(const RouterRowParams& p, int64_t t, int lane, float (&z)[NJ]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = j * 32 + lane;
    float v = -INFINITY;
    if (e < p.E) {
      const int64_t i = t * p.E + e;
      v = p.bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p.logits)[i])
                 : __ldg(static_cast<const float*>(p.logits) + i);
    }
    z[j] = v;
  }
}

// True when every logit of the row (and every bias) is finite -- the same on all lanes.
template <int NJ>
__device__ __forceinline__ bool row_finite(const RouterRowParams& p, int lane, const float (&z)[NJ]) {
  bool ok = true;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = j * 32 + lane;
    if (e < p.E) {
      ok = ok && isfinite(z[j]);
      if (p.bias) ok = ok && isfinite(__ldg(p.bias + e));
    }
  }
  return __all_sync(kFull, ok);
}

// Softmax over the row: sm (0 past E) and logsumexp.
template <int NJ>
__device__ __forceinline__ void softmax_row(const RouterRowParams& p, int lane, const float (&z)[NJ], float (&sm)[NJ],
                                            float& lse) {
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NJ; ++j) m = fmaxf(m, z[j]);
  m = warp_max(m);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    sm[j] = j * 32 + lane < p.E ? expf(z[j] - m) : 0.0f;
    sum += sm[j];
  }
  sum = warp_sum(sum);
  const float inv = 1.0f / sum;
#pragma unroll
  for (int j = 0; j < NJ; ++j) sm[j] *= inv;
  lse = m + logf(sum);
}

template <int NJ>
__device__ __forceinline__ void sigmoid_row(const RouterRowParams& p, int lane, const float (&z)[NJ], float (&s)[NJ]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) s[j] = j * 32 + lane < p.E ? 1.0f / (1.0f + expf(-z[j])) : 0.0f;
}

// The scores of a row: s (the score function); a, the balancing scores the losses use (softmax over
// all experts, or sigmoid normalised to sum 1), when want_a; the logsumexp when want_lse, and with
// a sigmoid score also the softmax sm (the z-loss gradient needs it; with softmax it is s).
template <int NJ>
struct RowScores {
  float s[NJ];
  float a[NJ];
  float sm[NJ];
  float lse = 0.0f;
  float ssum = 1.0f;  // sigmoid: sum of s
};

template <int NJ>
__device__ __forceinline__ void row_scores(const RouterRowParams& p, int lane, const float (&z)[NJ], bool want_a,
                                           bool want_lse, RowScores<NJ>& r) {
  if (p.score == ScoreFunction::kSoftmax) {
    softmax_row<NJ>(p, lane, z, r.s, r.lse);
#pragma unroll
    for (int j = 0; j < NJ; ++j) r.a[j] = r.sm[j] = r.s[j];
    return;
  }
  sigmoid_row<NJ>(p, lane, z, r.s);
  if (want_a) {
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) sum += r.s[j];
    r.ssum = warp_sum(sum);
    const float inv = 1.0f / r.ssum;
#pragma unroll
    for (int j = 0; j < NJ; ++j) r.a[j] = r.s[j] * inv;
  }
  if (want_lse) softmax_row<NJ>(p, lane, z, r.sm, r.lse);
}

// Monotone map of a float to uint32 (larger float -> larger integer; -0 < +0 is harmless here).
__device__ __forceinline__ uint32_t float_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

}  // namespace moe::kernels::router
