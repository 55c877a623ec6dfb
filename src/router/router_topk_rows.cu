// The router's forward for plain top-k routing of bf16 or fp32 logits (docs/router.md, "Plain
// top-k"): softmax (before top-k, renormalised or not, or over the k chosen logits) or sigmoid, a
// scaling factor, no expert bias, no group limit, no loss, no capacity or rounding, k <= 8, E <= 512
// with 16-byte vector rows (the general kernel's: E a multiple of 8, of 16 above 256). Everything
// else runs the general row kernel (router_forward.cu).
//
// Why a kernel of its own: the general kernel gives each row a group of up to 32 lanes and selects
// by k rounds of a group max over presorted lane keys; at E = 256 that is ~830 warp instructions
// per row, most of them the rounds, the full-row softmax and the variants' bookkeeping, and the
// kernel is bound by instruction issue (Nsight Compute). Here a row has G lanes (E / 32 rounded up
// to a power of two, at least 1), each lane owns V (up to 4) 16-byte vectors of 8 bf16 experts
// (fp32: below), and top-k is a merge of sorted lists:
//   - each vector's 8 keys are sorted by a fixed 19-exchange network, and the lane keeps the top L
//     (L = 2, 4 or 8 >= k) of its vectors by bitonic merges (a max against the other list reversed,
//     then log2(L) exchange stages);
//   - the G lanes of a row merge their lists in a butterfly (L shuffles per step), so every lane
//     ends with the row's sorted top L -- no rounds;
//   - a renormalised softmax (or softmax over the chosen logits) needs no full-row softmax: the
//     row's max is the winner's logit, and the k exponentials cancel the full sum.
//   - lane g of a row scores only the L / G consecutive slots it writes (at least one; the sum of
//     the k scores gathered by shuffles in slot order), with 16- or 8-byte stores when
//     k = L and the outputs are aligned (one by one otherwise), and at G <= 2 the lanes that chose
//     one expert in the same slot position add to its count once (match_any):
//     scalar stores and a shared atomic per row made k = 8 at small E 2x slower.
// With four or more lanes per row (E > 64) and k <= G, the lane does not sort every vector (the
// candidate filter): it first finds a threshold no larger than the row's k-th largest logit, and
// only its logits at or above it (candidates; ~2-16 per row of 256 at k = 2..8 for Gaussian
// logits) enter its list:
//   - packed bf16 max / min over the lane's words give its largest logit and the non-finite test
//     (NaN-propagating max and min), and for k > 2 a second value: the smaller of the low halves'
//     and the high halves' maxima, two of its logits, so at most its second largest;
//   - the threshold is the k-th largest of the G lane maxima (a bitonic sort across the group, a
//     butterfly for k = G and for k = 2), for k > 2 raised to the ceil(k / 2)-th largest of the lanes' second
//     values if that is higher (so many lanes hold two logits at or above it: at E = 256, k = 8,
//     about 16 candidates per row instead of 21; the exact second largest leaves 12 but costs two
//     more operations a word);
//   - a packed compare per word gives a 32-bit candidate mask, and the lane inserts each candidate
//     into the filled part of its sorted list (the value read back from its row part staged in
//     shared memory); with 16 lanes a row (E > 256) and lists of 8 the row's candidates are
//     instead spread over its lanes, two a lane, and sorted there by a bitonic network;
//   - a warp in which some lane has more than kMaxLaneCandidates candidates (ties, constant rows)
//     sorts every vector instead, so the worst case costs what the sort costs.
// The row's top k is then the same as the sort's (entries past k may differ; nothing reads them).
// Measured against sorting every vector (docs/router.md): 1.03-1.13x at E = 256 (k = 2 and 8) and
// at E = 128 with k = 2; nothing at E = 128 with k = 8 (there a threshold from the lanes' second
// values too) and slower at E = 64, which keep the sort.
// fp32 logits take the same steps with 16-byte vectors of 4 experts (V = 8 per lane) and 64-bit keys
// (Key64: fp32 value, then the lower expert id); a lane's vectors are sorted two at a time (8 keys),
// and NaN-propagating max / min give the non-finite test on both paths. With the filter and k > 2,
// an fp32 row's candidates are ranked in shared memory (each by the number of the row's keys above
// it) instead of inserted into the lanes' lists and merged: 64-bit merges cost twice the 32-bit ones.
// Its second value is the exact second largest where that measured faster, else the smaller of the
// even and the odd elements' maxima (SecondValue).
// Keys are the general kernel's Key32 / Key64, so the selection is the same bit for bit. Selection
// counts go to a shared histogram, then out by last arrival (publish_counts_by_arrival), as the
// general kernel's do when it computes no loss and no select pass; here two experts an atomic
// (publish_count_pairs_by_arrival) where T and the grid leave room for it.
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

