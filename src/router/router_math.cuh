// Device helpers of the router kernels (docs/router.md, Kernel design).
//
// Layout: a token row lives in a group of G lanes (router_lanes_per_row); lane g of the group owns
// the NJ consecutive experts [g NJ, g NJ + NJ), so a row is read with 16-byte vector loads and a
// warp's load covers 32 / G consecutive rows, fully coalesced. Collectives run over the group's own
// lanes (its mask), so the groups of one warp may diverge (a row past T, a non-finite row).
// Every float reduction is a fixed butterfly (all lanes get the same bits: a + b == b + a), so
// results do not depend on scheduling.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "router/router_kernels.h"

namespace moe::kernels::router {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = kRouterWarps * 32;

// ---- lane groups ----

// G (lanes per row) is a template parameter of every row kernel: with a compile-time G every
// collective is a fixed sequence over the whole warp. (With G a runtime value and the group's own
// lane mask, ptxas guarded each shuffle and redux with a check that the mask is warp-uniform
// (MATCH / REDUX.OR / VOTE) and, for G < 32, ran each redux.sync once per row group of the warp, one
// after another.) The row loops keep whole warps converged (docs/router.md, "Uniform control
// flow"), so the collectives use the full-warp mask; a butterfly with offsets below G stays inside
// the group.
template <int G_>
struct Lanes {
  static constexpr int G = G_;  // lanes per row
  int lane_g;                   // lane within the group
  int slot;                     // group within the warp: the row offset inside the warp's tile of 32 / G rows
  unsigned mask;                // the group's lanes
};

template <int G>
__device__ __forceinline__ Lanes<G> lanes_of() {
  const int lane = threadIdx.x & 31;
  Lanes<G> l;
  l.lane_g = lane & (G - 1);
  l.slot = lane / G;
  l.mask = G == 32 ? kFull : ((1u << G) - 1u) << (l.slot * G);
  return l;
}

// Bit j set: the lane's expert base + j exists (base + j < E).
// (A closed form: ptxas recomputes this inside the row loops rather than keep it in a register.)
template <int NJ>
__device__ __forceinline__ uint32_t lane_expert_mask(int base, int E) {
  const int n = E - base;  // the lane's experts that exist, if fewer than NJ
  return n >= NJ ? (1u << NJ) - 1u : n <= 0 ? 0u : (1u << n) - 1u;
}

// The bits of a float, reordered so that unsigned order is float order (a negative value flips
// every bit, a positive one its sign bit); -0 and +0 stay apart (callers that need them equal map
// -0 to +0 first).
__device__ __forceinline__ uint32_t ordered_bits(uint32_t b) {
  return b ^ (static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) | 0x80000000u);
}

// Monotone map of a float to uint32 (larger float -> larger key); -0 maps to +0's key so that the
// two compare equal, as they do as floats (ties then break by id).
__device__ __forceinline__ uint32_t float_key(float f) {
  uint32_t b = __float_as_uint(f);
  if (b == 0x80000000u) b = 0u;
  return ordered_bits(b);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float(k ^ (~static_cast<uint32_t>(static_cast<int32_t>(k) >> 31) | 0x80000000u));
}

