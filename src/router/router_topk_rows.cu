// The router's forward for plain top-k routing of bf16 logits (docs/router.md, "Plain top-k"):
// softmax (before top-k, renormalised or not, or over the k chosen logits) or sigmoid, a scaling
// factor, no expert bias, no group limit, no loss, no capacity or rounding, k <= 8, E <= 512 with
// 16-byte vector rows (the general kernel's: E a multiple of 8, of 16 above 256). Everything else runs the general row kernel (router_forward.cu).
//
// Why a kernel of its own: the general kernel gives each row a group of up to 32 lanes and selects
// by k rounds of a group max over presorted lane keys; at E = 256 that is ~830 warp instructions
// per row, most of them the rounds, the full-row softmax and the variants' bookkeeping, and the
// kernel is bound by instruction issue (Nsight Compute). Here a row has G lanes (E / 32 rounded up
// to a power of two, at least 1), each lane owns V (up to 4) 16-byte vectors of 8 experts, and
// top-k is a merge of sorted lists:
//   - each vector's 8 keys are sorted by a fixed 19-exchange network, and the lane keeps the top L
//     (L = 2, 4 or 8 >= k) of its vectors by bitonic merges (a max against the other list reversed,
//     then log2(L) exchange stages);
//   - the G lanes of a row merge their lists in a butterfly (L shuffles per step), so every lane
//     ends with the row's sorted top L -- no shared memory, no rounds;
//   - a renormalised softmax (or softmax over the chosen logits) needs no full-row softmax: the
//     row's max is the winner's logit, and the k exponentials cancel the full sum.
//   - lane g of a row writes L / G consecutive slots (at least one) with 16- or 8-byte stores when
//     k = L and the outputs are aligned (one by one otherwise), and at G <= 2 the lanes that chose
//     one expert in the same slot position add to its count once (match_any):
//     scalar stores and a shared atomic per row made k = 8 at small E 2x slower.
// Keys are the general kernel's Key32 (bf16 value, then the lower expert id), so the selection is
// the same bit for bit. Selection counts go to a shared histogram, then to the router's scratch
// accumulator; the last block writes the counts and clears it (as the general kernel does).
#include <algorithm>

#include "device/cuda_check.h"
#include "moe/device_errors.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

constexpr int kMaxExperts = 512;  // 16 lanes x 32 experts
// Experts per lane (V = kExpertsPerLane / 8 vectors) from E = kExpertsPerLane up. Measured against
// 64 (half the lanes, twice the vectors): 32 is as fast or faster at every E and k of bench_router
// but E = 256, k = 8 (within 2%), 1.16x at E = 256, k = 2, where more lanes per row hide more
// latency.
constexpr int kExpertsPerLane = 32;
constexpr int kMaxK = 8;

// Keeps in a the top L of the sorted (descending) lists a and b: elementwise max against b reversed
// gives a bitonic sequence holding the top L of both; log2(L) exchange stages sort it.
template <int L>
__device__ __forceinline__ void merge_top(uint32_t (&a)[L], const uint32_t (&b)[L]) {
#pragma unroll
  for (int i = 0; i < L; ++i) a[i] = max(a[i], b[L - 1 - i]);
#pragma unroll
  for (int stride = L / 2; stride > 0; stride /= 2)
#pragma unroll
    for (int i = 0; i < L; ++i)
      if ((i & stride) == 0) compare_swap(a[i], a[i + stride]);
}

__device__ __forceinline__ uint32_t bits_of(int v) { return static_cast<uint32_t>(v); }
__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }

// Stores n consecutive 4-byte values from registers as 16- or 8-byte vectors (dst aligned to 4 n bytes).
template <int n, class T>
__device__ __forceinline__ void store_slots(T* dst, const T (&v)[n]) {
  static_assert(sizeof(T) == 4, "int32 or float slots");
  if constexpr (n % 4 == 0) {
#pragma unroll
    for (int i = 0; i < n; i += 4)
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(bits_of(v[i]),
                                                      bits_of(v[i + 1]), bits_of(v[i + 2]), bits_of(v[i + 3]));
  } else if constexpr (n == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(bits_of(v[0]), bits_of(v[1]));
  } else {
    dst[0] = v[0];
  }
}

// A finite bf16 value's key lies in [kLowestFinite, kAboveFinite): +inf and NaN with the sign bit
// clear order above it, -inf and NaN with the sign bit set below it (Key32 keeps the value's
// ordered bits in the high half).
constexpr uint32_t kAboveFinite = 0xff800000u;
constexpr uint32_t kLowestFinite = 0x00800000u;