// Experts per lane (V = kExpertsPerLane / 8 vectors) from E = kExpertsPerLane up. Measured against
// 64 (half the lanes, twice the vectors): 32 is as fast or faster at every E and k of bench_router
// but E = 256, k = 8 (within 2%), 1.16x at E = 256, k = 2, where more lanes per row hide more
// latency.
constexpr int kExpertsPerLane = 32;

// Sorts a row's G R keys descending, key i = v[i % R] of the row's lane i / R: a bitonic network
// whose exchanges at distances below R stay in a lane's registers and the others are lane shuffles
// (a predicated integer min or max each). G and R are powers of two; the warp is converged (full-
// mask shuffles, each within the row's aligned group of G lanes). Used on the candidates of a bf16
// row (below).
template <int G, int R, typename K>
__device__ __forceinline__ void sort_row_desc(K (&v)[R], int lane_g) {
#pragma unroll
  for (int size = 2; size <= G * R; size *= 2)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
      if (stride >= R) {
        const int lanes_apart = stride / R;
        // Element i keeps the larger key when it is the lower of its pair in a descending block,
        // or the higher of its pair in an ascending one.
        const bool keep_max = (((lane_g * R) & size) == 0) == ((lane_g & lanes_apart) == 0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const K o = __shfl_xor_sync(kFull, v[r], lanes_apart);
          v[r] = keep_max ? max(v[r], o) : min(v[r], o);
        }
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r & stride) continue;
          const bool descending = ((lane_g * R + r) & size) == 0;
          const K hi = max(v[r], v[r + stride]), lo = min(v[r], v[r + stride]);
          v[r] = descending ? hi : lo;
          v[r + stride] = descending ? lo : hi;
        }
      }
    }
}

// A finite bf16 value's key lies in [kLowestFinite, kAboveFinite): +inf and NaN with the sign bit
// clear order above it, -inf and NaN with the sign bit set below it (Key32 keeps the value's
// ordered bits in the high half).
constexpr uint32_t kAboveFinite = 0xff800000u;
constexpr uint32_t kLowestFinite = 0x00800000u;

// The sorted top L of a lane's V vectors (keys 0 for vectors that are not valid, bit i of
// `valid`), and the lowest key of its valid vectors.
template <int G, int V, int L>
__device__ __forceinline__ void lane_top_sorted(const uint4 (&raw)[V], uint32_t valid, int lane_g, uint32_t (&top)[L],
                                                uint32_t& low) {
  low = 0xffffffffu;
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
    const bool ok = (valid >> i) & 1u;
    if (!ok) {
#pragma unroll
      for (int j = 0; j < 8; ++j) key[j] = 0u;  // below every real key: never chosen
    }
    sort_desc<8>(key);  // ptxas makes each exchange an integer min and max
    if (ok) low = min(low, key[7]);
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
}

// The filter's first pass over a lane's 4 V words (vectors past E and rows past T hold kLowestPair):
// the lane's largest logit, a value at most its second largest, and whether one is NaN or infinite.
// The packed max gives the largest of the words' low halves and of their high halves, two of the
// lane's logits (or the filler, the lowest finite value, which only lowers the threshold): the
// smaller is the second value. (The exact second largest, a packed max of packed minima, costs two
// more operations a word and was slower at E = 256 and 512 for k = 3..8, though it leaves fewer
// candidates: docs/router.md.)
template <int V>
__device__ __forceinline__ void lane_extremes(const uint4 (&raw)[V], float& first, float& second, bool& non_finite) {
  __nv_bfloat162 m1 = as_bf162(raw[0].x), mn = m1;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const uint32_t w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
    for (int m = i == 0 ? 1 : 0; m < 4; ++m) {
      const __nv_bfloat162 x = as_bf162(w[m]);
      m1 = __hmax2_nan(m1, x);  // NaN-propagating: a NaN shows in the test below
      mn = __hmin2_nan(mn, x);
    }
  }
  const float a = __low2float(m1), b = __high2float(m1), c = __low2float(mn), d = __high2float(mn);
  non_finite = !(a < INFINITY && b < INFINITY && c > -INFINITY && d > -INFINITY);
  first = fmaxf(a, b);
  second = fminf(a, b);
}