// Group collectives, called by all 32 lanes of a converged warp. A full-warp group uses redux.sync
// (one instruction); a smaller one a butterfly (redux.sync reduces over its whole mask, so it cannot
// reduce the groups of a warp separately).
template <int G>
__device__ __forceinline__ uint32_t group_max_u32(uint32_t v, const Lanes<G>&) {
  if constexpr (G == 32) {
    return __reduce_max_sync(kFull, v);
  } else {
#pragma unroll
    for (int o = 1; o < G; o *= 2) v = max(v, __shfl_xor_sync(kFull, v, o));
    return v;
  }
}
template <int G>
__device__ __forceinline__ float group_max(float v, const Lanes<G>& l) {
  return key_float(group_max_u32(float_key(v), l));
}
// The sum in a fixed butterfly order (offsets 1, 2, 4, ...): every lane gets the same bits.
template <int G>
__device__ __forceinline__ float group_sum(float v, const Lanes<G>&) {
#pragma unroll
  for (int o = 1; o < G; o *= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
template <int G>
__device__ __forceinline__ bool group_any(bool b, const Lanes<G>& l) {
  return (__ballot_sync(kFull, b) & l.mask) != 0;
}

// Group limit: the bit mask of the row's kept groups, the topk_groups best of its group scores
// (scores[0, groups), shared memory written before a __syncwarp) by (score descending, then the
// lower group id); lane g ranks groups g, g + G, ... The same mask on every lane of the row; every
// lane of the warp calls it (a ballot).
template <int G>
__device__ __forceinline__ uint32_t kept_group_mask(const float* scores, int groups, int topk_groups,
                                                    const Lanes<G>& l) {
  uint32_t keep = 0;
  const unsigned low = G == 32 ? kFull : (1u << G) - 1u;
  for (int b0 = 0; b0 < groups; b0 += G) {
    const int q = b0 + l.lane_g;
    bool kept = false;
    if (q < groups) {
      const float x = scores[q];
      int rank = 0;
      for (int r = 0; r < groups; ++r) {
        const float y = scores[r];
        rank += (y > x || (y == x && r < q)) ? 1 : 0;
      }
      kept = rank < topk_groups;
    }
    keep |= ((__ballot_sync(kFull, kept) >> (l.slot * G)) & low) << b0;
  }
  return keep;
}

// The end of this block's tiles of rows_per_tile rows (router_row_grid): the block works on tiles
// [blockIdx.x tiles_per_block, end), its warp w on the tiles w, w + kRouterWarps, ... of them.
__device__ __forceinline__ int64_t block_tile_end(int32_t T, int rows_per_tile, int32_t tiles_per_block) {
  const int64_t tiles = (int64_t{T} + rows_per_tile - 1) / rows_per_tile;
  const int64_t block_end = (int64_t{blockIdx.x} + 1) * tiles_per_block;
  return tiles < block_end ? tiles : block_end;
}

// ---- row loads ----

// The raw words of a lane's NJ logits: bf16 packs two per word (element 2i in the low half of word
// i), fp32 one per word. Experts past E hold -inf, which never counts in a max, a sum of
// exponentials or a selection.
template <int NJ, bool kBF16>
struct RawRow {
  static constexpr int kWords = kBF16 ? NJ / 2 : NJ;
  uint32_t w[kWords];
};

template <int NJ, bool kBF16>
__device__ __forceinline__ void load_row(const RouterRowParams& p, int64_t t, bool valid, int base,
                                         RawRow<NJ, kBF16>& r) {
  constexpr int kWords = RawRow<NJ, kBF16>::kWords;
  const uint32_t neg_inf = kBF16 ? 0xff80ff80u : 0xff800000u;
#pragma unroll
  for (int i = 0; i < kWords; ++i) r.w[i] = neg_inf;
  if (!valid || base >= p.E) return;
  if (p.vec) {  // the lane's NJ experts: kWords / 4 aligned 16-byte vectors
    const uint4* src = kBF16 ? reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.logits) + t * p.E + base)
                             : reinterpret_cast<const uint4*>(static_cast<const float*>(p.logits) + t * p.E + base);
#pragma unroll
    for (int i = 0; i < kWords / 4; ++i) {
      const uint4 v = __ldg(src + i);
      r.w[4 * i] = v.x;
      r.w[4 * i + 1] = v.y;
      r.w[4 * i + 2] = v.z;
      r.w[4 * i + 3] = v.w;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const int e = base + j;
    if (e >= p.E) continue;
    const int64_t i = t * p.E + e;
    if constexpr (kBF16) {
      const uint32_t h = __ldg(reinterpret_cast<const unsigned short*>(p.logits) + i);
      const int sh = 16 * (j & 1);
      r.w[j / 2] = (r.w[j / 2] & ~(0xffffu << sh)) | (h << sh);
    } else {
      r.w[j] = __float_as_uint(__ldg(static_cast<const float*>(p.logits) + i));
    }
  }
}

// Asks the L2 for the line holding `ptr` (no register, no wait): the backward asks for a row's saved
// routing and incoming gradients a few rows ahead.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// The two largest of a multiset merged with another's (t1 >= t2 each):
// the other's second is below its first, so the new second is the smaller first or the larger second.
__device__ __forceinline__ void merge_top2(float& t1, float& t2, float o1, float o2) {
  const float hi = fmaxf(t1, o1), lo = fmaxf(fminf(t1, o1), fmaxf(t2, o2));
  t1 = hi;
  t2 = lo;
}

// ---- the row ring ----
// A warp works on one row (tile) at a time and needs the next ones in flight while it does: each
// thread copies its part of the next kRingRows rows of its warp into its own stretch of shared
// memory with cp.async (16-byte LDGSTS: no register is tied up and nothing waits until the row is
// used), and reads a row back with 16-byte shared loads when its turn comes. With one row in
// registers per warp (plus L2 prefetches), the row loop stalled on its next row's load.
// Thread x's vector v of ring slot d lives at ring[(d * vecs + v) * kThreads + x]: a warp's
// 16-byte accesses are consecutive, conflict-free.
constexpr int kRingRows = 2;

template <int NJ, bool kBF16>
constexpr int ring_vecs() {  // 16-byte vectors of a lane's part of a row
  return RawRow<NJ, kBF16>::kWords / 4;
}
template <int NJ, bool kBF16>
__host__ __device__ constexpr size_t ring_bytes() {
  return size_t{16} * kRingRows * ring_vecs<NJ, kBF16>() * kThreads;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  // .ca: the line stays in L1 too, where a chosen expert's logit is read again (logit_at).
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Starts the copy of the lane's part of row t (whose first logit is at `src`) into ring slot `slot`
// (this thread's vectors at slot[v * kThreads]) and closes one cp.async group -- an empty one when
// there is nothing to copy, so that every thread has the same number of groups in flight. The row
// loops advance `src` by a fixed stride per tile instead of recomputing t E + base in 64 bits.
// Rows read element by element (odd E, misaligned logits) are loaded here synchronously and stored
// to the slot.
template <int NJ, bool kBF16>
__device__ __forceinline__ void ring_issue(const RouterRowParams& p, int64_t t, bool valid, int base, const char* src,
                                           uint4* slot) {
  constexpr int kVecs = ring_vecs<NJ, kBF16>();
  if (valid && base < p.E) {
    if (p.vec) {
#pragma unroll
      for (int v = 0; v < kVecs; ++v) cp_async16(slot + v * kThreads, reinterpret_cast<const uint4*>(src) + v);
    } else {
      RawRow<NJ, kBF16> r;
      load_row<NJ, kBF16>(p, t, true, base, r);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) slot[v * kThreads] = make_uint4(r.w[4 * v], r.w[4 * v + 1], r.w[4 * v + 2], r.w[4 * v + 3]);
    }
  }
  cp_async_commit();
}

// Byte address of the lane's first logit of row t, and the bytes between the rows of a warp's
// consecutive tiles (kRouterWarps tiles of 32 / G rows apart).
template <bool kBF16>
__device__ __forceinline__ const char* row_src(const RouterRowParams& p, int64_t t, int base) {
  return static_cast<const char*>(p.logits) + (t * p.E + base) * (kBF16 ? 2 : 4);
}
template <bool kBF16>
__device__ __forceinline__ int64_t tile_stride_bytes(const RouterRowParams& p, int G) {
  return int64_t{kRouterWarps} * (32 / G) * p.E * (kBF16 ? 2 : 4);
}

// The lane's part of a row from its ring slot (after cp_async_wait): experts past E, and every
// expert of a row past T, read as -inf.
template <int NJ, bool kBF16>
__device__ __forceinline__ void ring_read(const RouterRowParams& p, bool valid, int base, const uint4* slot,
                                          RawRow<NJ, kBF16>& r) {
  constexpr int kVecs = ring_vecs<NJ, kBF16>();
  const uint32_t neg_inf = kBF16 ? 0xff80ff80u : 0xff800000u;
  if (valid && base < p.E) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const uint4 x = slot[v * kThreads];
      r.w[4 * v] = x.x;
      r.w[4 * v + 1] = x.y;
      r.w[4 * v + 2] = x.z;
      r.w[4 * v + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < RawRow<NJ, kBF16>::kWords; ++i) r.w[i] = neg_inf;
  }
  // An element-wise row past E inside the lane: load_row left -inf there, and so does the copy.
}

