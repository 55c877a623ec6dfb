// Router backward on the device: the forward's lane groups (router_math.cuh) recompute each row's
// scores from the logits and turn the incoming gradients (probs, loss scalars) into d logits
// (docs/router.md, Kernel design). The routing decisions come from the forward's saved outputs
// (selected, indices / map, counts), so nothing is re-selected and a bias changed since the forward
// does not matter. One pass over the logits; rows are read and d logits written with 16-byte
// vectors, the next rows copied ahead into the row ring (router_math.cuh).
#include <cuda_bf16.h>

#include "device/cuda_check.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

// Per-slot data of a row in shared memory: expert, incoming gradient, prob source (score, or
// logit with softmax-after).
struct SlotGrad {
  int e;
  float g, pv, pad;
};

// [RG, G NJ] floats (the slot coefficients of a row), [RG, W] SlotGrad, [G NJ] floats (d aux / d a),
// then the row ring (16-byte aligned).
__host__ __device__ inline size_t backward_smem_head(int G, int NJ, int W) {
  const size_t RG = size_t{kRouterWarps} * (32 / G);
  return (sizeof(float) * RG * G * NJ + sizeof(SlotGrad) * RG * W + sizeof(float) * G * NJ + 15) / 16 * 16;
}

// The lane's part of d logits row t.
template <int NJ, bool kBF16>
__device__ __forceinline__ void store_grad_row(const RouterBackwardArgs& a, int64_t t, int base, uint32_t vmask,
                                               const float (&d)[NJ]) {
  const RouterRowParams& p = a.p;
  if (a.out_vec) {
    if (base >= p.E) return;
    if constexpr (kBF16) {
      uint4* dst = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(a.d_logits) + t * p.E + base);
#pragma unroll
      for (int i = 0; i < NJ / 8; ++i) {
        uint32_t w[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const __nv_bfloat162 v = __floats2bfloat162_rn(d[8 * i + 2 * h], d[8 * i + 2 * h + 1]);
          w[h] = *reinterpret_cast<const uint32_t*>(&v);
        }
        dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
      float4* dst = reinterpret_cast<float4*>(static_cast<float*>(a.d_logits) + t * p.E + base);
#pragma unroll
      for (int i = 0; i < NJ / 4; ++i) dst[i] = make_float4(d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    if (!((vmask >> j) & 1u)) continue;
    const int64_t i = t * p.E + base + j;
    if constexpr (kBF16)
      static_cast<__nv_bfloat16*>(a.d_logits)[i] = __float2bfloat16(d[j]);
    else
      static_cast<float*>(a.d_logits)[i] = d[j];
  }
}

// Asks the L2 for what row t's backward reads besides the register-loaded logits: the saved
// routing (selected, indices or map) and the incoming d probs, and with logits the row itself.
// Each of these was a DRAM round trip on the row's critical path (the first one decides whether the
// row is routed at all), one row after another.
template <int NJ, int G>
__device__ __forceinline__ void prefetch_saved(const RouterBackwardArgs& a, int64_t t, const Lanes<G>& l, int base) {
  const RouterRowParams& p = a.p;
  if (t >= p.T) return;
  if (a.form == RoutingForm::kTopK) {
    if (l.lane_g == 0) {
      prefetch_l2(a.selected + t * p.W);
      prefetch_l2(a.indices + t * p.k);
      if (a.d_probs) prefetch_l2(a.d_probs + t * p.k);
    }
  } else {
    if (l.lane_g == 0) prefetch_l2(a.selected + t * p.W);
    if (base < p.E) {
      prefetch_l2(a.map + t * p.E + base);
      if (a.d_probs) prefetch_l2(a.d_probs + t * p.E + base);
    }
  }
}

template <int NJ, int G, bool kBF16>
__global__ void __launch_bounds__(kThreads, NJ == 8 ? 3 : 2) backward_kernel(RouterBackwardArgs a, int32_t tiles_per_block) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int RPW = 32 / G;
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, W = p.W;
  const Lanes<G> L = lanes_of<G>();
  const int warp = threadIdx.x / 32;
  const int rg = warp * RPW + L.slot;
  const size_t RG = size_t{kRouterWarps} * RPW;
  float* ubuf = reinterpret_cast<float*>(smem_raw) + rg * (G * NJ);
  SlotGrad* slots = reinterpret_cast<SlotGrad*>(smem_raw + sizeof(float) * RG * G * NJ) + rg * W;
  float* ua_aux = reinterpret_cast<float*>(smem_raw + sizeof(float) * RG * G * NJ + sizeof(SlotGrad) * RG * W);

  const int base = L.lane_g * NJ;
  const uint32_t vmask = lane_expert_mask<NJ>(base, E);
  const bool seq = p.seq_coeff != 0.0f && a.d_seq != nullptr;
  const bool aux = p.aux_coeff != 0.0f && a.d_aux != nullptr;
  const bool zl = p.z_coeff != 0.0f && a.d_z != nullptr;
  const bool soft = p.score == ScoreFunction::kSoftmax;
  const bool topk = a.form == RoutingForm::kTopK;
  // Row-independent factors: d loss / d a of the switch loss (per expert), the sequence loss scale,
  // the z-loss factor (times lse per row).
  const float T = static_cast<float>(p.T);
  const float aux_scale = aux ? *a.d_aux * p.aux_coeff * E / (T * k) / T : 0.0f;
  for (int e = threadIdx.x; e < G * NJ; e += kThreads)
    ua_aux[e] = aux && e < E ? aux_scale * static_cast<float>(a.selection_counts[e]) : 0.0f;
  __syncthreads();
  float seq_scale = 0.0f;
  if (seq) {
    const float Ls = static_cast<float>(p.seq_length), B = static_cast<float>(p.T / p.seq_length);
    seq_scale = *a.d_seq * p.seq_coeff / B * (E / (k * Ls)) / Ls;
  }
  const float gz_scale = zl ? *a.d_z * p.z_coeff / T * 2.0f : 0.0f;

  const int64_t tile_end = block_tile_end(p.T, RPW, tiles_per_block);
  int64_t tile = int64_t{blockIdx.x} * tiles_per_block + warp;
  // The logits come through the row ring (router_math.cuh), the saved routing through L2 prefetches
  // kRingRows tiles ahead.
  uint4* const ring = reinterpret_cast<uint4*>(smem_raw + backward_smem_head(G, NJ, W)) + threadIdx.x;
  constexpr int kRingStride = ring_vecs<NJ, kBF16>() * kThreads;
  const int64_t src_stride = tile_stride_bytes<kBF16>(p, G);
  const char* src = row_src<kBF16>(p, tile * RPW + L.slot, base);  // the next row to copy
#pragma unroll
  for (int d = 0; d < kRingRows; ++d, src += src_stride) {
    const int64_t td = tile + d * kRouterWarps, t = td * RPW + L.slot;
    ring_issue<NJ, kBF16>(p, t, td < tile_end && t < p.T, base, src, ring + d * kRingStride);
    if (td < tile_end) prefetch_saved<NJ>(a, t, L, base);
  }
  int ring_slot = 0;
  for (; tile < tile_end; tile += kRouterWarps) {
    const int64_t t = tile * RPW + L.slot;
    float z[NJ];
    {
      cp_async_wait<kRingRows - 1>();
      uint4* const slot = ring + ring_slot * kRingStride;
      RawRow<NJ, kBF16> raw;
      ring_read<NJ, kBF16>(p, t < p.T, base, slot, raw);
      unpack_row<NJ, kBF16>(raw, z);
      const int64_t ahead = tile + kRingRows * kRouterWarps, ta = ahead * RPW + L.slot;
      ring_issue<NJ, kBF16>(p, ta, ahead < tile_end && ta < p.T, base, src, slot);
      src += src_stride;
      if (ahead < tile_end) prefetch_saved<NJ>(a, ta, L, base);
      ring_slot = ring_slot + 1 == kRingRows ? 0 : ring_slot + 1;
    }
    // Control flow is uniform across the warp: a group whose row is past T (the last tile) or was
    // routed nowhere (non-finite input: zero gradient) computes along with its neighbours and only
    // its reads of saved data and its store depend on it. Every collective below -- shuffles, redux
    // over a group's mask, __syncwarp -- is executed by all 32 lanes of the warp together.
    const bool live = t < p.T;  // the group's (all its lanes share t)
    const bool routed = live && __ldg(a.selected + t * W) >= 0;
    float dz[NJ];

    // Scores (as the forward computed them).
    float mx = 0.0f, inv = 0.0f, lse = 0.0f;
    float ex[NJ], s[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) ex[j] = 0.0f;
    if (soft || zl) softmax_parts<NJ>(z, L, zl, mx, inv, lse, ex);
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = soft ? __fmul_rn(ex[j], inv) : sigmoid_score(z[j]);
    float ssum = 1.0f;
    if (!soft && (aux || seq)) {
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) sum += s[j];
      ssum = group_sum(sum, L);
    }

    // Slots (lane j holds slots j, j + G, ...): the expert, its incoming gradient, the sums.
#pragma unroll
    for (int j = 0; j < NJ; ++j) ubuf[base + j] = 0.0f;
    float S = 0.0f, GS = 0.0f, zm = -INFINITY;
#pragma unroll 1
    for (int j = L.lane_g; j < W; j += G) {
      int e = routed ? __ldg(a.selected + t * W + j) : -1;
      if (e >= E) e = -1;  // saved outputs made elsewhere: never a load or a store outside the row
      float g = 0.0f, pv = 0.0f;
      if (e >= 0) {
        const bool kept = topk ? (j < k && __ldg(a.indices + t * k + j) == e) : a.map[t * E + e] != 0;
        if (kept && a.d_probs) g = topk ? __ldg(a.d_probs + t * k + j) : __ldg(a.d_probs + t * E + e);
        const float ze = logit_at<kBF16>(p, t, e);
        pv = p.softmax_after ? ze : score_of(p, ze, mx, inv);
        if (j < k) {
          S += pv;
          GS += g * pv;
          zm = fmaxf(zm, ze);
        }
      }
      slots[j] = SlotGrad{e, g, pv, 0.0f};
    }
    float se = 0.0f, Gp = 0.0f, Gn = 0.0f;
    if (p.softmax_after) {  // pp = exp(z - zm) / se over the chosen; Gp = sum g pp
      zm = group_max(zm, L);
      for (int j = L.lane_g; j < k; j += G) se += expf(slots[j].pv - zm);
      se = group_sum(se, L);
      for (int j = L.lane_g; j < k; j += G) Gp += slots[j].g * (expf(slots[j].pv - zm) / se);
      Gp = group_sum(Gp, L);
    } else if (p.normalize) {
      S = group_sum(S, L);
      Gn = group_sum(GS, L) / S;
    }
    __syncwarp();  // ubuf zeroed by every lane before any slot writes it
    // Slot coefficients: d/ds of the slot's expert, or d/dz directly (softmax over the chosen).
#pragma unroll 1
    for (int j = L.lane_g; j < W; j += G) {
      const SlotGrad sl = slots[j];
      if (sl.e < 0) continue;
      const bool chosen = j < k;
      float c = p.alpha * sl.g;
      if (p.softmax_after)
        c = chosen ? p.alpha * (expf(sl.pv - zm) / se) * (sl.g - Gp) : 0.0f;
      else if (p.normalize && chosen)
        c = p.alpha * (sl.g - Gn) / S;
      ubuf[sl.e] = c;  // the experts of a row's slots are distinct
    }
    __syncwarp();
    float u[NJ], direct[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float c = ubuf[base + j];
      u[j] = p.softmax_after ? 0.0f : c;
      direct[j] = p.softmax_after ? c : 0.0f;
    }
    __syncwarp();  // ubuf and slots are rewritten by the next row

    // Balancing losses: d / d a (the balancing scores).
    float ua[NJ];
    const int64_t b = seq ? t / p.seq_length : 0;
#pragma unroll
    for (int i = 0; i < NJ / 4; ++i) {
      const float4 q = reinterpret_cast<const float4*>(ua_aux + base)[i];
      ua[4 * i] = q.x;
      ua[4 * i + 1] = q.y;
      ua[4 * i + 2] = q.z;
      ua[4 * i + 3] = q.w;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      if (seq && routed && ((vmask >> j) & 1u)) ua[j] += seq_scale * static_cast<float>(__ldg(a.seq_counts + b * E + base + j));
    }
    if (soft) {
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) dot += (u[j] + ua[j]) * s[j];
      dot = group_sum(dot, L);
#pragma unroll
      for (int j = 0; j < NJ; ++j) dz[j] = s[j] * (u[j] + ua[j] - dot) + direct[j];
    } else {
      float dot = 0.0f;
      if (aux || seq) {
        const float is = 1.0f / ssum;
#pragma unroll
        for (int j = 0; j < NJ; ++j) dot += ua[j] * (s[j] * is);
        dot = group_sum(dot, L);
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const float ds = u[j] + ((aux || seq) ? (ua[j] - dot) / ssum : 0.0f);
        dz[j] = ds * s[j] * (1.0f - s[j]) + direct[j];
      }
    }
    if (zl) {
      const float gz = gz_scale * lse;
#pragma unroll
      for (int j = 0; j < NJ; ++j) dz[j] += gz * __fmul_rn(ex[j], inv);
    }
    if (!routed) {  // a non-finite row's gradient is zero
#pragma unroll
      for (int j = 0; j < NJ; ++j) dz[j] = 0.0f;
    }
    if (live) store_grad_row<NJ, kBF16>(a, t, base, vmask, dz);
  }
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