// Bit w (word w's low half) and bit 16 + w (its high half) of the lane's logits at or above tau.
template <int V>
__device__ __forceinline__ uint32_t candidate_mask(const uint4 (&raw)[V], float tau) {
  const __nv_bfloat162 t2 = __float2bfloat162_rn(tau);  // exact: tau is a bf16 value
  uint32_t mask = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const uint32_t w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int word = 4 * i + m;
      mask |= __hge2_mask(as_bf162(w[m]), t2) & ((1u << word) | (1u << (16 + word)));
    }
  }
  return mask;
}

// The configurations that run on a one-wave grid (launch_kernel below): the filtered tiles with
// k <= 2 at E <= 256, and every bf16 tile at 64 < E <= 256 (four or eight lanes a row).
template <class In, int G, int L, bool kFilter>
constexpr bool kOneWave = (kFilter && L == 2 && G <= 8) || (std::is_same_v<In, __nv_bfloat16> && G >= 4 && G <= 8);
// Warps per block: 16 for bf16 rows of eight lanes (128 < E <= 256; two blocks per SM), 8 elsewhere.
// Half the blocks at E = 256 is half the returning count atomics on each expert's entry at the
// kernel's end (publish_counts_by_arrival), which the warps wait for: with the histogram cleared
// behind the first loads (below), 0.4 us less at k = 2 and 1.0 at k = 8 (H100,
// docs/measurements/router.md); at E <= 128 it was no faster, and 32 warps (one block per SM) no
// faster than 16.
template <class In, int G>
constexpr int kBlockWarps = std::is_same_v<In, __nv_bfloat16> && G == 8 ? 16 : kRouterWarps;
// The bf16 filtered tiles at E <= 256 load each tile's logits a tile ahead (16 registers, 64 in all;
// fp32 would hold 32 more).
template <class In, int G, bool kFilter>
constexpr bool kTileAhead = std::is_same_v<In, __nv_bfloat16> && kFilter && G <= 8;