template <int NJ, bool kBF16>
__device__ __forceinline__ void unpack_row(const RawRow<NJ, kBF16>& r, float (&z)[NJ]) {
  if constexpr (kBF16) {
#pragma unroll
    for (int i = 0; i < NJ / 2; ++i) {
      z[2 * i] = __uint_as_float(r.w[i] << 16);
      z[2 * i + 1] = __uint_as_float(r.w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int j = 0; j < NJ; ++j) z[j] = __uint_as_float(r.w[j]);
  }
}

// One logit (a chosen expert's, re-read from the row just loaded: an L1 hit).
template <bool kBF16>
__device__ __forceinline__ float logit_at(const RouterRowParams& p, int64_t t, int e) {
  const int64_t i = t * p.E + e;
  if constexpr (kBF16)
    return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(p.logits) + i));
  else
    return __ldg(static_cast<const float*>(p.logits) + i);
}

// True when the lane's experts (bit j of vmask: expert base + j exists) are all finite.
template <int NJ>
__device__ __forceinline__ bool lane_finite(const float (&z)[NJ], uint32_t vmask) {
  bool ok = true;
#pragma unroll
  for (int j = 0; j < NJ; ++j) ok = ok && (!((vmask >> j) & 1u) || fabsf(z[j]) < INFINITY);
  return ok;
}

