// The router's forward for top-k routing on sigmoid scores with an expert bias for selection and / or
// a group limit (DeepSeek-V3's routing and its kin; docs/router.md, "Biased and group-limited
// top-k"): bf16 or fp32 logits in 16-byte vector rows, 64 <= E <= 512, k <= 8, no loss, no capacity
// or rounding, groups of a power-of-two number of 4-expert vectors. Everything else runs the general
// row kernel (router_forward.cu), whose selection and probs this kernel reproduces bit for bit.
//
// Why a kernel of its own: the general kernel gives such a row 32 lanes of 8 experts at E = 256 and
// selects by sorting each lane's 64-bit keys and k rounds of a group max (~1300 warp instructions a
// row, issue-bound: Nsight Compute). Here a row has G lanes (E / 32 rounded up to a power of two),
// each lane owns 8 vectors of 4 experts (vector c = i G + lane_g: experts 4c .. 4c + 3, the plain
// kernel's fp32 layout; bf16 rows are read 8 bytes a vector), and:
//   - every expert's selection value v = sigmoid(z) + bias (z itself without a bias) is computed
//     once, in the general kernel's fp32 operations;
//   - each vector's two largest values are taken once; with a group limit, a group's score is the
//     sum of its two largest biased scores: its vectors' top twos, staged in shared memory and merged
//     by one lane of the row per group; the row's groups are ranked in shared memory (score
//     descending, then the lower group id), and the vectors of the groups not kept leave the
//     selection (their elements are never candidates; their top two is -inf);
//   - top-k on v is the plain kernel's fp32 selection: with k <= G lanes a row, the candidate filter
//     (a threshold at most the row's k-th largest v from the lanes' largest and second largest -- a
//     tree over the vectors' top twos -- then the candidates ranked in shared memory, or inserted
//     into a list of 2 and merged), else every vector sorted and the lanes' lists merged; keys are
//     Key64 (v, then the lower expert id);
//   - a chosen expert's prob is its sigmoid score, the logit read again (L1), and the k scores are
//     summed in the general kernel's order (a butterfly over its lanes, one slot each: pairwise in
//     slot order), so renormalised probs are its bits too.
// The selection's steps after the threshold (the candidates' places, ranking or insertion, the
// lanes' merges, the slot stores and counts) follow the plain kernel's code rather than share it:
// the two kernels calling common helpers for them (forced inline) compiled to other register
// allocations and ran 1-4% slower on the H100 (docs/measurements/router.md).
#include <algorithm>
#include <cfloat>
#include <type_traits>

#include "device/cuda_check.h"
#include "device/launch_geometry.h"
#include "moe/device_errors.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"
#include "router/router_rows.cuh"

namespace moe::kernels {
namespace router {
namespace {

constexpr int kVectors = 8;      // vectors of 4 experts per lane: 32 experts a lane
constexpr int kMaxGroups = 32;   // the configuration's limit (a keep mask of 32 bits)
constexpr int kMinExperts = 64;  // two lanes a row and more (fewer experts: the general kernel)

// The lane's vectors of row t as fp32 (zero for vectors not in `valid`): 16-byte loads of fp32
// logits, 8-byte loads of four bf16 ones; mx and mn: their NaN-propagating maximum and minimum (bf16:
// packed, two logits an operation).
template <class In, int G>
__device__ __forceinline__ void load_row_part(const RouterRowParams& p, int64_t t, uint32_t valid, int lane_g,
                                              float (&z)[kVectors][4], float& mx, float& mn) {
  __nv_bfloat162 hi, lo;  // bf16: packed maximum and minimum
#pragma unroll
  for (int i = 0; i < kVectors; ++i) {
    const int c = i * G + lane_g;
    const bool ok = (valid >> i) & 1u;
    if constexpr (std::is_same_v<In, float>) {
      uint4 q = make_uint4(0u, 0u, 0u, 0u);
      if (ok) q = __ldg(reinterpret_cast<const uint4*>(static_cast<const float*>(p.logits) + t * p.E) + c);
      z[i][0] = __uint_as_float(q.x), z[i][1] = __uint_as_float(q.y);
      z[i][2] = __uint_as_float(q.z), z[i][3] = __uint_as_float(q.w);
    } else {
      uint2 q = make_uint2(0u, 0u);
      if (ok) q = __ldg(reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.logits) + t * p.E) + c);
      z[i][0] = __uint_as_float(q.x << 16), z[i][1] = __uint_as_float(q.x & 0xffff0000u);
      z[i][2] = __uint_as_float(q.y << 16), z[i][3] = __uint_as_float(q.y & 0xffff0000u);
      const __nv_bfloat162 x = as_bf162(q.x), y = as_bf162(q.y);
      hi = i == 0 ? __hmax2_nan(x, y) : __hmax2_nan(hi, __hmax2_nan(x, y));
      lo = i == 0 ? __hmin2_nan(x, y) : __hmin2_nan(lo, __hmin2_nan(x, y));
    }
  }
  if constexpr (std::is_same_v<In, float>) {
    mx = mn = z[0][0];
#pragma unroll
    for (int i = 0; i < kVectors; ++i)
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        mx = fmax_nan(mx, z[i][m]);
        mn = fmin_nan(mn, z[i][m]);
      }
  } else {
    mx = fmax_nan(__low2float(hi), __high2float(hi));
    mn = fmin_nan(__low2float(lo), __high2float(lo));
  }
}