// In: the logits' type (bf16 or fp32). G lanes per row, V 16-byte vectors per lane (vector c =
// i G + lane_g of the row: a warp's load i covers G consecutive vectors of each of its 32 / G rows),
// lists of L keys; kFilter: the candidate filter (k <= G), else every vector sorted.
template <class In, int G, int V, int L, bool kFilter>
__global__ void __launch_bounds__(kBlockWarps<In, G> * 32, 32 / kBlockWarps<In, G>)
    topk_rows_kernel(RouterForwardArgs a) {
  constexpr int kW = kBlockWarps<In, G>, kT = kW * 32;  // warps and threads per block
  using Key = typename Logits<In>::Key;
  using K = typename Logits<In>::K;
  constexpr bool kBF16 = std::is_same_v<In, __nv_bfloat16>;
  constexpr int P = Logits<In>::kPerVector;
  constexpr int RPW = 32 / G;
  // On the one-wave grid a warp works on about four tiles: the bf16 filtered ones load each tile's
  // logits while the warp works on the one before.
  constexpr bool kPrefetch = kTileAhead<In, G, kFilter>;
  constexpr int kS = L >= G ? L / G : 1;  // output slots per lane
  static_assert(!kFilter || (G >= 2 && V * P == 32), "the filter's masks hold a lane's 32 logits");
  __shared__ int32_t hist[kMaxExperts];
  // The filter reads a candidate's logit back from here, each thread from its own vectors: bf16
  // vector i at staged[V * threadIdx.x + (i ^ swizzle)], side by side (a candidate's address and
  // expert id then take about three fewer instructions than with the fp32 layout: 1% at E = 256,
  // k = 8 on the H100, docs/router.md), fp32 vector i at staged[i * kT + threadIdx.x].
  __shared__ uint4 staged[kFilter ? V * kT : 1];
  // fp32 lists of L >= 4 with the filter: a row's candidates are ranked rather than merged (a
  // merge step of 64-bit keys costs twice a 32-bit one's; measured at E = 256, k = 8: 1.18x for
  // fp32, 0.89x for bf16, docs/router.md). Each row's candidates (row_keys, in lane order) and its
  // top L by rank (row_top).
  // bf16 lists of 8 with the filter and 16 lanes a row (E > 256): a row's candidates are spread over
  // its lanes, two a lane, and sorted there by a bitonic network (sort_row_desc) instead of merged
  // in four butterfly steps. Measured (docs/router.md): faster there; slower with 8 lanes a row,
  // with lists of 4, and for fp32 (against the ranking).
  constexpr bool kSortRow = kFilter && L == 8 && G >= 16 && kBF16;
  constexpr bool kRank = kFilter && L >= 4 && !kBF16 && !kSortRow;
  constexpr int kSlotsPerLane = kMaxRowCandidates / G;
  static_assert(!kSortRow || (kSlotsPerLane >= 2 && L % kSlotsPerLane == 0), "whole vectors of a row's slots");
  __shared__ __align__(16) K row_keys[kRank || kSortRow ? kW * RPW * kMaxRowCandidates : 1];
  __shared__ K row_top[kRank ? kW * RPW * L : 1];
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, vecs = E / P;
  // With the tile ahead the histogram is cleared once the first tile's loads are issued (below), so
  // the barrier does not hold them back (0.1-0.2 us less a call at E = 256, H100); the other kernels
  // clear it first: cleared later, ptxas kept more registers live across the barrier (more spills
  // for the fp32 lists of 8) and nothing measured faster (docs/measurements/router.md).
  auto clear_histogram = [&] {
    for (int e = threadIdx.x; e < E; e += kT) hist[e] = 0;
    __syncthreads();
  };
  if constexpr (!kPrefetch) clear_histogram();
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
  // Bit i: the lane's vector i lies inside the row (c < E / P).
  uint32_t in_row = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) in_row |= (i * G + lane_g < vecs ? 1u : 0u) << i;
  // The candidate bits of the vectors inside the row (bf16 vector i: words 4i .. 4i + 3, both
  // halves; fp32 vector i: bits 4i .. 4i + 3).
  uint32_t in_row_bits = 0;
