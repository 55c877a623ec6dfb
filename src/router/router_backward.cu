// Router backward on the device: one warp per token row recomputes the row's scores from the
// logits and turns the incoming gradients (probs, loss scalars) into d logits (docs/router.md).
// The routing decisions come from the forward's saved outputs (selected, indices / map, counts),
// so nothing is re-selected and a bias changed since the forward does not matter.
#include <cuda_bf16.h>

#include "device/cuda_check.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

constexpr int kThreads = kRouterWarps * 32;

template <int NJ>
__global__ void __launch_bounds__(kThreads) backward_kernel(RouterBackwardArgs a) {
  const RouterRowParams& p = a.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t{blockIdx.x} * kRouterWarps + warp;
  if (t >= p.T) return;  // the whole warp leaves: only warp-level sync below
  const int E = p.E, k = p.k, W = p.W;
  auto store = [&](int j, float v) {
    const int e = j * 32 + lane;
    if (e >= E) return;
    if (p.bf16)
      static_cast<__nv_bfloat16*>(a.d_logits)[t * E + e] = __float2bfloat16(v);
    else
      static_cast<float*>(a.d_logits)[t * E + e] = v;
  };
  const int my_e = lane < W ? a.selected[t * W + lane] : -1;
  if (__shfl_sync(kFull, my_e, 0) < 0) {  // a row with non-finite input: routed nowhere
#pragma unroll
    for (int j = 0; j < NJ; ++j) store(j, 0.0f);
    return;
  }
  const bool seq = p.seq_coeff != 0.0f && a.d_seq != nullptr;
  const bool aux = p.aux_coeff != 0.0f && a.d_aux != nullptr;
  const bool zl = p.z_coeff != 0.0f && a.d_z != nullptr;
  float z[NJ];
  load_row<NJ>(p, t, lane, z);
  RowScores<NJ> sc;
  row_scores<NJ>(p, lane, z, aux || seq, zl, sc);

  // Incoming gradient of each kept slot (lane w holds slot w).
  bool kept = false;
  float g = 0.0f;
  if (my_e >= 0) {
    if (a.form == RoutingForm::kTopK)
      kept = lane < k && a.indices[t * k + lane] == my_e;
    else
      kept = a.map[t * E + my_e] != 0;
    if (kept && a.d_probs) g = a.form == RoutingForm::kTopK ? a.d_probs[t * k + lane] : a.d_probs[t * E + my_e];
  }
  float my_s = 0.0f, my_z = 0.0f;
  for (int w = 0; w < W; ++w) {
    const int e_w = __shfl_sync(kFull, my_e, w);
    if (e_w < 0) continue;  // uniform
    const float s_w = from_owner<NJ>(sc.s, e_w), z_w = from_owner<NJ>(z, e_w);
    if (lane == w) {
      my_s = s_w;
      my_z = z_w;
    }
  }
  // Slot contributions: d/ds of the slot's expert, or d/dz directly (softmax over the chosen).
  const bool chosen = lane < k;
  float c = lane < W ? p.alpha * g : 0.0f;
  if (p.softmax_after) {
    const float zm = warp_max(chosen ? my_z : -INFINITY);
    const float ex = chosen ? expf(my_z - zm) : 0.0f;
    const float pp = ex / warp_sum(ex);
    const float G = warp_sum(chosen ? g * pp : 0.0f);
    c = chosen ? p.alpha * pp * (g - G) : 0.0f;
  } else if (p.normalize) {
    const float S = warp_sum(chosen ? my_s : 0.0f);
    const float G = warp_sum(chosen ? g * my_s : 0.0f) / S;
    if (chosen) c = p.alpha * (g - G) / S;
  }
  float u[NJ], direct[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) u[j] = direct[j] = 0.0f;
  for (int w = 0; w < W; ++w) {
    const int e_w = __shfl_sync(kFull, my_e, w);
    const float c_w = __shfl_sync(kFull, c, w);
    if (e_w >= 0 && lane == e_w % 32) {
      if (p.softmax_after)
        add_at<NJ>(direct, e_w / 32, c_w);
      else
        add_at<NJ>(u, e_w / 32, c_w);
    }
  }
  // Balancing losses: d / d a (the balancing scores).
  float ua[NJ];
  const float T = static_cast<float>(p.T);
  const float aux_scale = aux ? *a.d_aux * p.aux_coeff * E / (T * k) / T : 0.0f;
  float seq_scale = 0.0f;
  const int64_t b = seq ? t / p.seq_length : 0;
  if (seq) {
    const float L = static_cast<float>(p.seq_length), B = static_cast<float>(p.T / p.seq_length);
    seq_scale = *a.d_seq * p.seq_coeff / B * (E / (k * L)) / L;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = j * 32 + lane;
    ua[j] = 0.0f;
    if (e < E) {
      if (aux) ua[j] += aux_scale * static_cast<float>(a.selection_counts[e]);
      if (seq) ua[j] += seq_scale * static_cast<float>(a.seq_counts[b * E + e]);
    }
  }
  float dz[NJ];
  if (p.score == ScoreFunction::kSoftmax) {
    float dot = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) dot += (u[j] + ua[j]) * sc.s[j];
    dot = warp_sum(dot);
#pragma unroll
    for (int j = 0; j < NJ; ++j) dz[j] = sc.s[j] * (u[j] + ua[j] - dot) + direct[j];
  } else {
    float dot = 0.0f;
    if (aux || seq) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) dot += ua[j] * sc.a[j];
      dot = warp_sum(dot);
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float ds = u[j] + ((aux || seq) ? (ua[j] - dot) / sc.ssum : 0.0f);
      dz[j] = ds * sc.s[j] * (1.0f - sc.s[j]) + direct[j];
    }
  }
  if (zl) {
    const float gz = *a.d_z * p.z_coeff / T * 2.0f * sc.lse;
#pragma unroll
    for (int j = 0; j < NJ; ++j) dz[j] += gz * sc.sm[j];
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) store(j, dz[j]);
}