// True when the lane's existing experts (bit j of vmask) are all finite. A lane whose NJ experts all
// exist folds the test into one FMA per logit (z * 0 is 0 for a finite z, NaN for an infinite or NaN
// one); a partial lane (the row's last, E % NJ != 0) or an empty one tests each existing expert.
template <int NJ>
__device__ __forceinline__ bool row_part_finite(const float (&z)[NJ], uint32_t vmask) {
  constexpr uint32_t kAll = (1u << NJ) - 1u;
  if (vmask == kAll) {
    float chk = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) chk = fmaf(z[j], 0.0f, chk);
    return chk == 0.0f;
  }
  return lane_finite<NJ>(z, vmask);
}

// ---- scores ----

// The score of one logit; the row code and the per-slot recomputation both call this, so a
// chosen expert's score has the same bits in both. __fmul_rn: never contracted into an FMA.
__device__ __forceinline__ float softmax_score(float z, float mx, float inv) { return __fmul_rn(expf(z - mx), inv); }
__device__ __forceinline__ float sigmoid_score(float z) { return 1.0f / (1.0f + expf(-z)); }
__device__ __forceinline__ float score_of(const RouterRowParams& p, float z, float mx, float inv) {
  return p.score == ScoreFunction::kSoftmax ? softmax_score(z, mx, inv) : sigmoid_score(z);
}

// Softmax pieces of a row: the max, the reciprocal of the sum of exp(z - max), the logsumexp (when
// want_lse) and each exp(z - max).
template <int NJ, int G>
__device__ __forceinline__ void softmax_parts(const float (&z)[NJ], const Lanes<G>& l, bool want_lse, float& mx, float& inv, float& lse,
                                              float (&ex)[NJ]) {
  float m = z[0];
#pragma unroll
  for (int j = 1; j < NJ; ++j) m = fmaxf(m, z[j]);
  mx = group_max(m, l);
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    ex[j] = expf(z[j] - mx);
    sum += ex[j];
  }
  sum = group_sum(sum, l);
  inv = 1.0f / sum;
  lse = want_lse ? mx + logf(sum) : 0.0f;  // only the z-loss needs it: a logf per row saved
}

// ---- selection keys ----
// A key orders (value desc, expert asc) as one unsigned integer, so that a group's best entry is
// one integer max. Key32 packs a bf16 value (16 bits, exact) with 0xffff - e; Key64 an fp32 value
// with 0xffffffff - e. Experts past E have key 0, below every real key (-inf included).

struct Key32 {
  using T = uint32_t;
  // id: 0xffff - e (id_of), computed once per lane. v + 0 turns -0 into +0 (one FADD instead of
  // float_key's compare and select); the low 16 bits of a bf16 value are zero.
  __device__ static uint32_t id_of(int e) { return static_cast<uint32_t>(0xffff - e); }
  __device__ static T make_id(float v, uint32_t id) {
    return (ordered_bits(__float_as_uint(__fadd_rn(v, 0.0f))) & 0xffff0000u) | id;
  }
  __device__ static int expert(T k) { return 0xffff - static_cast<int>(k & 0xffffu); }
  __device__ static float value(T k) {  // a negative value's key has its low 16 bits set
    const uint32_t hi = k & 0xffff0000u;
    return key_float((hi & 0x80000000u) ? hi : (hi | 0xffffu));
  }
  template <int G>
  __device__ static T group_max(T k, const Lanes<G>& l) {
    return group_max_u32(k, l);
  }
  __device__ static uint2 to_slot(T k) { return make_uint2(k, 0u); }
  __device__ static T from_slot(uint2 s) { return s.x; }
};

