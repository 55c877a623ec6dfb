// Fused fc2 dgrad + activation backward (docs/fused.md): one persistent Hopper kernel computes, for
// every row r of every expert group (probs applied in the activation),
//
//   dact[r, :] = bf16(dY[r, :] W2[e])                                  -- never stored
//   dh[r, :]   = bf16(activation'(h[r, :]) * dact[r, :] * p[r])         -- written over h
//   dprobs[r]  = sum_j dact[r, j] * act_unscaled(h[r, :])[j]
//   act[r, :]  = bf16(act_unscaled(h[r, :]) * p[r])                     -- optional (fc2 wgrad)
//
// with the roundings of the unfused path (grouped GEMM into dact, activation_backward), so dh is
// the unfused path's whenever the GEMM accumulations agree; dprobs sums the same products in
// another order (fp32). dY[r, :] is row r of dY_perm, or -- gathering -- row row_slots[r] / slots
// of dy (zeros where row_slots[r] < 0): the combine's backward is never materialised; the gathered
// rows can be written to dY_perm on the way (for a weight gradient that reads them) while the
// tensor cores work. Plain C++ interface; the kernel lives in fc2_dgrad_activation.cu.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "moe/activation.h"

namespace moe::fused {

// How the two consumer warp groups share the tiles (docs/fused.md): ping-pong -- a 64-row tile each,
// in turn, one's epilogue under the other's main loop -- or cooperative -- both on one 128-row
// tile, 64 rows each, half the weight traffic per row but the epilogue in the open. The results are
// bitwise the same. kAuto takes the cooperative one where the reduction (H) is long enough that the
// lighter traffic pays for the exposed epilogue (measured: H >= 4096).
enum class Fc2DgradSchedule { kAuto, kPingPong, kCooperative };

struct Fc2DgradActivationArgs {
  // dY rows: dY_perm [R, H] (row_slots null) or dy [T, H] gathered through row_slots [R].
  const void* dy = nullptr;
  const int32_t* row_slots = nullptr;
  int slots = 1;
  void* dy_out = nullptr;  // gathering: also write the gathered rows to dY_perm [R, H] (or null)
  const int32_t* group_offsets = nullptr;  // [E + 1], read on the device (clamped into [0, R])
  int experts = 0;
  int64_t R = 0;
  int H = 0;  // multiple of 8
  int F = 0;  // multiple of 8
  // fc2 weights [H, F] per expert: one contiguous [E, H, F] tensor (read by TMA) or table[e].
  const void* w2 = nullptr;
  const void* const* w2_table = nullptr;
  const float* probs = nullptr;  // [R] or null (scale 1)
  ActivationParams activation;
  void* h = nullptr;          // bf16 [R, fc1_out]: the saved pre-activation, overwritten by dh
  void* act_out = nullptr;    // bf16 [R, F]: the recomputed activation x prob, or null
  float* dprobs = nullptr;    // [R] or null
  float* dprobs_partial = nullptr;  // [feature blocks, R] when fc2_dgrad_feature_blocks(F) > 1 and dprobs
  int sm_count = 0;
  Fc2DgradSchedule schedule = Fc2DgradSchedule::kAuto;
};

// Whether the fused kernel handles these sizes (host check; the caller falls back or refuses).
// Empty string: yes; otherwise the reason.
std::string fc2_dgrad_activation_unsupported(int experts, int64_t H, int64_t F, const ActivationParams& activation);

// Feature blocks of one row block: the number of dprobs partial sums per row (1: none are needed).
int fc2_dgrad_feature_blocks(int64_t F);

// Enqueues the kernel (and the fixed-order sum of the dprobs partials); nothing when R == 0.
// Graph-safe: group sizes are read on the device only.
void launch_fc2_dgrad_activation(const Fc2DgradActivationArgs& args, cudaStream_t stream);

}  // namespace moe::fused
