// Router backward for the routings whose d logits are zero outside each token's k chosen experts
// (docs/router.md, "Backward of top-k routing"): top-k form, no balancing or z loss, and scores that
// depend on the chosen logits only -- a softmax renormalised over the k (Mixtral, Qwen), a softmax
// over the k chosen logits (GPT-OSS), a sigmoid with or without renormalisation (an expert bias or a
// group limit only steer the selection). A plain softmax (OLMoE) sends gradient to every expert of
// the row through its full-row sum and keeps the row kernel (router_backward.cu).
//
// Such a row's gradient needs the k chosen logits, the saved routing and the incoming d probs, not
// the row: per slot j of a chosen expert (alpha the scaling factor, g the incoming gradient, zero
// for a slot dropped by capacity or rounding),
//   softmax (renormalised or over the chosen): q = exp(z - max) / sum over the chosen,
//                                              dz = alpha q (g - sum_i g_i q_i);
//   sigmoid s, renormalised by S = sum s:      dz = alpha (g - sum_i g_i s_i / S) / S s (1 - s);
//   sigmoid, not renormalised:                 dz = alpha g s (1 - s).
// The row kernel reads every logit and recomputes the full-row scores, and ran at about a tenth of
// the copy bandwidth; this kernel reads the k logits it needs and writes the rows, mostly zeros
// (2.4-4.7x faster for 64 <= E <= 256, docs/router.md).
//
// Layout: a warp owns a tile of R consecutive rows (R: the rows that fit kTileBytes, at most two
// passes of slots).
// It zeroes the tile's d logits in shared memory, computes its slots -- KP lanes per row (k rounded
// up to a power of two), 32 / KP rows a pass, the row's sums a butterfly over its KP lanes (a fixed
// order: deterministic) -- writes each chosen expert's value into the tile, and copies the tile to
// d logits with 16-byte stores (the rows are contiguous). A row with non-finite logits (selected -1)
// stays zero.
#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

constexpr int kTileBytes = 4096;  // a warp's tile of d logits rows in shared memory