// G lanes per row, V 16-byte vectors per lane (vector c = i G + lane_g of the row: a warp's load
// i covers G consecutive vectors of each of its 32 / G rows), lists of L keys.
template <int G, int V, int L>
__global__ void __launch_bounds__(kThreads, 4) topk_rows_kernel(RouterForwardArgs a) {
  constexpr int RPW = 32 / G;
  constexpr int kS = L >= G ? L / G : 1;  // output slots per lane
  __shared__ int32_t hist[kMaxExperts];
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, vecs = E / 8;
  for (int e = threadIdx.x; e < E; e += kThreads) hist[e] = 0;
  __syncthreads();
  const Lanes<G> lanes = lanes_of<G>();
  const int lane_g = lanes.lane_g;
  const bool soft = p.score == ScoreFunction::kSoftmax;
  // The full-row sum of exponentials: a softmax before top-k that is not renormalised.
  const bool full_sum = soft && !p.softmax_after && !p.normalize;
  const bool renorm = p.softmax_after || p.normalize;
  uint32_t bits = 0;

  const int64_t tiles = (int64_t{p.T} + RPW - 1) / RPW;
  const int warp = threadIdx.x / 32;
  // Vector stores of a lane's kS slots: k = L slots per row puts them at a multiple of kS, aligned
  // when the outputs start at a multiple of 4 kS bytes.
  const uintptr_t out_bits = reinterpret_cast<uintptr_t>(a.indices) | reinterpret_cast<uintptr_t>(a.selected) |
                             reinterpret_cast<uintptr_t>(a.probs);
  const bool vector_out = k == L && out_bits % (4 * kS) == 0;
  for (int64_t tile = int64_t{blockIdx.x} * kRouterWarps + warp; tile < tiles;
       tile += int64_t{gridDim.x} * kRouterWarps) {
    const int64_t t = tile * RPW + lanes.slot;
    const bool live = t < p.T;
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.logits) + t * E);
    uint4 raw[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = i * G + lane_g;
      raw[i] = live && c < vecs ? __ldg(row + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    // The lane's sorted top L, and the lowest key of its vectors (non-finite test).
    uint32_t top[L], low = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = i * G + lane_g;
      const uint32_t w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
      uint32_t key[8];
      const uint32_t id0 = Key32::id_of(c * 8);  // expert c 8 + j has id id0 - j
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        key[2 * m] = Key32::make_id(__uint_as_float(w[m] << 16), id0 - 2 * m);
        key[2 * m + 1] = Key32::make_id(__uint_as_float(w[m] & 0xffff0000u), id0 - 2 * m - 1);
      }
      const bool valid = live && c < vecs;
      if (!valid) {
#pragma unroll
        for (int j = 0; j < 8; ++j) key[j] = 0u;  // below every real key: never chosen
      }
      sort_desc<8>(key);  // ptxas makes each exchange an integer min and max
      if (valid) low = min(low, key[7]);
      if (i == 0) {
#pragma unroll
        for (int j = 0; j < L; ++j) top[j] = key[j];
      } else {
        uint32_t b[L];
#pragma unroll
        for (int j = 0; j < L; ++j) b[j] = key[j];
        merge_top<L>(top, b);
      }
    }
#pragma unroll
    for (int o = 1; o < G; o *= 2) {
      uint32_t b[L];
#pragma unroll
      for (int j = 0; j < L; ++j) b[j] = __shfl_xor_sync(kFull, top[j], o);
      merge_top<L>(top, b);
    }
    // Every lane of the row now holds its sorted top L. A row with a non-finite logit is routed
    // nowhere (the general kernel's rule). The vote runs on every lane: the warp stays converged.
    const bool low_bad = group_any(low < kLowestFinite, lanes);
    const bool bad = live && (top[0] >= kAboveFinite || low_bad);
    float z[L], s[L];
#pragma unroll
    for (int j = 0; j < L; ++j) z[j] = Key32::value(top[j]);
    const float mx = z[0];
    // Scores of the chosen slots: exp(z - max) for a softmax (the row's max is the winner's logit,
    // no bias), the sigmoid otherwise; then the sum the probs are divided by.
    float den = 0.0f;