struct Key64 {
  using T = uint64_t;
  __device__ static uint32_t id_of(int e) { return 0xffffffffu - static_cast<uint32_t>(e); }
  __device__ static T make_id(float v, uint32_t id) {
    const uint32_t hi = ordered_bits(__float_as_uint(__fadd_rn(v, 0.0f)));  // -0 -> +0 first
    return (static_cast<uint64_t>(hi) << 32) | id;
  }
  __device__ static int expert(T k) { return static_cast<int>(0xffffffffu - static_cast<uint32_t>(k)); }
  __device__ static float value(T k) { return key_float(static_cast<uint32_t>(k >> 32)); }
  // Full warp: two redux.sync (the high words, then the low words of the lanes holding the largest
  // high word). Smaller groups: a butterfly over (high, low) pairs.
  template <int G>
  __device__ static T group_max(T k, const Lanes<G>& l) {
    uint32_t hi = static_cast<uint32_t>(k >> 32), lo = static_cast<uint32_t>(k);
    if constexpr (G == 32) {
      const uint32_t mh = group_max_u32(hi, l);
      lo = group_max_u32(hi == mh ? lo : 0u, l);
      hi = mh;
    } else {
#pragma unroll
      for (int o = 1; o < G; o *= 2) {
        const uint32_t oh = __shfl_xor_sync(kFull, hi, o), ol = __shfl_xor_sync(kFull, lo, o);
        const bool take = oh > hi || (oh == hi && ol > lo);
        hi = take ? oh : hi;
        lo = take ? ol : lo;
      }
    }
    return (static_cast<uint64_t>(hi) << 32) | lo;
  }
  __device__ static uint2 to_slot(T k) { return make_uint2(static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)); }
  __device__ static T from_slot(uint2 s) { return (static_cast<uint64_t>(s.y) << 32) | s.x; }
};

template <typename K>
__device__ __forceinline__ void compare_swap(K& a, K& b) {  // a >= b afterwards
  const bool swap = b > a;
  const K hi = swap ? b : a, lo = swap ? a : b;
  a = hi;
  b = lo;
}

// Sorts a lane's keys in descending order (a fixed network: 19 exchanges for 8, bitonic for 16).
template <int NJ, typename K>
__device__ __forceinline__ void sort_desc(K (&k)[NJ]) {
  if constexpr (NJ == 8) {
    compare_swap(k[0], k[2]), compare_swap(k[1], k[3]), compare_swap(k[4], k[6]), compare_swap(k[5], k[7]);
    compare_swap(k[0], k[4]), compare_swap(k[1], k[5]), compare_swap(k[2], k[6]), compare_swap(k[3], k[7]);
    compare_swap(k[0], k[1]), compare_swap(k[2], k[3]), compare_swap(k[4], k[5]), compare_swap(k[6], k[7]);
    compare_swap(k[2], k[4]), compare_swap(k[3], k[5]);
    compare_swap(k[1], k[4]), compare_swap(k[3], k[6]);
    compare_swap(k[1], k[2]), compare_swap(k[3], k[4]), compare_swap(k[5], k[6]);
  } else {
#pragma unroll
    for (int size = 2; size <= NJ; size *= 2)
#pragma unroll
      for (int stride = size / 2; stride > 0; stride /= 2)
#pragma unroll
        for (int i = 0; i < NJ; ++i) {
          const int j = i ^ stride;
          if (j > i) {
            if ((i & size) == 0)
              compare_swap(k[i], k[j]);
            else
              compare_swap(k[j], k[i]);
          }
        }
  }
}

// ---- reductions across the blocks of a kernel ----

// Per-expert sums of a block's rows (the balancing scores), first within each warp: the warp's row
// groups add their lanes' acc by a butterfly and its first group writes the sums of the existing
// experts to warp_part (the warp's stretch of rows_per_warp * G NJ floats).
template <int NJ, int G>
__device__ __forceinline__ void store_warp_sums(float (&acc)[NJ], const Lanes<G>& l, int base, uint32_t vmask,
                                                float* warp_part) {
  for (int o = G; o < 32; o *= 2) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[j] += __shfl_xor_sync(kFull, acc[j], o);
  }
  if (l.slot == 0) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if ((vmask >> j) & 1u) warp_part[base + j] = acc[j];
  }
}
// ... then, after a block barrier, expert e's sum over the warps in order (warp w's part at
// parts + w * stride).
__device__ __forceinline__ float sum_warp_parts(const float* parts, int stride, int e) {
  float P = 0.0f;
  for (int w = 0; w < kRouterWarps; ++w) P += parts[w * stride + e];
  return P;
}

