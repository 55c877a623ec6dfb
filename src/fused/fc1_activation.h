// Fused fc1 + activation x prob (docs/fused.md): one persistent Hopper kernel computes, for every
// row r of every expert group,
//
//   h[r, :]   = bf16(A[r, :] W1[e]^T)  (+ b1[e], rounded to bf16 once more)       -- saved for backward
//   act[r, :] = bf16(act(h[r, :]) * p[r])
//
// with exactly the roundings of the unfused path (grouped GEMM into h, bias_add, activation_forward),
// so both paths give the same h and act whenever their GEMM accumulations agree. A[r, :] is row r of
// x_perm, or -- gathering -- row row_slots[r] / slots of x (zeros where row_slots[r] < 0): no
// separate permute pass; the gathered rows can be written to x_perm on the way (for the backward)
// while the tensor cores work. Plain C++ interface; the kernel lives in fc1_activation.cu.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moe/activation.h"

namespace moe::fused {

struct Fc1ActivationArgs {
  // A rows: x_perm [R, H] (row_slots null) or x [T, H] gathered through row_slots [R].
  const void* a = nullptr;
  const int32_t* row_slots = nullptr;
  void* a_out = nullptr;  // gathering: also write the gathered rows to x_perm [R, H] (or null)
  int slots = 1;
  const int32_t* group_offsets = nullptr;  // [E + 1], read on the device (clamped into [0, R])
  int experts = 0;
  int64_t R = 0;  // rows of h / act (and of row_slots)
  int H = 0;      // multiple of 8
  int F = 0;      // multiple of 8
  // fc1 weights [fc1_out, H] per expert: base + e * stride (single grouped) or table[e].
  const void* w1_base = nullptr;
  int64_t w1_stride_bytes = 0;
  const void* const* w1_table = nullptr;
  // fc1 bias rows [fc1_out] (both null: no bias).
  const void* b1_base = nullptr;
  const void* const* b1_table = nullptr;
  const float* probs = nullptr;  // [R] or null (scale 1)
  ActivationParams activation;
  void* h = nullptr;    // bf16 [R, fc1_out]
  void* act = nullptr;  // bf16 [R, F]
  int sm_count = 0;
};

// Whether the fused kernel handles these sizes (host check; the caller falls back or refuses).
// Empty string: yes; otherwise the reason.
std::string fc1_activation_unsupported(int experts, int64_t H, int64_t F, const ActivationParams& activation);

// Enqueues the kernel (nothing when R == 0). Graph-safe: group sizes are read on the device only.
void launch_fc1_activation(const Fc1ActivationArgs& args, cudaStream_t stream);

}  // namespace moe::fused