template <int NJ, int G, bool kBF16>
void launch_backward(const RouterBackwardArgs& a, const RouterRowGrid& grid, cudaStream_t stream) {
  const size_t smem = backward_smem_head(G, NJ, a.p.W) + ring_bytes<NJ, kBF16>();
  auto kernel = backward_kernel<NJ, G, kBF16>;
  // Past 48 KiB of shared memory (dynamic + the kernel's static few KiB) a launch needs the opt-in.
  if (smem + 8 * 1024 > 48 * 1024)
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<grid.blocks, kThreads, smem, stream>>>(a, grid.tiles_per_block);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace router

void launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream) {
  using namespace router;
  const RouterRowParams& p = a.p;
  if (p.T == 0) return;
  if (router_backward_is_topk_only(a)) return launch_router_backward_topk(a, stream);
  const RouterRowGrid grid = router_row_grid(p.T, p.G);
  if (router_experts_per_lane(p.E) == 16) {
    if (p.bf16)
      launch_backward<16, 32, true>(a, grid, stream);
    else
      launch_backward<16, 32, false>(a, grid, stream);
    return;
  }
  switch (p.G) {
    case 1: return p.bf16 ? launch_backward<8, 1, true>(a, grid, stream) : launch_backward<8, 1, false>(a, grid, stream);
    case 2: return p.bf16 ? launch_backward<8, 2, true>(a, grid, stream) : launch_backward<8, 2, false>(a, grid, stream);
    case 4: return p.bf16 ? launch_backward<8, 4, true>(a, grid, stream) : launch_backward<8, 4, false>(a, grid, stream);
    case 8: return p.bf16 ? launch_backward<8, 8, true>(a, grid, stream) : launch_backward<8, 8, false>(a, grid, stream);
    case 16: return p.bf16 ? launch_backward<8, 16, true>(a, grid, stream) : launch_backward<8, 16, false>(a, grid, stream);
    default: return p.bf16 ? launch_backward<8, 32, true>(a, grid, stream) : launch_backward<8, 32, false>(a, grid, stream);
  }
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