// Sum over the block's threads in a fixed tree order (every thread gets the result).
__device__ __forceinline__ double block_sum(double v, double* red) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (static_cast<int>(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const double r = red[0];
  __syncthreads();
  return r;
}

// Expert e's total count (0 <= c <= T) to the three count outputs, by its entry's last arrival.
__device__ __forceinline__ void write_expert_count(const RouterForwardArgs& a, int e, int64_t c) {
  a.selection_counts[e] = static_cast<int32_t>(c);
  a.counts32[e] = static_cast<int32_t>(c);
  if (a.counts64) a.counts64[e] = c;
}

// Publishes the per-expert selection counts of a launch when they are all its last block would
// publish (no loss, no select pass): every block adds its count of each expert (hist, shared) and
// one arrival to the expert's scratch entry in one 64-bit atomic, and the block arriving last on an
// entry has the expert's total in the value it got back, writes the three count outputs and clears
// the entry (no other block touches it again in this launch). So no block waits for a fence and a
// grid-wide ticket, and the counts take one round trip to L2 instead of four: 0.5-1.7 us a call on
// the H100 (docs/router.md). A count is at most T < 2^31, so it never carries into the arrivals.
// Every block (of kBlockThreads threads) calls it once, from all threads, after a barrier that
// follows its last hist update.
template <int kBlockThreads = kThreads>
__device__ __forceinline__ void publish_counts_by_arrival(const int32_t* hist, int E, const RouterForwardArgs& a) {
  for (int e = threadIdx.x; e < E; e += kBlockThreads) {
    unsigned long long* const entry = a.count_arrivals + int64_t{e} * kRouterArrivalStride;
    const unsigned long long old = atomicAdd(entry, (1ull << 32) | static_cast<uint32_t>(hist[e]));
    if ((old >> 32) == gridDim.x - 1) {
      const int32_t c = static_cast<int32_t>(static_cast<uint32_t>(old)) + hist[e];
      *entry = 0;
      write_expert_count(a, e, c);
    }
  }
}

// publish_counts_by_arrival with two experts per 64-bit atomic: half the returning atomics on the
// entries at the kernel's end (0.1-0.4 us a call at E = 256 on the H100, docs/router.md). Each
// 32-bit half holds an expert's count in bits 0-21 and the block's arrival in bit 22 up, so a half
// never carries into the other while T < 2^22 and the grid has fewer than 1024 blocks
// (count_pairs_fit; 10 bits of arrivals, since a one-wave grid of blocks of 8 warps has 528 on an
// H100). Entry e / 2 holds experts e and e + 1 (e even).
constexpr int kPairCountBits = 22;
__host__ __device__ constexpr bool count_pairs_fit(int64_t T, unsigned blocks) {
  return T < (int64_t{1} << kPairCountBits) && blocks < (1u << (32 - kPairCountBits));
}
template <int kBlockThreads>
__device__ __forceinline__ void publish_count_pairs_by_arrival(const int32_t* hist, int E, const RouterForwardArgs& a) {
  constexpr uint32_t kArrival = 1u << kPairCountBits, kCountMask = kArrival - 1;
  for (int e = 2 * threadIdx.x; e < E; e += 2 * kBlockThreads) {
    const bool second = e + 1 < E;
    uint32_t c0 = static_cast<uint32_t>(hist[e]), c1 = second ? static_cast<uint32_t>(hist[e + 1]) : 0u;
    unsigned long long* const entry = a.count_arrivals + int64_t{e / 2} * kRouterArrivalStride;
    const unsigned long long old =
        atomicAdd(entry, (static_cast<unsigned long long>(kArrival | c1) << 32) | (kArrival | c0));
    if ((static_cast<uint32_t>(old) >> kPairCountBits) != gridDim.x - 1) continue;
    *entry = 0;
    c0 += static_cast<uint32_t>(old) & kCountMask;
    c1 += static_cast<uint32_t>(old >> 32) & kCountMask;
    write_expert_count(a, e, c0);
    if (second) write_expert_count(a, e + 1, c1);
  }
}

// The last block of the grid to finish gets true (every block calls it once, from all threads,
// after its last global write). The ticket counter is cleared by the caller once the last block is
// done, so it is zero again for the next (stream-ordered) launch.
__device__ __forceinline__ bool last_block_done(uint32_t* ticket) {
  __shared__ bool last;
  __threadfence();  // this block's writes and atomics are visible before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();  // and every other block's are visible to this one
  return last;
}

}  // namespace moe::kernels::router