#pragma unroll
  for (int i = 0; i < V; ++i)
    if ((in_row >> i) & 1u) in_row_bits |= (kBF16 ? 0x000f000fu : 0xfu) << (4 * i);
  // Expert of candidate bit b: bf16 (word w = b & 15 = 4 i + m, half h = b >> 4): (i G + lane_g) 8 +
  // 2 m + h; fp32 (i = b >> 2, m = b & 3): (i G + lane_g) 4 + m.
  const uint32_t lane_id0 = Key::id_of(lane_g * P);
  // The bf16 staging's XOR (above) keeps a warp's 16-byte stores of one vector i conflict-free
  // (eight threads a phase, four of each parity).
  const int swizzle = (threadIdx.x >> 1) & (V - 1);
  const int64_t tile_stride = int64_t{gridDim.x} * kW;
  const uint32_t fill = kFilter || !kBF16 ? Logits<In>::kFill : 0u;
  // The lane's vectors of a tile's row (fill past E and past T).
  auto load_tile = [&](int64_t tile, uint4 (&dst)[V]) {
    const int64_t t = tile * RPW + lanes.slot;
    const uint32_t valid = t < p.T ? in_row : 0u;
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const In*>(p.logits) + t * E);
#pragma unroll
    for (int i = 0; i < V; ++i)
      dst[i] = (valid >> i) & 1u ? __ldg(row + i * G + lane_g) : make_uint4(fill, fill, fill, fill);
  };
  uint4 next[kPrefetch ? V : 1];
  const int64_t first_tile = int64_t{blockIdx.x} * kW + warp;
  if constexpr (kPrefetch) {
    if (first_tile < tiles) load_tile(first_tile, next);
    clear_histogram();
  }
  for (int64_t tile = first_tile; tile < tiles; tile += tile_stride) {
    const int64_t t = tile * RPW + lanes.slot;
    const bool live = t < p.T;
    const uint4* row = reinterpret_cast<const uint4*>(static_cast<const In*>(p.logits) + t * E);
    const uint32_t valid = live ? in_row : 0u;
    uint4 raw[V];
    if constexpr (kPrefetch) {
#pragma unroll
      for (int i = 0; i < V; ++i) raw[i] = next[i];
      if (tile + tile_stride < tiles) load_tile(tile + tile_stride, next);  // in flight while this tile is worked on
    } else {
      load_tile(tile, raw);
    }
    // The lane's sorted top L (of its candidates, with the filter), and whether the row holds a
    // non-finite logit. Such a row is routed nowhere (the general kernel's rule). Every vote runs
    // on every lane: the warp stays converged.
    K top[L];
    bool bad;
    bool ranked = false;  // the row's top keys are in shared memory (kRank, kSortRow), not in top
    if constexpr (kFilter) {
      float first, second;
      bool non_finite;
      // Lanes whose second value is at or above tau hold two logits each there, so ceil(k / 2) of
      // them hold k: a threshold too (fewer candidates for k > 2; measured faster at E = 256,
      // k = 8 for both types, docs/router.md). The second value is exact where it pays for its two
      // extra operations an element (fp32 with 8 lanes a row and lists of 8, or 4 lanes a row), the
      // smaller of two lane maxima elsewhere (bf16: the packed max's halves). Measured, docs/router.md.
      constexpr bool kSecond = L >= 4;
      constexpr SecondValue kSecondFp32 = !kSecond                      ? SecondValue::kNone
                                          : G >= 16 || (G == 8 && L == 4) ? SecondValue::kHalves
                                                                          : SecondValue::kExact;
      if constexpr (kBF16)
        lane_extremes<V>(raw, first, second, non_finite);
      else
        lane_extremes_fp32<V, kSecondFp32>(raw, first, second, non_finite);
      const bool any_non_finite = group_any(non_finite, lanes);  // a vote: every lane, never behind &&
      bad = live && any_non_finite;
      float tau = group_kth_largest<G>(first, k, lane_g);
      if constexpr (kSecond) tau = fmaxf(tau, group_kth_largest<G>(second, (k + 1) / 2, lane_g));
      const uint32_t cand = kBF16 ? candidate_mask<V>(raw, tau) : candidate_mask_fp32<V>(raw, tau);
      uint32_t mask = bad ? 0u : cand & (live ? in_row_bits : 0u);
      const int count = __popc(mask);
      // Ranking and the sorted row: the row's candidate count and this lane's first place in the
      // row's list (a scan over the row's lanes in lane order).
      int row_count = 0, place = 0;
      if constexpr (kRank || kSortRow) {
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
        if constexpr (kBF16) {
          uint32_t low;
          lane_top_sorted<G, V, L>(raw, valid, lane_g, top, low);
        } else {
          lane_top_sorted_fp32<G, V, L>(raw, valid, lane_g, top);
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if constexpr (kBF16)
            staged[V * threadIdx.x + (i ^ swizzle)] = raw[i];
          else
            staged[i * kT + threadIdx.x] = raw[i];
        }
        // Candidate bit b's key, its logit read back from the lane's staged vectors.
        auto candidate_key = [&](int b) {
          if constexpr (kBF16) {
            const unsigned short* mine = reinterpret_cast<const unsigned short*>(staged + V * threadIdx.x);
            // q: the logit's place among the lane's 32 (vector q >> 3, element q & 7); its vector is
            // stored at (q >> 3) ^ swizzle, and its expert is q + (q >> 3) (8 G - 8) past the lane's first.
            const int q = 2 * (b & 15) + (b >> 4);
            const uint32_t v = mine[q ^ (swizzle << 3)];
            const uint32_t id = lane_id0 - q - (q & ~7) * (G - 1);
            return static_cast<K>(Key32::make_id(__uint_as_float(v << 16), id));
          } else {
            const float* mine = reinterpret_cast<const float*>(staged) + 4 * threadIdx.x;
            const int i = b >> 2, m = b & 3;
            return static_cast<K>(Key64::make_id(mine[i * (4 * kT) + m], lane_id0 - i * (4 * G) - m));
          }
        };
        // The lane's candidates to list[place ...] in bit order (the row's list in lane order).
        auto write_candidates = [&](K* list) {
#pragma unroll
          for (int n = 0; n < kMaxLaneCandidates; ++n) {
            if (mask == 0u) break;
            const int b = __ffs(mask) - 1;
            mask &= mask - 1u;
            list[place + n] = candidate_key(b);
          }
        };
        if constexpr (kSortRow) {
          // The row's candidates go to its kMaxRowCandidates slots in lane order (zeros, below every key,
          // fill the rest), each lane takes kSlotsPerLane consecutive slots, and the row's lanes
          // sort them; the sorted first L slots are the row's top L (those of merging the lanes'
          // sorted lists: keys are distinct).
          struct alignas(sizeof(K) * kSlotsPerLane) Slots {
            K v[kSlotsPerLane];
          };
          K* const keys = row_keys + (warp * RPW + lanes.slot) * kMaxRowCandidates;
          Slots* const mine = reinterpret_cast<Slots*>(keys) + lane_g;
          __syncwarp();  // the row's lanes have read the previous tile's top (scoring, below)
          *mine = Slots{};  // zero keys
          __syncwarp();
          write_candidates(keys);
          __syncwarp();
          Slots got = *mine;
          sort_row_desc<G, kSlotsPerLane>(got.v, lane_g);
          if (lane_g * kSlotsPerLane < L) *mine = got;  // each lane writes back the slots it read
          __syncwarp();
          ranked = true;
        } else if constexpr (kRank) {
          // The row's candidates go to its list in lane order; each is then ranked by the number
          // of the row's keys above it (keys are distinct: the expert id breaks ties), and the
          // first L ranks fill the row's top: its first min(L, candidates) entries are those of
          // merging the lanes' sorted lists, without the merges (a few candidates per lane at
          // E = 256, k = 8). A live finite row has at least k candidates; the entries past them
          // are stale, and nothing reads a slot past k (a dead or non-finite row writes no
          // expert and no prob from them).
          static_assert(G >= 4, "four lanes write the list's zero padding");
          K* const keys = row_keys + (warp * RPW + lanes.slot) * kMaxRowCandidates;
          if (row_count + lane_g < kMaxRowCandidates && lane_g < 4) keys[row_count + lane_g] = 0u;
          write_candidates(keys);
          __syncwarp();
          K* const row_out = row_top + (warp * RPW + lanes.slot) * L;
          const int most = __reduce_max_sync(kFull, row_count);
          for (int j = lane_g; j < most; j += G) {
            if (j < row_count) {
              const K key = keys[j];
              const int rank = keys_above(keys, row_count, key);
              if (rank < L) row_out[rank] = key;
            }
          }
          __syncwarp();
          ranked = true;
        } else {
#pragma unroll
          for (int j = 0; j < L; ++j) top[j] = 0u;
          // Candidate n passes the list's first n + 1 entries only: the rest still hold 0, below
          // every key (at most kMaxLaneCandidates per lane here, so the unrolled loop takes them all).
#pragma unroll
          for (int n = 0; n < kMaxLaneCandidates; ++n) {
            if (mask == 0u) break;
            const int b = 31 - __clz(mask);  // the highest bit: one FLO
            mask ^= 1u << b;
            K key = candidate_key(b);
#pragma unroll
            for (int j = 0; j < (n + 1 < L ? n + 1 : L); ++j) {  // insertion into the sorted list
              const K hi = max(top[j], key);
              key = min(top[j], key);
              top[j] = hi;
            }
          }
        }
      }
    } else if constexpr (kBF16) {
      uint32_t low;
      lane_top_sorted<G, V, L>(raw, valid, lane_g, top, low);
      const bool low_bad = group_any(low < kLowestFinite, lanes);  // a vote: every lane, never behind &&
      bad = live && low_bad;
    } else {
      float first, second;
      bool non_finite;
      lane_extremes_fp32<V, SecondValue::kNone>(raw, first, second, non_finite);
      const bool any_non_finite = group_any(non_finite, lanes);  // a vote: every lane, never behind &&
      bad = live && any_non_finite;
      lane_top_sorted_fp32<G, V, L>(raw, valid, lane_g, top);
    }
    // Lane g owns slots g kS .. g kS + kS - 1 (lanes past L / kS own none) and scores those only:
    // exp(z - max) for a softmax (the row's max is the winner's logit, no bias), the sigmoid
    // otherwise. The sum the probs are divided by gathers the k scores in slot order, the same
    // additions as one lane scoring every slot. (Every lane scoring all L slots and dividing, with
    // its own slots picked at the end, was a quarter of the k = 8 kernel's instructions.)
    constexpr int M = L / kS;  // lanes that own slots
    K own[kS];
    float mx;
    if ((kRank || kSortRow) && ranked) {
      const K* const row_out = kSortRow ? row_keys + (warp * RPW + lanes.slot) * kMaxRowCandidates
                                        : row_top + (warp * RPW + lanes.slot) * L;
      mx = Key::value(row_out[0]);
#pragma unroll
      for (int i = 0; i < kS; ++i) own[i] = row_out[(lane_g & (M - 1)) * kS + i];
    } else {
#pragma unroll
      for (int o = 1; o < G; o *= 2) {
        K b[L];
#pragma unroll
        for (int j = 0; j < L; ++j) b[j] = __shfl_xor_sync(kFull, top[j], o);
        merge_top<L>(top, b);
      }
      // Every lane of the row now holds its sorted top L; for bf16 the top key tells a +inf or a
      // NaN with the sign bit clear (the sorted path's other half of the non-finite test).
      if constexpr (!kFilter && kBF16) bad = bad || (live && top[0] >= kAboveFinite);
      mx = Key::value(top[0]);
#pragma unroll
      for (int i = 0; i < kS; ++i) own[i] = pick_entry<M, kS>(top, lane_g & (M - 1), i);
    }
    float s[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      const float z = Key::value(own[i]);
      s[i] = soft ? expf(z - mx) : sigmoid_score(z);
    }
    float den = 0.0f;
    if (renorm) {  // a kernel argument: the whole warp takes the same branch
      const int group_lane0 = (threadIdx.x & 31) & ~(G - 1);
#pragma unroll
      for (int j = 0; j < L; ++j) {
        float sj;
        if constexpr (G == 1)
          sj = s[j];
        else
          sj = __shfl_sync(kFull, s[j % kS], group_lane0 + j / kS);
        if (j < k) den += sj;
      }
    }
    float inv = 1.0f;
    if (full_sum) {  // the softmax's own denominator: every logit of the row, read again (L1 hits)
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = i * G + lane_g;
        if (live && c < vecs) {
          const uint4 r = __ldg(row + c);
#pragma unroll
          for (int j = 0; j < P; j += 2) sum += expf(Logits<In>::at(r, j) - mx) + expf(Logits<In>::at(r, j + 1) - mx);
        }
      }
      inv = 1.0f / group_sum(sum, lanes);
    }
    if (bad) bits |= kErrNonFiniteLogit;
    // Lane g writes its kS consecutive slots g kS .. onward, as vectors where it can, so a warp's
    // consecutive rows leave as contiguous bytes.
    int ev[kS];
    float pv[kS];