// A row's sum and maximum over its KP slot lanes, a butterfly each. (router_math's group_max
// orders float keys as integers; with it and group_sum this kernel's fp32 backward measured 1.5-6.5%
// slower on the H200, 2026-12-03.)
template <int KP>
__device__ __forceinline__ float slots_sum(float v) {
#pragma unroll
  for (int o = 1; o < KP; o *= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
template <int KP>
__device__ __forceinline__ float slots_max(float v) {
#pragma unroll
  for (int o = 1; o < KP; o *= 2) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <bool kBF16, int KP>
__global__ void __launch_bounds__(kThreads) backward_topk_kernel(RouterBackwardArgs a, int rows_per_tile) {
  __shared__ __align__(16) uint4 tiles_smem[kRouterWarps][kTileBytes / 16];
  using Out = std::conditional_t<kBF16, __nv_bfloat16, float>;
  constexpr int RP = 32 / KP;  // rows per pass
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, W = p.W, R = rows_per_tile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int j = lane % KP, rp = lane / KP;  // the lane's slot and row within a pass
  const int64_t row_bytes = int64_t{E} * sizeof(Out);
  const int tile_vecs = static_cast<int>(R * row_bytes / 16);
  uint4* const buf = tiles_smem[warp];
  Out* const buf_rows = reinterpret_cast<Out*>(buf);
  const bool soft = p.score == ScoreFunction::kSoftmax;
  const int64_t tiles = (int64_t{p.T} + R - 1) / R;

  for (int64_t tile = int64_t{blockIdx.x} * kRouterWarps + warp; tile < tiles;
       tile += int64_t{gridDim.x} * kRouterWarps) {
    const int64_t t0 = tile * R;
    for (int v = lane; v < tile_vecs; v += 32) buf[v] = make_uint4(0u, 0u, 0u, 0u);
    __syncwarp();  // zeroed before any slot writes
    for (int r0 = 0; r0 < R; r0 += RP) {  // the same passes for the whole warp
      const int r = r0 + rp;
      const int64_t t = t0 + r;
      bool on = r < R && t < p.T && j < k;
      int e = -1;
      float z = 0.0f, g = 0.0f;
      if (on) {
        on = __ldg(a.selected + t * W) >= 0;  // -1: a row with non-finite logits, zero gradient
        e = __ldg(a.selected + t * W + j);
        on = on && e >= 0 && e < E;  // (the forward fills every slot of a routed row with an
                                     // expert; saved outputs made elsewhere must not send a load
                                     // or a store outside the row)
      }
      if (on) {
        z = logit_at<kBF16>(p, t, e);
        // A slot dropped by capacity or rounding (index -1) gets no incoming gradient, but its
        // score stays in the renormalising sum, as in the forward.
        if (a.d_probs && __ldg(a.indices + t * k + j) == e) g = __ldg(a.d_probs + t * k + j);
      }
      float c;
      if (soft) {
        const float zm = slots_max<KP>(on ? z : -INFINITY);
        const float ez = on ? expf(z - zm) : 0.0f;
        const float q = ez / slots_sum<KP>(ez);
        const float gq = slots_sum<KP>(on ? g * q : 0.0f);
        c = p.alpha * q * (g - gq);
      } else {
        const float s = on ? sigmoid_score(z) : 0.0f;
        if (p.normalize) {
          const float S = slots_sum<KP>(s);
          const float gn = slots_sum<KP>(g * s) / S;
          c = p.alpha * (g - gn) / S * (s * (1.0f - s));
        } else {
          c = p.alpha * g * (s * (1.0f - s));
        }
      }
      if (on) buf_rows[r * E + e] = static_cast<Out>(c);  // a row's chosen experts are distinct
    }
    __syncwarp();  // every slot written before the copy
    const int64_t rows = std::min<int64_t>(R, p.T - t0);
    const int vecs = static_cast<int>(rows * row_bytes / 16);
    uint4* const dst = reinterpret_cast<uint4*>(static_cast<char*>(a.d_logits) + t0 * row_bytes);
    for (int v = lane; v < vecs; v += 32) dst[v] = buf[v];
    __syncwarp();  // copied out before the next tile zeroes the buffer
  }
}

template <bool kBF16, int KP>
void launch(const RouterBackwardArgs& a, cudaStream_t stream) {
  const int64_t row_bytes = int64_t{a.p.E} * (kBF16 ? 2 : 4);
  // The rows that fit the tile, at most two passes of slots: each pass waits on its loads (the
  // chosen experts, then their logits), and at E = 64, k = 8 eight passes a tile ran 20.3 us
  // against 13.7 with two (bench_router, 16 calls, H200).
  int R = 32;
  while (R > 1 && R * row_bytes > kTileBytes) R /= 2;
  while (R > 2 * (32 / KP)) R /= 2;
  const int64_t tiles = (int64_t{a.p.T} + R - 1) / R;
  const auto kernel = backward_topk_kernel<kBF16, KP>;
  const unsigned blocks = one_wave_grid_x(reinterpret_cast<const void*>(kernel), kThreads, tiles, kRouterWarps);
  kernel<<<blocks, kThreads, 0, stream>>>(a, R);
  MOE_CUDA_CHECK_LAUNCH();
}

template <bool kBF16>
void launch_for_type(const RouterBackwardArgs& a, cudaStream_t stream) {
  const int k = a.p.k;
  if (k <= 1) return launch<kBF16, 1>(a, stream);
  if (k <= 2) return launch<kBF16, 2>(a, stream);
  if (k <= 4) return launch<kBF16, 4>(a, stream);
  if (k <= 8) return launch<kBF16, 8>(a, stream);
  return launch<kBF16, 16>(a, stream);
}

}  // namespace
}  // namespace router

bool router_backward_is_topk_only(const RouterBackwardArgs& a) {
  const RouterRowParams& p = a.p;
  const bool losses = (p.aux_coeff != 0.0f && a.d_aux) || (p.seq_coeff != 0.0f && a.d_seq) ||
                      (p.z_coeff != 0.0f && a.d_z);
  const bool full_row_softmax = p.score == ScoreFunction::kSoftmax && !p.normalize && !p.softmax_after;
  // 16-byte rows of d logits (E a multiple of 8, aligned); k <= 16 fits the slot lanes. Below
  // E = 64 a row is a few vectors and the row kernel, 32 rows a warp, was as fast or faster (E = 8,
  // k = 2 / 8: 5.9 / 12.0 us against 6.4 / 18.0, docs/router.md).
  return a.form == RoutingForm::kTopK && !losses && !full_row_softmax && a.out_vec && p.E >= 64 && p.k >= 1 &&
         p.k <= 16;
}

void launch_router_backward_topk(const RouterBackwardArgs& a, cudaStream_t stream) {
  if (a.p.T == 0) return;
  if (a.p.bf16)
    router::launch_for_type<true>(a, stream);
  else
    router::launch_for_type<false>(a, stream);
}

}  // namespace moe::kernels