// 1 / x for 1 <= x < 2^126: the compiler's IEEE division takes its fast path there, an approximate
// reciprocal and one Newton step -- these operations, so the same bits -- and checks the range per
// division (four operations and a branch each); the caller checks it once per row part.
__device__ __forceinline__ float reciprocal_in_range(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return __fmaf_rn(r, -__fmaf_rn(x, r, -1.0f), r);
}

// The two largest of a vector's four values (t1 >= t2; the second largest as a multiset).
__device__ __forceinline__ void vector_top2(const float (&x)[4], float& t1, float& t2) {
  t1 = fmaxf(x[0], x[1]);
  t2 = fminf(x[0], x[1]);
  merge_top2(t1, t2, fmaxf(x[2], x[3]), fminf(x[2], x[3]));
}

// Group limit: the bit mask of the row's kept groups (the same on every lane of the row). t1, t2:
// the top two biased scores of each of the lane's vectors (past E those of z = 0: in vectors no
// group of the row holds); nv: vectors per group (a power of two); pairs: V / 2 kThreads 16-byte
// slots of shared memory, each thread's own; gsc: the row's scratch of kMaxGroups floats. Every
// lane of the warp calls it (a ballot). The vectors' top twos go to shared memory (two vectors a
// 16-byte store), and lane g of a row merges those of its groups g, g + G, ... (a group's vectors
// are consecutive: nv consecutive lanes' vector i, or nv / G consecutive vectors of every lane):
// fewer operations than butterflies that leave every group's top two on each of its lanes.
template <int G>
__device__ __forceinline__ uint32_t kept_groups_of_row(const RouterRowParams& p, const Lanes<G>& lanes, int nv,
                                                       const float (&t1)[kVectors], const float (&t2)[kVectors],
                                                       uint4* pairs, float* gsc) {
#pragma unroll
  for (int i = 0; i < kVectors; i += 2)
    pairs[(i / 2) * kThreads + threadIdx.x] = make_uint4(__float_as_uint(t1[i]), __float_as_uint(t2[i]),
                                                         __float_as_uint(t1[i + 1]), __float_as_uint(t2[i + 1]));
  __syncwarp();
  // Vector c of the row: lane c % G's vector c / G, at float2 index 2 ((c / G / 2) kThreads + thread) + c / G % 2.
  const float2* const row_pairs = reinterpret_cast<const float2*>(pairs) + 2 * ((threadIdx.x & ~31) + lanes.slot * G);
  const int turn = lanes.lane_g + lanes.slot;  // each lane starts at another vector: fewer bank conflicts
  if (nv == G) {
    // Group q is vector q of the row's G lanes (so at most kVectors groups): every loop unrolled,
    // the groups ranked from registers by the rule of kept_group_mask (DeepSeek-V3's 8 groups at
    // E = 32 G take this path: 1.03-1.20x the loops below on the H100).
    float score[(kVectors + G - 1) / G];
#pragma unroll
    for (int j = 0; j * G < kVectors; ++j) {
      const int q = j * G + lanes.lane_g;
      float g1 = -INFINITY, g2 = -INFINITY;
      if (q < p.groups) {
        const float2* const first = row_pairs + 2 * (q >> 1) * kThreads + (q & 1);
#pragma unroll
        for (int n = 0; n < G; ++n) {
          const float2 o = first[2 * ((n + turn) & (G - 1))];
          merge_top2(g1, g2, o.x, o.y);
        }
        gsc[q] = g1 + g2;
      }
      score[j] = g1 + g2;
    }
    __syncwarp();
    float all[kVectors];  // the row's scores (those past its groups not counted)
#pragma unroll
    for (int r = 0; r < kVectors; r += 4) {
      const float4 f = reinterpret_cast<const float4*>(gsc)[r / 4];
      all[r] = f.x, all[r + 1] = f.y, all[r + 2] = f.z, all[r + 3] = f.w;
    }
    uint32_t keep = 0;
    const unsigned low = (1u << G) - 1u;
#pragma unroll
    for (int j = 0; j * G < kVectors; ++j) {
      const int q = j * G + lanes.lane_g;
      int rank = 0;  // groups ahead of q: a higher score, or the same and a lower id
#pragma unroll
      for (int r = 0; r < kVectors; ++r)
        rank += (r < p.groups && (all[r] > score[j] || (all[r] == score[j] && r < q))) ? 1 : 0;
      const bool kept = q < p.groups && rank < p.topk_groups;
      keep |= ((__ballot_sync(kFull, kept) >> (lanes.slot * G)) & low) << (j * G);
    }
    __syncwarp();  // the scratch is rewritten next (candidates) and by the next row
    return keep;
  }
  const int log_g = __ffs(G) - 1;
  for (int q = lanes.lane_g; q < p.groups; q += G) {
    float g1 = -INFINITY, g2 = -INFINITY;
    const int c0 = q * nv;
    if (nv <= G) {  // uniform: the group is vector i = c0 / G of nv consecutive lanes
      const int i = c0 >> log_g;
      const float2* const first = row_pairs + 2 * ((i >> 1) * kThreads + (c0 & (G - 1))) + (i & 1);
      for (int n = 0; n < nv; ++n) {
        const float2 o = first[2 * ((n + turn) & (nv - 1))];
        merge_top2(g1, g2, o.x, o.y);
      }
    } else {
      for (int n = 0; n < nv; ++n) {
        const int c = c0 + ((n + turn) & (nv - 1)), i = c >> log_g;
        const float2 o = row_pairs[2 * ((i >> 1) * kThreads + (c & (G - 1))) + (i & 1)];
        merge_top2(g1, g2, o.x, o.y);
      }
    }
    gsc[q] = g1 + g2;
  }
  __syncwarp();
  const uint32_t keep = kept_group_mask<G>(gsc, p.groups, p.topk_groups, lanes);
  __syncwarp();  // the scratch is rewritten next (candidates) and by the next row
  return keep;
}