#pragma unroll
    for (int i = 0; i < kS; ++i) {
      // The general kernel's formulas: a score ex / sum, a renormalised one score / (sum of the k).
      const float score = full_sum ? __fmul_rn(s[i], inv) : s[i];
      ev[i] = bad ? -1 : Key::expert(own[i]);
      pv[i] = bad ? 0.0f : (renorm ? score / den : score) * p.alpha;
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
  if (count_pairs_fit(p.T, gridDim.x))  // every one-wave grid; not a grid capped at 1024 blocks
    publish_count_pairs_by_arrival<kT>(hist, E, a);
  else
    publish_counts_by_arrival<kT>(hist, E, a);
}

// The grid. With the candidate filter at k <= 2 and E <= 256 (the cheapest tiles) and for bf16 at
// 64 < E <= 256, one wave of resident CTAs whose warps loop over the tiles
// (device/launch_geometry.h): a CTA per eight tiles, capped at kRouterMaxBlocks, left 1.94 waves at
// T = 65536 (the SMs idle a fifth of the kernel in the partial wave, Nsight Compute) and ended every
// CTA with a histogram flush; one wave is 1.09-1.13x faster at E = 128 and 256 with k = 2, and with
// the tile ahead 1.03-1.04x at k = 8 (docs/router.md). Elsewhere the longer tiles balance better as
// they were (fp32 with k = 8 and E = 64 ran 1-3% slower on one wave), so they keep a CTA per eight
// tiles; E = 512 was not measured and keeps it too.
template <class In, int G, int V, int L, bool kFilter>
void launch_kernel(const RouterForwardArgs& a, int64_t tiles, cudaStream_t stream) {
  static_assert(!kTileAhead<In, G, kFilter> || kOneWave<In, G, L, kFilter>,
                "the tile ahead needs several tiles per warp");
  const auto kernel = topk_rows_kernel<In, G, V, L, kFilter>;
  constexpr int kW = kBlockWarps<In, G>;
  const unsigned blocks = kOneWave<In, G, L, kFilter>
                              ? one_wave_grid_x(reinterpret_cast<const void*>(kernel), kW * 32, tiles, kW)
                              : static_cast<unsigned>(std::clamp<int64_t>((tiles + kW - 1) / kW, 1, kRouterMaxBlocks));
  kernel<<<blocks, kW * 32, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

template <class In, int G, int V, bool kFilter>
void launch_for_list(const RouterForwardArgs& a, int64_t tiles, cudaStream_t stream) {
  const int k = a.p.k;
  if (k <= 2)
    launch_kernel<In, G, V, 2, kFilter>(a, tiles, stream);
  else if (k <= 4)
    launch_kernel<In, G, V, 4, kFilter>(a, tiles, stream);
  else
    launch_kernel<In, G, V, 8, kFilter>(a, tiles, stream);
}

// The candidate filter where k <= G (its threshold needs k lane maxima).
template <class In, int G, int V>
void launch_filtered(const RouterForwardArgs& a, int64_t tiles, cudaStream_t stream) {
  if constexpr (G >= kMaxK) {  // k <= kMaxK <= G: the sorting kernels of this G would never run
    return launch_for_list<In, G, V, true>(a, tiles, stream);
  } else {
    if (a.p.k <= G) return launch_for_list<In, G, V, true>(a, tiles, stream);
    return launch_for_list<In, G, V, false>(a, tiles, stream);
  }
}

// Lanes per row and vectors per lane: kExpertsPerLane experts per lane (V vectors of P), one lane per
// row below that (the fewest vectors that hold the row; fp32 groups its vectors in pairs).
template <class In>
void launch_for_type(const RouterForwardArgs& a, cudaStream_t stream) {
  constexpr int P = Logits<In>::kPerVector, VL = kExpertsPerLane / P, kMinV = P == 4 ? 2 : 1;
  const int E = a.p.E;
  int G = 1;
  while (G * kExpertsPerLane < E) G *= 2;
  int V = VL;
  if (G == 1) {
    V = kMinV;
    while (V * P < E) V *= 2;
  }
  // Any grid gives the same results (integer counts only).
  const int64_t tiles = (int64_t{a.p.T} + 32 / G - 1) / (32 / G);
  switch (G) {
    case 1:
      if (V == kMinV) return launch_for_list<In, 1, kMinV, false>(a, tiles, stream);
      if (V == 2 * kMinV) return launch_for_list<In, 1, 2 * kMinV, false>(a, tiles, stream);
      return launch_for_list<In, 1, VL, false>(a, tiles, stream);
    case 2: return launch_for_list<In, 2, VL, false>(a, tiles, stream);  // the filter measured slower here
    case 4: return launch_filtered<In, 4, VL>(a, tiles, stream);
    case 8: return launch_filtered<In, 8, VL>(a, tiles, stream);
    default: return launch_filtered<In, 16, VL>(a, tiles, stream);
  }
}

}  // namespace
}  // namespace router

bool router_topk_rows_apply(const RouterForwardArgs& a) {
  const RouterRowParams& p = a.p;
  return p.vec && p.E % 8 == 0 && p.E <= router::kMaxExperts && p.k <= router::kMaxK && p.W == p.k &&
         a.form == RoutingForm::kTopK && a.select == SelectKey::kNone && p.bias == nullptr && p.groups == 1 &&
         p.aux_coeff == 0.0f && p.seq_coeff == 0.0f && p.z_coeff == 0.0f;
}

void launch_router_topk_rows(const RouterForwardArgs& a, cudaStream_t stream) {
  using namespace router;
  if (a.p.bf16) return launch_for_type<__nv_bfloat16>(a, stream);
  return launch_for_type<float>(a, stream);
}

}  // namespace moe::kernels