#pragma unroll
    for (int j = 0; j < L; ++j) {
      s[j] = soft ? expf(z[j] - mx) : sigmoid_score(z[j]);
      if (j < k) den += s[j];
    }
    float inv = 1.0f;
    if (full_sum) {  // the softmax's own denominator: every logit of the row, read again (L1 hits)
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = i * G + lane_g;
        if (live && c < vecs) {
          const uint4 r = __ldg(row + c);
          const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
          for (int m = 0; m < 4; ++m)
            sum += expf(__uint_as_float(w[m] << 16) - mx) + expf(__uint_as_float(w[m] & 0xffff0000u) - mx);
        }
      }
      inv = 1.0f / group_sum(sum, lanes);
    }
    if (bad) bits |= kErrNonFiniteLogit;
    // Every lane holds the whole sorted list; lane g writes the kS consecutive slots g kS .. onward,
    // as vectors where it can, so a warp's consecutive rows leave as contiguous bytes.
    int ev[kS];
    float pv[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      ev[i] = -1;
      pv[i] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < L; ++j) {
      if (j / kS != lane_g) continue;
      // The general kernel's formulas: a score ex / sum, a renormalised one score / (sum of the k).
      const float score = full_sum ? __fmul_rn(s[j], inv) : s[j];
      ev[j % kS] = bad ? -1 : Key32::expert(top[j]);
      pv[j % kS] = bad ? 0.0f : (renorm ? score / den : score) * p.alpha;
    }
    const int j0 = lane_g * kS;
    const bool mine = live && j0 < k;  // the lane owns slots of this row
    if (mine) {
      const int64_t o = t * k + j0;
      if (vector_out) {
        store_slots<kS>(a.indices + o, ev);
        store_slots<kS>(a.selected + o, ev);
        store_slots<kS>(a.probs + o, pv);
      } else {
#pragma unroll
        for (int i = 0; i < kS; ++i) {
          if (j0 + i >= k) break;
          a.indices[o + i] = ev[i];
          a.selected[o + i] = ev[i];
          a.probs[o + i] = pv[i];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      const bool counted = mine && !bad && j0 + i < k;
      if constexpr (G <= 2) {
        // Slot g kS + i of the warp's 16 or 32 rows in one instruction: lanes that chose the same
        // expert add once (shared atomics on a few experts would serialise on the same addresses).
        const unsigned peers = __match_any_sync(kFull, counted ? ev[i] : -1);
        if (counted && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[ev[i]], __popc(peers));
      } else {
        if (counted) atomicAdd(&hist[ev[i]], 1);
      }
    }
  }
  bits = __reduce_or_sync(kFull, bits);
  if ((threadIdx.x & 31) == 0 && bits) atomicOr(a.error_word, bits);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads)
    if (hist[e]) atomicAdd(a.count_acc + e, hist[e]);
  if (!last_block_done(a.tickets)) return;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const int32_t c = atomicExch(a.count_acc + e, 0);
    a.selection_counts[e] = c;
    a.counts32[e] = c;
    if (a.counts64) a.counts64[e] = c;
  }
  if (threadIdx.x == 0) a.tickets[0] = 0;
}

template <int G, int V>
void launch_for_list(const RouterForwardArgs& a, int blocks, cudaStream_t stream) {
  const int k = a.p.k;
  if (k <= 2)
    topk_rows_kernel<G, V, 2><<<blocks, kThreads, 0, stream>>>(a);
  else if (k <= 4)
    topk_rows_kernel<G, V, 4><<<blocks, kThreads, 0, stream>>>(a);
  else
    topk_rows_kernel<G, V, 8><<<blocks, kThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace
}  // namespace router

bool router_topk_rows_apply(const RouterForwardArgs& a) {
  const RouterRowParams& p = a.p;
  return p.bf16 && p.vec && p.E % 8 == 0 && p.E <= router::kMaxExperts && p.k <= router::kMaxK && p.W == p.k &&
         a.form == RoutingForm::kTopK && a.select == SelectKey::kNone && p.bias == nullptr && p.groups == 1 &&
         p.aux_coeff == 0.0f && p.seq_coeff == 0.0f && p.z_coeff == 0.0f;
}

void launch_router_topk_rows(const RouterForwardArgs& a, cudaStream_t stream) {
  using namespace router;
  const int E = a.p.E;
  // Lanes per row and vectors per lane: kExpertsPerLane experts per lane, one lane per row below.
  int G = 1;
  while (G * kExpertsPerLane < E) G *= 2;
  int V = kExpertsPerLane / 8;
  if (G == 1) {
    V = 1;
    while (V * 8 < E) V *= 2;
  }
  const int64_t tiles = (int64_t{a.p.T} + 32 / G - 1) / (32 / G);
  // Any grid gives the same results (integer counts only); one warp per 32 / G rows up to the cap.
  const int blocks = static_cast<int>(std::clamp<int64_t>((tiles + kRouterWarps - 1) / kRouterWarps, 1, kRouterMaxBlocks));
  constexpr int VL = kExpertsPerLane / 8;
  switch (G) {
    case 1:
      if (V == 1) return launch_for_list<1, 1>(a, blocks, stream);
      if (V == 2) return launch_for_list<1, 2>(a, blocks, stream);
      return launch_for_list<1, VL>(a, blocks, stream);
    case 2: return launch_for_list<2, VL>(a, blocks, stream);
    case 4: return launch_for_list<4, VL>(a, blocks, stream);
    case 8: return launch_for_list<8, VL>(a, blocks, stream);
    default: return launch_for_list<16, VL>(a, blocks, stream);
  }
}

}  // namespace moe::kernels