// G lanes per row, lists of L keys; kFilter: the candidate filter (k <= G), else every vector sorted.
template <class In, int G, int L, bool kFilter>
__global__ void __launch_bounds__(kThreads, 3) biased_rows_kernel(RouterForwardArgs a) {
  constexpr int V = kVectors, RPW = 32 / G;
  constexpr bool kBF16 = std::is_same_v<In, __nv_bfloat16>;
  constexpr int kS = L >= G ? L / G : 1;  // output slots per lane
  constexpr int M = L / kS;               // lanes that own slots
  constexpr bool kRank = kFilter && L >= 4;
  static_assert(G >= 2 && G * 4 * V <= kMaxExperts, "two to sixteen lanes a row");
  __shared__ int32_t hist[kMaxExperts];
  __shared__ __align__(16) float bias_s[kMaxExperts];
  // The filter reads a candidate's value back from here: this thread's vector i at
  // staged[i * kThreads + threadIdx.x].
  // The group limit's vector top twos use its first V / 2 kThreads slots before.
  __shared__ uint4 staged[(kFilter ? V : V / 2) * kThreads];
  // Per row: its group scores (kMaxGroups floats), then its candidates to rank (kMaxRowCandidates).
  static_assert(kMaxRowCandidates * sizeof(uint64_t) >= kMaxGroups * sizeof(float), "scratch holds both");
  __shared__ __align__(16) uint64_t row_keys[kRouterWarps * RPW * kMaxRowCandidates];
  __shared__ uint64_t row_top[kRank ? kRouterWarps * RPW * L : 1];
  __shared__ int bias_bad;
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, vecs = E / 4;
  if (threadIdx.x == 0) bias_bad = 0;
  for (int e = threadIdx.x; e < E; e += kThreads) hist[e] = 0;
  __syncthreads();
  // The bias, staged once per block (0 past E and without a bias); a non-finite one poisons every row.
  for (int e = threadIdx.x; e < G * 4 * V; e += kThreads) {
    const float b = p.bias && e < E ? __ldg(p.bias + e) : 0.0f;
    if (!(fabsf(b) < INFINITY)) bias_bad = 1;  // any writer writes 1
    bias_s[e] = b;
  }
  __syncthreads();
  const bool bias_ok = *static_cast<volatile int*>(&bias_bad) == 0;  // one load, not re-read
  const Lanes<G> lanes = lanes_of<G>();
  const int lane_g = lanes.lane_g;
  const bool by_z = p.bias == nullptr;  // no bias: the logits order the experts, the scores rank the groups
  const bool grouped = p.groups > 1;
  const int nv = grouped ? E / p.groups / 4 : 1;
  uint32_t bits = 0;

  const int64_t tiles = (int64_t{p.T} + RPW - 1) / RPW;
  const int warp = threadIdx.x / 32;
  const int row_index = warp * RPW + lanes.slot;
  uint64_t* const scratch = row_keys + row_index * kMaxRowCandidates;
  const uintptr_t out_bits = reinterpret_cast<uintptr_t>(a.indices) | reinterpret_cast<uintptr_t>(a.selected) |
                             reinterpret_cast<uintptr_t>(a.probs);
  const bool vector_out = k == L && out_bits % (4 * kS) == 0;
  uint32_t in_row = 0;  // bit i: vector i inside the row
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (i * G + lane_g < vecs) in_row |= 1u << i;
  const uint32_t lane_id0 = Key64::id_of(lane_g * 4);  // expert 4 (i G + lane_g) + m has id lane_id0 - 4 i G - m
  const int64_t tile_stride = int64_t{gridDim.x} * kRouterWarps;
  for (int64_t tile = int64_t{blockIdx.x} * kRouterWarps + warp; tile < tiles; tile += tile_stride) {
    const int64_t t = tile * RPW + lanes.slot;
    const bool live = t < p.T;
    const uint32_t valid = live ? in_row : 0u;
    float z[V][4], mx, mn;
    load_row_part<In, G>(p, t, valid, lane_g, z, mx, mn);
    // Non-finite logits (or bias): the row is routed nowhere (the general kernel's rule).
    const bool any_bad = group_any(!(mx < INFINITY && mn > -INFINITY) || !bias_ok, lanes);  // a vote: every lane
    const bool bad = live && any_bad;
    // Selection values: v = sigmoid(z) + bias (the general kernel's operations), or z without a bias.
    // Every element is scored, past E too (z = 0 there: a branch per element cost more than the
    // sigmoid); the vectors past E and, with a group limit, outside the kept groups leave the
    // selection below, and no group of the row holds a vector past E.
    // With every z above -87 each 1 + exp(-z) is below 2^126 (e^87 < 2^126), so sigmoid_score's
    // division is its fast path: reciprocal_in_range, no check per element. Otherwise (or NaN) the
    // lane takes sigmoid_score itself.
    float v[V][4];  // the biased scores first
    if (mn > -87.0f) {  // one branch for the row part: the compiler branched per element on the test
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float4 b = reinterpret_cast<const float4*>(bias_s)[i * G + lane_g];
        const float bm[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) v[i][m] = __fadd_rn(reciprocal_in_range(1.0f + expf(-z[i][m])), bm[m]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float4 b = reinterpret_cast<const float4*>(bias_s)[i * G + lane_g];
        const float bm[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int m = 0; m < 4; ++m) v[i][m] = __fadd_rn(sigmoid_score(z[i][m]), bm[m]);
      }
    }
    // Each vector's two largest: the group scores' and the lane's extremes' (a tree over them).
    float t1[V], t2[V];
#pragma unroll
    for (int i = 0; i < V; ++i) vector_top2(v[i], t1[i], t2[i]);
    uint32_t keep = 0;
    if (grouped) keep = kept_groups_of_row<G>(p, lanes, nv, t1, t2, staged, reinterpret_cast<float*>(scratch));  // uniform
    // Without a bias the logits order the experts: read again (L1) rather than held in registers
    // through the scores and the group limit.
    if (by_z) {
      float unused_mx, unused_mn;
      load_row_part<In, G>(p, t, valid, lane_g, v, unused_mx, unused_mn);
#pragma unroll
      for (int i = 0; i < V; ++i) vector_top2(v[i], t1[i], t2[i]);
    }
    // The vectors that take part: inside the row and, with a group limit, in a kept group. The
    // others' elements never become candidates (their values stay as they are: no select per
    // element) and their top twos are -inf.
    uint32_t taking = in_row;
    if (grouped && nv == G) {
      taking &= keep;  // vector i is group i
    } else if (grouped) {
      const int shift = __ffs(nv) - 1;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int q = (i * G + lane_g) >> shift;  // past E: a group id >= groups (never kept)
        if (!(q < kMaxGroups && ((keep >> q) & 1u))) taking &= ~(1u << i);
      }
    }
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const bool in = (taking >> i) & 1u;
      t1[i] = in ? t1[i] : -INFINITY;
      t2[i] = in ? t2[i] : -INFINITY;
    }
    // The lists: keys of the taking vectors only (at least k experts: k <= topk_groups x group size).
    const uint32_t listed = live ? taking : 0u;
    uint4 raw[V];  // the values as the fp32 selection helpers read them