template <typename C>
__global__ void __launch_bounds__(512) update_bias_kernel(const C* counts, float* bias, int E, float rate) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long mine = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) mine += static_cast<unsigned long long>(counts[e]);
  atomicAdd(&total, mine);  // integers: exact in any order
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    // sign(mean - count) = sign(sum - E * count), exact in integers.
    const long long diff = static_cast<long long>(total) - static_cast<long long>(counts[e]) * E;
    bias[e] += diff > 0 ? rate : diff < 0 ? -rate : 0.0f;
  }
}

}  // namespace
}  // namespace router

void launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream) {
  using namespace router;
  if (a.p.T == 0) return;
  const unsigned blocks = static_cast<unsigned>((a.p.T + kRouterWarps - 1) / kRouterWarps);
  const int E = a.p.E;
  if (E <= 32)
    backward_kernel<1><<<blocks, kThreads, 0, stream>>>(a);
  else if (E <= 64)
    backward_kernel<2><<<blocks, kThreads, 0, stream>>>(a);
  else if (E <= 128)
    backward_kernel<4><<<blocks, kThreads, 0, stream>>>(a);
  else if (E <= 256)
    backward_kernel<8><<<blocks, kThreads, 0, stream>>>(a);
  else
    backward_kernel<16><<<blocks, kThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

void launch_update_expert_bias(const void* counts, bool counts64, float* bias, int E, float rate,
                               cudaStream_t stream) {
  using namespace router;
  if (E == 0) return;
  if (counts64)
    update_bias_kernel<int64_t><<<1, 512, 0, stream>>>(static_cast<const int64_t*>(counts), bias, E, rate);
  else
    update_bias_kernel<int32_t><<<1, 512, 0, stream>>>(static_cast<const int32_t*>(counts), bias, E, rate);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
