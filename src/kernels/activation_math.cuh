// Device math of the activations (docs/semantics.md, Activations) in fp32, and 16-byte bf16 vector
// helpers. The value and derivative formulas mirror src/reference/activation_ref.cpp (fp64), the
// executable spec.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "device/device_groups.cuh"
#include "device/vec16.cuh"
#include "moe/activation.h"

namespace moe::kernels {

// Parameters of clamped-swiglu (unused by the others).
struct ActConsts {
  float alpha, limit, offset;
};

// The logistic function from the hardware's approximate exp2 and reciprocal (`ex2.approx.ftz`,
// `rcp.approx.ftz`): two multi-function instructions, an add and a multiply. Its relative error,
// about 2^-20 (the argument's rounding in x log2(e) included), is far below the bf16 rounding
// (2^-9) of every value the activations produce. expf with __fdividef took ~12 instructions, most
// of a fused epilogue's arithmetic. Limits: 1 + e^-x = inf (x < -88) gives 0, e^-x = 0 gives 1,
// NaN stays NaN.
__device__ __forceinline__ float sigmoidf_(float x) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.44269504088896341f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
  return s;
}

// Unscaled activation of one logical column and its partial derivatives (gate g, linear l; the
// non-gated squared-relu takes its input as g and has no linear half).
template <Activation A>
struct ActOp;

template <>
struct ActOp<Activation::kSwiGLU> {
  static __device__ __forceinline__ float value(float g, float l, const ActConsts&) { return g * sigmoidf_(g) * l; }
  static __device__ __forceinline__ void grad(float g, float l, const ActConsts&, float& act, float& dg, float& dl) {
    float s = sigmoidf_(g);
    float silu = g * s;
    act = silu * l;
    dg = s * (1.0f + g * (1.0f - s)) * l;
    dl = silu;
  }
};

template <>
struct ActOp<Activation::kGeGLU> {
  static constexpr float kC = 0.7978845608f, kA = 0.044715f;
  static __device__ __forceinline__ float gelu(float g, float& t) {
    t = tanhf(kC * (g + kA * g * g * g));
    return 0.5f * g * (1.0f + t);
  }
  static __device__ __forceinline__ float value(float g, float l, const ActConsts&) {
    float t;
    return gelu(g, t) * l;
  }
  static __device__ __forceinline__ void grad(float g, float l, const ActConsts&, float& act, float& dg, float& dl) {
    float t;
    float ge = gelu(g, t);
    float dge = 0.5f * (1.0f + t) + 0.5f * g * (1.0f - t * t) * kC * (1.0f + 3.0f * kA * g * g);
    act = ge * l;
    dg = dge * l;
    dl = ge;
  }
};

template <>
struct ActOp<Activation::kClampedSwiGLU> {
  static __device__ __forceinline__ float value(float g, float l, const ActConsts& c) {
    float a = fminf(g, c.limit);
    float lin = fminf(fmaxf(l, -c.limit), c.limit) + c.offset;
    return a * sigmoidf_(c.alpha * a) * lin;
  }
  static __device__ __forceinline__ void grad(float g, float l, const ActConsts& c, float& act, float& dg,
                                              float& dl) {
    float a = fminf(g, c.limit);
    float s = sigmoidf_(c.alpha * a);
    float gate = a * s;
    float lin = fminf(fmaxf(l, -c.limit), c.limit) + c.offset;
    act = gate * lin;
    // Masked where clamped: no gradient through min(g, L) for g > L, nor through clamp(l) for |l| > L.
    dg = g > c.limit ? 0.0f : s * (1.0f + c.alpha * a * (1.0f - s)) * lin;
    dl = fabsf(l) > c.limit ? 0.0f : gate;
  }
};

template <>
struct ActOp<Activation::kSquaredReLU> {
  static __device__ __forceinline__ float value(float h, float, const ActConsts&) {
    float r = fmaxf(h, 0.0f);
    return r * r;
  }
  static __device__ __forceinline__ void grad(float h, float, const ActConsts&, float& act, float& dg, float& dl) {
    float r = fmaxf(h, 0.0f);
    act = r * r;
    dg = 2.0f * r;
    dl = 0.0f;
  }
};

// Physical fc1 columns of the 8 logical columns [j, j + 8): with j and the interleave size both
// multiples of 8 they are 8 contiguous gate columns and 8 contiguous linear columns.
// 32-bit column math (F < 2^30 is checked on the host): 64-bit division is slow on the GPU.
__device__ __forceinline__ int gate_col(int j, int F, int s) { return s == 0 ? j : (j / s) * 2 * s + (j % s); }
__device__ __forceinline__ int linear_col(int j, int F, int s) {
  return s == 0 ? F + j : (j / s) * 2 * s + s + (j % s);
}