#pragma unroll
    for (int i = 0; i < V; ++i)
      raw[i] = make_uint4(__float_as_uint(v[i][0]), __float_as_uint(v[i][1]), __float_as_uint(v[i][2]),
                          __float_as_uint(v[i][3]));

    // The lane's sorted top L (of its candidates, with the filter), or the row's top L ranked in
    // shared memory. Every vote runs on every lane: the warp stays converged.
    uint64_t top[L];
    bool ranked = false;
    if constexpr (kFilter) {
      constexpr bool kSecond = L >= 4;
      // The lane's largest and second largest value: its vectors' top twos merged in a tree.
#pragma unroll
      for (int span = 1; span < V; span *= 2)
#pragma unroll
        for (int i = 0; i + span < V; i += 2 * span) merge_top2(t1[i], t2[i], t1[i + span], t2[i + span]);
      const float first = t1[0], second = t2[0];
      float tau = group_kth_largest<G>(first, k, lane_g);
      if constexpr (kSecond) tau = fmaxf(tau, group_kth_largest<G>(second, (k + 1) / 2, lane_g));
      // Bit 4 i + m for each element m of a listed vector i.
      uint32_t listed_bits = listed;
      listed_bits = (listed_bits | listed_bits << 12) & 0x000f000fu;
      listed_bits = (listed_bits | listed_bits << 6) & 0x03030303u;
      listed_bits = (listed_bits | listed_bits << 3) & 0x11111111u;
      listed_bits *= 0xfu;
      uint32_t mask = bad ? 0u : candidate_mask_fp32<V>(raw, tau) & listed_bits;
      const int count = __popc(mask);
      int row_count = 0, place = 0;
      if constexpr (kRank) {
        int upto = count;
#pragma unroll
        for (int o = 1; o < G; o *= 2) {
          const int y = __shfl_up_sync(kFull, upto, o, G);
          if (lane_g >= o) upto += y;
        }
        row_count = __shfl_sync(kFull, upto, G - 1, G);
        place = upto - count;
      }
      if (__any_sync(kFull, count > kMaxLaneCandidates || row_count > kMaxRowCandidates)) {
        lane_top_sorted_fp32<G, V, L>(raw, listed, lane_g, top);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) staged[i * kThreads + threadIdx.x] = raw[i];
        auto candidate_key = [&](int b) {
          const float* mine = reinterpret_cast<const float*>(staged) + 4 * threadIdx.x;
          const int i = b >> 2, m = b & 3;
          return Key64::make_id(mine[i * (4 * kThreads) + m], lane_id0 - i * (4 * G) - m);
        };
        if constexpr (kRank) {
          // The row's candidates in lane order, each ranked by the number of the row's keys above
          // it (the plain kernel's fp32 ranking; keys are distinct).
          static_assert(G >= 4, "four lanes write the list's zero padding");
          if (row_count + lane_g < kMaxRowCandidates && lane_g < 4) scratch[row_count + lane_g] = 0u;
#pragma unroll
          for (int n = 0; n < kMaxLaneCandidates; ++n) {
            if (mask == 0u) break;
            const int b = __ffs(mask) - 1;
            mask &= mask - 1u;
            scratch[place + n] = candidate_key(b);
          }
          __syncwarp();
          uint64_t* const row_out = row_top + row_index * L;
          const int most = __reduce_max_sync(kFull, row_count);
          for (int j = lane_g; j < most; j += G) {
            if (j < row_count) {
              const uint64_t key = scratch[j];
              const int rank = keys_above(scratch, row_count, key);
              if (rank < L) row_out[rank] = key;
            }
          }
          __syncwarp();
          ranked = true;
        } else {
#pragma unroll
          for (int j = 0; j < L; ++j) top[j] = 0u;
#pragma unroll
          for (int n = 0; n < kMaxLaneCandidates; ++n) {
            if (mask == 0u) break;
            const int b = __ffs(mask) - 1;
            mask &= mask - 1u;
            uint64_t key = candidate_key(b);
#pragma unroll
            for (int j = 0; j < (n + 1 < L ? n + 1 : L); ++j) {  // insertion into the sorted list
              const uint64_t hi = max(top[j], key);
              key = min(top[j], key);
              top[j] = hi;
            }
          }
        }
      }
    } else {
      lane_top_sorted_fp32<G, V, L>(raw, listed, lane_g, top);
    }
    // Lane g owns slots g kS .. g kS + kS - 1 (lanes past L / kS own none).
    uint64_t own[kS];
    if (kRank && ranked) {
      const uint64_t* const row_out = row_top + row_index * L;
#pragma unroll
      for (int i = 0; i < kS; ++i) own[i] = row_out[(lane_g & (M - 1)) * kS + i];
    } else {
#pragma unroll
      for (int o = 1; o < G; o *= 2) {
        uint64_t b[L];
#pragma unroll
        for (int j = 0; j < L; ++j) b[j] = __shfl_xor_sync(kFull, top[j], o);
        merge_top<L>(top, b);
      }
#pragma unroll
      for (int i = 0; i < kS; ++i) own[i] = pick_entry<M, kS>(top, lane_g & (M - 1), i);
    }
    const int j0 = lane_g * kS;
    const bool mine = live && !bad && j0 < k;  // the lane owns slots of this routed row
    int ev[kS];
    float s[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      ev[i] = Key64::expert(own[i]);
      // The chosen expert's score: sigmoid of its logit (the key's own value without a bias).
      const bool scored = mine && j0 + i < k;
      const float ze = !scored ? 0.0f : by_z ? Key64::value(own[i]) : logit_at<kBF16>(p, t, ev[i]);
      s[i] = scored ? sigmoid_score(ze) : 0.0f;
    }
    // The sum the probs are divided by, in the general kernel's order: a butterfly over its lanes
    // (at least 8 a row here, one slot each) adds the k scores pairwise in slot order.
    float den = 0.0f;
    if (p.normalize) {  // a kernel argument: the whole warp takes the same branch
      // Pairwise over the lane's slots, then a butterfly over the row's lanes (0 past k and on the
      // lanes that own no slot: x + 0 is x): each lane adds its partner's partial sum to its own,
      // the same additions as the slot-order tree (a + b and b + a are the same bits).
      float q[kS];
#pragma unroll
      for (int i = 0; i < kS; ++i) q[i] = s[i];
#pragma unroll
      for (int width = 1; width < kS; width *= 2)
#pragma unroll
        for (int j = 0; j + width < kS; j += 2 * width) q[j] += q[j + width];
      den = q[0];
#pragma unroll
      for (int o = 1; o < G; o *= 2) den += __shfl_xor_sync(kFull, den, o);
    }
    if (bad) bits |= kErrNonFiniteLogit;
    float pv[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      ev[i] = bad ? -1 : ev[i];
      pv[i] = bad ? 0.0f : (p.normalize ? s[i] / den : s[i]) * p.alpha;
    }
    if (live && j0 < k) {
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
      const bool counted = mine && j0 + i < k;
      if constexpr (G <= 2) {
        // Lanes that chose the same expert in the same slot position add once (see the plain kernel).
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
  publish_counts_by_arrival(hist, E, a);
}

// The grid: with eight lanes a row (E = 256), one wave of resident CTAs whose warps loop over the
// tiles (device/launch_geometry.h): 1.02x at E = 256 with k = 2 and 8 on the H100; a CTA per eight
// tiles elsewhere (one wave was 1.03-1.11x slower at E = 64 and 128; E = 512 not measured).
template <class In, int G, int L, bool kFilter>
void launch_kernel(const RouterForwardArgs& a, cudaStream_t stream) {
  const int64_t tiles = (int64_t{a.p.T} + 32 / G - 1) / (32 / G);
  const auto kernel = biased_rows_kernel<In, G, L, kFilter>;
  const unsigned blocks =
      G == 8 ? one_wave_grid_x(reinterpret_cast<const void*>(kernel), kThreads, tiles, kRouterWarps)
             : static_cast<unsigned>(std::clamp<int64_t>((tiles + kRouterWarps - 1) / kRouterWarps, 1, kRouterMaxBlocks));
  kernel<<<blocks, kThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

template <class In, int G>
void launch_for_lanes(const RouterForwardArgs& a, cudaStream_t stream) {
  const int k = a.p.k;
  // The filter where the list's k fits G (its threshold needs k lane maxima); two lanes a row sort
  // (as the plain kernel, where the filter measured slower).
  if (k <= 2) return launch_kernel<In, G, 2, (G >= 4)>(a, stream);
  if (k <= 4) return launch_kernel<In, G, 4, (G >= 4)>(a, stream);
  return launch_kernel<In, G, 8, (G >= 8)>(a, stream);
}

template <class In>
void launch_for_type(const RouterForwardArgs& a, cudaStream_t stream) {
  const int E = a.p.E;
  if (E <= 64) return launch_for_lanes<In, 2>(a, stream);
  if (E <= 128) return launch_for_lanes<In, 4>(a, stream);
  if (E <= 256) return launch_for_lanes<In, 8>(a, stream);
  return launch_for_lanes<In, 16>(a, stream);
}

}  // namespace
}  // namespace router

bool router_biased_rows_apply(const RouterForwardArgs& a) {
  const RouterRowParams& p = a.p;
  if (!(p.vec && p.E % 8 == 0 && p.E >= router::kMinExperts && p.E <= router::kMaxExperts && p.k <= router::kMaxK &&
        p.W == p.k && a.form == RoutingForm::kTopK && a.select == SelectKey::kNone &&
        p.score == ScoreFunction::kSigmoid && !p.softmax_after && (p.bias != nullptr || p.groups > 1) &&
        p.aux_coeff == 0.0f && p.seq_coeff == 0.0f && p.z_coeff == 0.0f))
    return false;
  if (p.groups == 1) return true;
  const int group_size = p.E / p.groups;
  const int nv = group_size / 4;  // vectors per group: a power of two
  return group_size % 4 == 0 && (nv & (nv - 1)) == 0;
}

void launch_router_biased_rows(const RouterForwardArgs& a, cudaStream_t stream) {
  using namespace router;
  if (a.p.bf16) return launch_for_type<__nv_bfloat16>(a, stream);
  return launch_for_type<float>(a, stream);
}

}  // namespace moe::kernels