// Interleave 1 (gate and linear alternate column by column, the GPT-OSS / SonicMoE layout): the 8
// logical columns [j, j + 8) are the 16 contiguous physical columns [2j, 2j + 16), gate at even and
// linear at odd positions -- two 16-byte vectors (lo, hi) split in registers (j is a multiple of 8,
// so both vectors are 16-byte aligned).
__device__ __forceinline__ void split_glu_alternating(const float (&lo)[kVec], const float (&hi)[kVec],
                                                      float (&g)[kVec], float (&l)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    g[i] = lo[2 * i];
    l[i] = lo[2 * i + 1];
    g[i + kVec / 2] = hi[2 * i];
    l[i + kVec / 2] = hi[2 * i + 1];
  }
}
__device__ __forceinline__ void load_glu_alternating(const __nv_bfloat16* row, int j, float (&g)[kVec],
                                                     float (&l)[kVec]) {
  float lo[kVec], hi[kVec];
  load_bf16x8(row + 2 * j, lo);
  load_bf16x8(row + 2 * j + kVec, hi);
  split_glu_alternating(lo, hi, g, l);
}
__device__ __forceinline__ void store_glu_alternating(__nv_bfloat16* row, int j, const float (&g)[kVec],
                                                      const float (&l)[kVec]) {
  float lo[kVec], hi[kVec];
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    lo[2 * i] = g[i];
    lo[2 * i + 1] = l[i];
    hi[2 * i] = g[i + kVec / 2];
    hi[2 * i + 1] = l[i + kVec / 2];
  }
  store_bf16x8(row + 2 * j, lo);
  store_bf16x8(row + 2 * j + kVec, hi);
}

// The pre-activation of the 8 logical columns [j, j + 8) of a row as loaded, not yet converted:
// the gate and linear vectors (squared-relu: its input in `gate`), or with interleave 1 the 16
// physical columns [2j, 2j + 16). Loading apart from the arithmetic lets a caller issue the loads
// of later columns before it works on (and writes over) these.
struct HChunk {
  uint4 gate, linear;
};

template <Activation A>
__device__ __forceinline__ HChunk load_h_x8(const __nv_bfloat16* h_row, int j, int F, int interleave) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  HChunk h;
  if (kGated && interleave == 1) {
    h.gate = *reinterpret_cast<const uint4*>(h_row + 2 * j);
    h.linear = *reinterpret_cast<const uint4*>(h_row + 2 * j + kVec);
  } else {
    h.gate = *reinterpret_cast<const uint4*>(h_row + (kGated ? gate_col(j, F, interleave) : j));
    h.linear = kGated ? *reinterpret_cast<const uint4*>(h_row + linear_col(j, F, interleave)) : make_uint4(0, 0, 0, 0);
  }
  return h;
}

// The backward of activation x prob for the 8 logical columns [j, j + 8) of a row, from their
// pre-activation `h` (load_h_x8), the d_out values `go` and the row's prob: writes dh to dh_row
// (which may be the row h was loaded from), adds go * act_unscaled (the prob's gradient) to dp
// column by column, and writes the recomputed act x prob to act_row when one is given. fp32 math.
template <Activation A>
__device__ __forceinline__ void activation_backward_x8(const HChunk& h, __nv_bfloat16* dh_row, int j, int F,
                                                       int interleave, const ActConsts& c,
                                                       const float (&go)[kVec], float prob, float& dp,
                                                       __nv_bfloat16* act_row = nullptr) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  float g[kVec], l[kVec], dg[kVec], dl[kVec], act[kVec];
  const bool alternating = kGated && interleave == 1;
  if (alternating) {
    float lo[kVec], hi[kVec];
    unpack<__nv_bfloat16>(h.gate, lo);
    unpack<__nv_bfloat16>(h.linear, hi);
    split_glu_alternating(lo, hi, g, l);
  } else {
    unpack<__nv_bfloat16>(h.gate, g);
    if (kGated) unpack<__nv_bfloat16>(h.linear, l);
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    float a, dgi, dli;
    ActOp<A>::grad(g[i], kGated ? l[i] : 0.0f, c, a, dgi, dli);
    dp += go[i] * a;
    const float gp = go[i] * prob;
    dg[i] = gp * dgi;
    dl[i] = gp * dli;
    act[i] = a * prob;
  }
  if (alternating) {
    store_glu_alternating(dh_row, j, dg, dl);
  } else {
    store_bf16x8(dh_row + (kGated ? gate_col(j, F, interleave) : j), dg);
    if (kGated) store_bf16x8(dh_row + linear_col(j, F, interleave), dl);
  }
  if (act_row != nullptr) store_bf16x8(act_row + j, act);
}

// The same, loading h from h_row (dh_row may be h_row: every element is read before its gradient
// is written).
template <Activation A>
__device__ __forceinline__ void activation_backward_x8(const __nv_bfloat16* h_row, __nv_bfloat16* dh_row, int j,
                                                       int F, int interleave, const ActConsts& c,
                                                       const float (&go)[kVec], float prob, float& dp,
                                                       __nv_bfloat16* act_row = nullptr) {
  activation_backward_x8<A>(load_h_x8<A>(h_row, j, F, interleave), dh_row, j, F, interleave, c, go, prob, dp, act_row);
}

// Rows to process: all R, or the clamped end of the last group read on the device (graph-safe).
__device__ __forceinline__ int64_t valid_rows(const int32_t* group_offsets, int groups, int64_t R) {
  return group_offsets == nullptr ? R : clamped_offset(group_offsets, groups, R);
}

// Launch shape shared by forward and backward: one warp per row, 8 rows per 256-thread block.
// A warp's lanes take the row's 16-byte vectors round-robin, so a row's dprobs is summed in a fixed
// order (per lane, then a fixed shuffle tree): deterministic without atomics.
constexpr int kActThreads = 256;
constexpr int kActRowsPerBlock = kActThreads / 32;

}  // namespace moe::kernels
