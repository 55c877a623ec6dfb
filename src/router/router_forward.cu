// Router forward on the device (see docs/router.md, Kernel design):
//   1. route_rows: a group of G lanes per token row (16-byte copies of the logits into a row ring,
//      rows ahead) -- scores, group limit, top-k (+ rounding candidates) by k rounds of a group
//      integer max over presorted per-lane keys, probs, selection counts, and per-block sums of the
//      balancing scores and of lse^2. Its last block to finish turns the accumulators into the
//      counts and the loss scalars (and the select pass's list offsets); with no loss and no select
//      pass the counts go out by last arrival instead (publish_counts_by_arrival). So a dropless
//      forward is this one kernel: no memset, no finalize launch.
//   2. seq_loss (sequence aux loss only): one block per sequence, its last block sums the loss.
//   3. with a capacity or token rounding, the select pass: per-expert candidate lists, one block
//      per expert keeping its best entries by a unique 64-bit key (radix select), then the outputs.
// Integer counts use atomics (exact whatever the order). Float sums have a fixed order: butterflies
// within a warp, warps of a block in order, and across blocks either in block order (lse^2, fp64)
// or as fixed-point integers (the balancing scores, 2^-32 resolution), exact in any order.
#include <algorithm>
#include <type_traits>

#include "device/cuda_check.h"
#include "moe/device_errors.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

// A map-form prob staged in shared memory; any other bits are a routed expert's prob (arithmetic
// never produces this NaN payload).
constexpr uint32_t kUnrouted = 0xffffffffu;

// Dynamic shared memory of the row kernels; RG = row groups per block.
struct FwdShared {
  int32_t* hist;   // [E] selection counts of the block
  int32_t* chist;  // [E] select-pass list entries of the block
  float* rowbuf;   // [RG, G NJ] per row: map staging or group-limit scores; at the end, per-warp sums
  float* gbuf;     // [RG, groups] group scores (general group limit)
  uint2* slots;    // [RG, W] the selected slots of a row: key, then (expert, prob source)
  float* zbuf;     // [warps] lse^2 sums
  float* accbuf;   // [RG, G NJ] sums of the balancing scores of each row group (aux loss only)
  float* bias;     // [G NJ] the expert bias (0 past E, or without a bias)
  uint4* ring;     // the row ring (ring_bytes)
};

__host__ __device__ inline size_t round16(size_t x) { return (x + 15) / 16 * 16; }

// Bytes of the layout (and the pointers when raw is given).
__host__ __device__ inline size_t forward_smem(int E, int G, int NJ, int W, int groups, bool acc, size_t ring,
                                               unsigned char* raw, FwdShared* s) {
  const size_t RG = size_t{kRouterWarps} * (32 / G);
  const size_t sizes[9] = {sizeof(int32_t) * E,         sizeof(int32_t) * E,    sizeof(float) * RG * G * NJ,
                           sizeof(float) * RG * groups, sizeof(uint2) * RG * W, sizeof(float) * kRouterWarps,
                           acc ? sizeof(float) * RG * G * NJ : 0,          sizeof(float) * G * NJ,
                           ring};
  size_t off[9], total = 0;
  for (int i = 0; i < 9; ++i) {
    off[i] = total;
    total = round16(total + sizes[i]);
  }
  if (raw) {
    s->hist = reinterpret_cast<int32_t*>(raw + off[0]);
    s->chist = reinterpret_cast<int32_t*>(raw + off[1]);
    s->rowbuf = reinterpret_cast<float*>(raw + off[2]);
    s->gbuf = reinterpret_cast<float*>(raw + off[3]);
    s->slots = reinterpret_cast<uint2*>(raw + off[4]);
    s->zbuf = reinterpret_cast<float*>(raw + off[5]);
    s->accbuf = reinterpret_cast<float*>(raw + off[6]);
    s->bias = reinterpret_cast<float*>(raw + off[7]);
    s->ring = reinterpret_cast<uint4*>(raw + off[8]);
  }
  return total;
}

// Does slot w (expert e >= 0) enter the per-expert lists of the select pass?
__device__ __forceinline__ bool in_list(const RouterForwardArgs& a, int w, int e) {
  return e >= 0 && (a.select == SelectKey::kScore || w < a.p.k);
}

// The lane's part of a map-form row: map bytes and probs from the staged probs (null: all zero).
template <int NJ>
__device__ __forceinline__ void store_map_row(const RouterForwardArgs& a, int64_t t, int base, uint32_t vmask,
                                              const float* staged) {
  const int E = a.p.E;
  bool on[NJ];
  float pr[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const uint32_t b = staged ? __float_as_uint(staged[base + j]) : kUnrouted;
    on[j] = b != kUnrouted;
    pr[j] = on[j] ? __uint_as_float(b) : 0.0f;
  }
  if (a.out_vec) {
    if (base >= E) return;
    uint32_t bytes[NJ / 4];
#pragma unroll
    for (int i = 0; i < NJ / 4; ++i)
      bytes[i] = uint32_t{on[4 * i]} | uint32_t{on[4 * i + 1]} << 8 | uint32_t{on[4 * i + 2]} << 16 |
                 uint32_t{on[4 * i + 3]} << 24;
    uint8_t* m = a.map + t * E + base;
    if constexpr (NJ == 8)
      *reinterpret_cast<uint2*>(m) = make_uint2(bytes[0], bytes[1]);
    else
      *reinterpret_cast<uint4*>(m) = make_uint4(bytes[0], bytes[1], bytes[2], bytes[3]);
    float4* q = reinterpret_cast<float4*>(a.probs + t * E + base);
#pragma unroll
    for (int i = 0; i < NJ / 4; ++i) q[i] = make_float4(pr[4 * i], pr[4 * i + 1], pr[4 * i + 2], pr[4 * i + 3]);
    return;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if ((vmask >> j) & 1u) {
      a.map[t * E + base + j] = on[j] ? 1 : 0;
      a.probs[t * E + base + j] = pr[j];
    }
}

// A row with a non-finite logit (or bias): routed nowhere.
template <int NJ, int G>
__device__ __forceinline__ void write_unrouted_row(const RouterForwardArgs& a, int64_t t, const Lanes<G>& l, int base,
                                                   uint32_t vmask) {
  const int k = a.p.k, W = a.p.W;
  const bool select = a.select != SelectKey::kNone;
  for (int j = l.lane_g; j < W; j += G) {
    a.selected[t * W + j] = -1;
    if (select) {
      a.kept[t * W + j] = 0;
    } else if (a.form == RoutingForm::kTopK && j < k) {
      a.indices[t * k + j] = -1;
      a.probs[t * k + j] = 0.0f;
    }
  }
  if (!select && a.form == RoutingForm::kMap) store_map_row<NJ>(a, t, base, vmask, nullptr);
}

// Group-limited top-k: the bit mask of the kept groups (the same on every lane of the row's group).
// sv: the lane's biased scores. Fast path (group_lanes > 0): each expert group spans group_lanes
// lanes (a power of two), so a lane's experts are all in group my_group and the top-2 merge is a
// butterfly. Otherwise the scores go through shared memory.
template <int NJ, int G>
__device__ __forceinline__ uint32_t kept_groups(const RouterRowParams& p, const Lanes<G>& l, int base, uint32_t vmask,
                                                int group_lanes, int my_group, const float (&sv)[NJ], float* rowbuf,
                                                float* gbuf) {
  const int E = p.E, gs = E / p.groups;
  uint32_t keep = 0;
  if (group_lanes > 0) {
    float t1 = -INFINITY, t2 = -INFINITY;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const float x = sv[j];
      if (x > t1) {
        t2 = t1;
        t1 = x;
      } else if (x > t2) {
        t2 = x;
      }
    }
    for (int o = 1; o < group_lanes; o *= 2) {  // top-2 of the union (as multisets)
      merge_top2(t1, t2, __shfl_xor_sync(kFull, t1, o), __shfl_xor_sync(kFull, t2, o));
    }
    uint32_t gkey = base < E ? float_key(t1 + t2) : 0u;  // gs >= NJ > 1: two values per group
    for (int i = 0; i < p.topk_groups; ++i) {
      const uint32_t m = group_max_u32(gkey, l);
      const unsigned tied = __ballot_sync(kFull, gkey == m) & l.mask;
      const int first = __ffs(tied) - 1 - l.slot * G;  // lowest lane = lowest group id among ties
      const int winner = first * NJ / gs;
      keep |= 1u << winner;
      if (my_group == winner) gkey = 0u;
    }
    return keep;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if ((vmask >> j) & 1u) rowbuf[base + j] = sv[j];
  __syncwarp();
  for (int gi = l.lane_g; gi < p.groups; gi += G) {
    float t1 = -INFINITY, t2 = -INFINITY;
    for (int i = 0; i < gs; ++i) {
      const float x = rowbuf[gi * gs + i];
      if (x > t1) {
        t2 = t1;
        t1 = x;
      } else if (x > t2) {
        t2 = x;
      }
    }
    gbuf[gi] = gs > 1 ? t1 + t2 : t1;
  }
  __syncwarp();
  keep = kept_group_mask<G>(gbuf, p.groups, p.topk_groups, l);
  __syncwarp();  // rowbuf and gbuf are rewritten by the next row
  return keep;
}

// G: lanes per row (p.G); K: Key32 (bf16 logits, no bias: the logits order the experts) or Key64;
// kBF16: the logits dtype; kGroups: group-limited top-k (its own instantiation: it needs more
// registers).
template <int NJ, int G, typename K, bool kBF16, bool kGroups>
__global__ void __launch_bounds__(kThreads, NJ == 8 ? 3 : 2) route_rows_kernel(RouterForwardArgs a, int32_t tiles_per_block) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Key = typename K::T;
  constexpr bool kMayBias = std::is_same_v<K, Key64>;
  constexpr int RPW = 32 / G;
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, W = p.W;
  const bool select = a.select != SelectKey::kNone;
  const bool want_a = p.aux_coeff != 0.0f, want_lse = p.z_coeff != 0.0f;
  FwdShared sh;
  forward_smem(E, G, NJ, W, p.groups, want_a, ring_bytes<NJ, kBF16>(), smem_raw, &sh);
  const Lanes<G> L = lanes_of<G>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rg = warp * RPW + L.slot;
  float* rowbuf = sh.rowbuf + rg * (G * NJ);
  uint2* slots = sh.slots + rg * W;
  float* gbuf = sh.gbuf + rg * p.groups;
  const int base = L.lane_g * NJ;
  float4* my_acc = reinterpret_cast<float4*>(sh.accbuf + rg * (G * NJ) + base);
  const float* bias_ptr = kMayBias ? p.bias : nullptr;
  for (int e = threadIdx.x; e < E; e += kThreads) sh.hist[e] = sh.chist[e] = 0;
  if (want_a) {
#pragma unroll
    for (int i = 0; i < NJ / 4; ++i) my_acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  // The bias, staged once per block (a non-finite one poisons every row). Its finiteness goes
  // through a shared flag and a plain barrier, read once into a register: with
  // __syncthreads_and(...) ptxas re-issued the barrier reduction (BAR.RED + B2R) at its use inside
  // the row loop of the 32-bit-key group-limit kernels, where rows past T skip it -- a block barrier
  // reached by part of the block, which faulted on the H100 (illegal instruction).
  __shared__ int bias_bad;
  if (threadIdx.x == 0) bias_bad = 0;
  __syncthreads();  // every thread, before the loop
  for (int e = threadIdx.x; e < G * NJ; e += kThreads) {
    const float b = bias_ptr && e < E ? __ldg(bias_ptr + e) : 0.0f;
    if (!(fabsf(b) < INFINITY)) bias_bad = 1;  // any writer writes 1
    sh.bias[e] = b;
  }
  __syncthreads();  // every thread, before the loop
  const bool bias_ok = !kMayBias || *static_cast<volatile int*>(&bias_bad) == 0;  // one load, not re-read

  const uint32_t vmask = lane_expert_mask<NJ>(base, E);
  // Group limit: the fast path's lanes per expert group, and this lane's (first) group.
  const int gs = E / p.groups;
  const int group_lanes = (kGroups && gs % NJ == 0 && ((gs / NJ) & (gs / NJ - 1)) == 0) ? gs / NJ : 0;
  const int my_group = base / gs, my_offset = base % gs;

  const bool soft = p.score == ScoreFunction::kSoftmax;
  const bool by_z = bias_ptr == nullptr;                // the logits order the experts themselves
  const bool need_s = !by_z || kGroups || want_a;  // every expert's score, not only the chosen
  const bool stage_map = !select && a.form == RoutingForm::kMap;
  float zacc = 0.0f;
  uint32_t bits = 0;

  const int64_t tile_end = block_tile_end(p.T, RPW, tiles_per_block);
  int64_t tile = int64_t{blockIdx.x} * tiles_per_block + warp;
  constexpr uint32_t kAllJ = (1u << NJ) - 1u;
  const uint32_t id0 = K::id_of(base);  // key id of expert base; base + j has id0 - j
  // The ring holds the warp's next kRingRows tiles: tile + d kRouterWarps in slot d, then each
  // iteration refills the slot it has just read with the tile kRingRows ahead.
  uint4* const ring = sh.ring + threadIdx.x;
  constexpr int kRingStride = ring_vecs<NJ, kBF16>() * kThreads;  // uint4s between slots
  const int64_t src_stride = tile_stride_bytes<kBF16>(p, G);
  const char* src = row_src<kBF16>(p, tile * RPW + L.slot, base);  // the next row to copy
#pragma unroll
  for (int d = 0; d < kRingRows; ++d, src += src_stride) {
    const int64_t td = tile + d * kRouterWarps, t = td * RPW + L.slot;
    ring_issue<NJ, kBF16>(p, t, td < tile_end && t < p.T, base, src, ring + d * kRingStride);
  }
  int ring_slot = 0;
  // Control flow in this loop is uniform across the warp: `tile` is the warp's own, and a row group
  // whose row is past T (in the last tile) or holds a non-finite logit runs the same instructions
  // as the other groups of its warp with its stores and atomics switched off (`routed`). No lane
  // leaves an iteration early, so every collective below -- shuffles, ballots, redux over a group's
  // mask, __syncwarp -- is executed by all 32 lanes of the warp together, and every thread reaches
  // the block barrier after the loop.
  for (; tile < tile_end; tile += kRouterWarps) {
    const int64_t t = tile * RPW + L.slot;
    const bool live = t < p.T;  // the group's (all its lanes share t)
    float z[NJ];
    {
      cp_async_wait<kRingRows - 1>();  // this thread's copy of this tile has landed
      uint4* const slot = ring + ring_slot * kRingStride;
      RawRow<NJ, kBF16> raw;
      ring_read<NJ, kBF16>(p, live, base, slot, raw);
      unpack_row<NJ, kBF16>(raw, z);
      const int64_t ahead = tile + kRingRows * kRouterWarps, ta = ahead * RPW + L.slot;
      ring_issue<NJ, kBF16>(p, ta, ahead < tile_end && ta < p.T, base, src, slot);
      src += src_stride;
      ring_slot = ring_slot + 1 == kRingRows ? 0 : ring_slot + 1;
    }
    // A row past T was read as -inf: "not finite", and not live.
    const bool bad = group_any(!bias_ok || !row_part_finite<NJ>(z, vmask), L);
    const bool routed = live && !bad;
    if (live && bad) {  // no collective inside: the group may take it alone
      bits |= kErrNonFiniteLogit;
      write_unrouted_row<NJ>(a, t, L, base, vmask);
    }

    // Scores (of every row group; an unrouted group's values are never stored).
    float mx = 0.0f, inv = 0.0f, lse = 0.0f;
    float s[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) s[j] = 0.0f;
    if (soft || want_lse) {
      float ex[NJ];
      softmax_parts<NJ>(z, L, want_lse, mx, inv, lse, ex);
      if (soft && need_s) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) s[j] = __fmul_rn(ex[j], inv);
      }
    }
    if (!soft && need_s) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) s[j] = sigmoid_score(z[j]);
    }
    if (want_a) {  // balancing scores: softmax, or sigmoid normalised to sum 1
      float is = 1.0f;
      if (!soft) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) ss += s[j];
        is = 1.0f / group_sum(ss, L);
      }
      if (routed) {
#pragma unroll
        for (int i = 0; i < NJ / 4; ++i) {
          float4 c = my_acc[i];
          c.x += soft ? s[4 * i] : s[4 * i] * is;
          c.y += soft ? s[4 * i + 1] : s[4 * i + 1] * is;
          c.z += soft ? s[4 * i + 2] : s[4 * i + 2] * is;
          c.w += soft ? s[4 * i + 3] : s[4 * i + 3] * is;
          my_acc[i] = c;
        }
      }
    }
    if (want_lse && routed && L.lane_g == 0) zacc += lse * lse;

    // Selection values: sv, the biased score groups and the select pass compare; v orders the experts.
    float v[NJ];
    if (by_z && !kGroups) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) v[j] = z[j];
    } else {
      float sv[NJ];
#pragma unroll
      for (int j = 0; j < NJ; ++j) sv[j] = p.softmax_after ? z[j] : s[j];
      if (bias_ptr) {
        const float4* bq = reinterpret_cast<const float4*>(sh.bias + base);
#pragma unroll
        for (int i = 0; i < NJ / 4; ++i) {
          const float4 b = bq[i];
          sv[4 * i] += b.x;
          sv[4 * i + 1] += b.y;
          sv[4 * i + 2] += b.z;
          sv[4 * i + 3] += b.w;
        }
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) v[j] = by_z ? z[j] : sv[j];
      if (kGroups) {
        const uint32_t keep = kept_groups<NJ>(p, L, base, vmask, group_lanes, my_group, sv, rowbuf, gbuf);
        if (group_lanes > 0) {
          if (!((keep >> my_group) & 1u)) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) v[j] = -INFINITY;
          }
        } else {
          int g = my_group, r = my_offset;
#pragma unroll
          for (int j = 0; j < NJ; ++j) {
            if (g >= p.groups || !((keep >> g) & 1u)) v[j] = -INFINITY;
            if (++r == gs) {
              r = 0;
              ++g;
            }
          }
        }
      }
    }

    // Top-W. Keys of experts past E are 0, below every real key (-inf included), and never win:
    // W <= E. Round w's winner (the group's largest remaining key) is slot w, which lane 0 of the
    // group stages in shared memory.
    Key key[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) key[j] = K::make_id(v[j], id0 - static_cast<uint32_t>(j));
    if (vmask != kAllJ) {  // the row's last lane when E % NJ != 0, or a lane past E
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (!((vmask >> j) & 1u)) key[j] = Key{0};
    }
    if (W <= 2) {
      // A lane gives at most W slots: its two largest keys suffice (3 integer ops a key, no sort).
      Key t1 = key[0], t2 = Key{0};
#pragma unroll
      for (int j = 1; j < NJ; ++j) {
        const Key x = key[j];
        const Key lo = x < t1 ? x : t1;
        t2 = lo > t2 ? lo : t2;
        t1 = x > t1 ? x : t1;
      }
      for (int w = 0; w < W; ++w) {
        const Key m = K::group_max(t1, L);
        if (t1 == m) {  // keys are unique (the expert id is part of them): one lane pops
          t1 = t2;
          t2 = Key{0};
        }
        if (L.lane_g == 0) slots[w] = K::to_slot(m);
      }
    } else {
      // The lane sorts its keys once; each round the group's largest head wins and its lane pops it.
      sort_desc<NJ>(key);
      for (int w = 0; w < W; ++w) {
        const Key head = key[0];
        const Key m = K::group_max(head, L);
        if (head == m) {
#pragma unroll
          for (int j = 0; j < NJ - 1; ++j) key[j] = key[j + 1];
          key[NJ - 1] = Key{0};
        }
        if (L.lane_g == 0) slots[w] = K::to_slot(m);
      }
    }
    __syncwarp();

    // Slots, lane j holding slots j, j + G, ...: the expert and its prob source (score, or logit
    // with softmax-after), then the sums the probs need. Without a bias the key's value is the
    // logit itself (exact: bf16 in Key32, fp32 in Key64), so it is not read again.
    float den = 0.0f, zm = -INFINITY;
#pragma unroll 1
    for (int j = L.lane_g; j < W; j += G) {
      const Key m = K::from_slot(slots[j]);
      const float mv = K::value(m);
      const int e = !routed || mv == -INFINITY ? -1 : K::expert(m);  // -inf: an excluded group's expert
      float pv = 0.0f;
      if (e >= 0) {
        const float ze = by_z ? mv : logit_at<kBF16>(p, t, e);
        pv = p.softmax_after ? ze : score_of(p, ze, mx, inv);
        if (j < k) {
          den += pv;
          zm = fmaxf(zm, ze);
        }
      }
      slots[j] = make_uint2(static_cast<uint32_t>(e), __float_as_uint(pv));
    }
    if (p.softmax_after) {
      zm = group_max(zm, L);
      float se = 0.0f;
      for (int j = L.lane_g; j < k; j += G) se += expf(__uint_as_float(slots[j].y) - zm);
      den = group_sum(se, L);
    } else if (p.normalize) {
      den = group_sum(den, L);
    }
    if (stage_map) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) rowbuf[base + j] = __uint_as_float(kUnrouted);
      __syncwarp();
    }
    if (routed) {  // no collective inside
#pragma unroll 1
    for (int j = L.lane_g; j < W; j += G) {
        const uint2 sl = slots[j];
        const int e = static_cast<int>(sl.x);
        const float pv = __uint_as_float(sl.y);
        const bool chosen = j < k;
        float prob = pv;  // plain score; also every rounding candidate's
        if (p.softmax_after)
          prob = chosen ? expf(pv - zm) / den : 0.0f;
        else if (p.normalize && chosen)
          prob = pv / den;
        prob *= p.alpha;
        const int64_t i = t * W + j;
        a.selected[i] = e;
        if (chosen) atomicAdd(&sh.hist[e], 1);
        if (!select) {
          if (!chosen) continue;
          if (a.form == RoutingForm::kTopK) {
            a.indices[t * k + j] = e;
            a.probs[t * k + j] = prob;
          } else {
            rowbuf[e] = prob;
          }
        } else {
          a.slot_prob[i] = prob;
          float key_value = 0.0f;
          if (a.select == SelectKey::kProb) key_value = prob;
          if (a.select == SelectKey::kScore && e >= 0) key_value = __fadd_rn(pv, sh.bias[e]);
          a.slot_key[i] = key_value;
          a.kept[i] = 0;
          if (in_list(a, j, e)) atomicAdd(&sh.chist[e], 1);
        }
      }
    }
    if (stage_map) {
      __syncwarp();
      if (routed) store_map_row<NJ>(a, t, base, vmask, rowbuf);
    }
    __syncwarp();  // slots and rowbuf are rewritten by the next row
  }
  bits = __reduce_or_sync(kFull, bits);
  if (lane == 0 && bits) atomicOr(a.error_word, bits);
  // Block sums: the warp's row groups by a butterfly, then the warps in order.
  float* warp_part = sh.rowbuf + warp * RPW * (G * NJ);
  if (want_a) {
    float acc[NJ];
#pragma unroll
    for (int i = 0; i < NJ / 4; ++i) {
      const float4 c = my_acc[i];
      acc[4 * i] = c.x;
      acc[4 * i + 1] = c.y;
      acc[4 * i + 2] = c.z;
      acc[4 * i + 3] = c.w;
    }
    store_warp_sums<NJ>(acc, L, base, vmask, warp_part);
  }
  if (want_lse) {
    for (int o = 1; o < 32; o *= 2) zacc += __shfl_xor_sync(kFull, zacc, o);
    if (lane == 0) sh.zbuf[warp] = zacc;
  }
  __syncthreads();
  // Counts alone (no loss, no select pass): by last arrival, no last block.
  if (!want_a && !want_lse && !select && p.seq_coeff == 0.0f) return publish_counts_by_arrival(sh.hist, E, a);
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (want_a) {
      const float P = sum_warp_parts(sh.rowbuf, RPW * (G * NJ), e);
      const auto fixed = static_cast<unsigned long long>(__float2ll_rn(P * 4294967296.0f));
      if (fixed) atomicAdd(a.aux_acc + e, fixed);
    }
    if (sh.hist[e]) atomicAdd(a.count_acc + e, sh.hist[e]);
    if (select && sh.chist[e]) atomicAdd(a.cand_acc + e, sh.chist[e]);
  }
  if (threadIdx.x == 0 && want_lse) {
    float sum = 0.0f;
    for (int w = 0; w < kRouterWarps; ++w) sum += sh.zbuf[w];
    a.z_partials[blockIdx.x] = sum;
  }
  if (!last_block_done(a.tickets)) return;

  // The last block: counts, loss scalars, the select pass's list offsets; clears the accumulators.
  __shared__ double red[kThreads];
  __shared__ int32_t warp_total[kRouterWarps];
  const double Td = p.T;
  double aux_term = 0.0;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const int32_t c = atomicExch(a.count_acc + e, 0);
    a.selection_counts[e] = c;
    if (!select) {
      a.counts32[e] = c;
      if (a.counts64) a.counts64[e] = c;
    } else {
      const int32_t n = atomicExch(a.cand_acc + e, 0);
      a.cand_count[e] = n;
      a.cand_cursor[e] = 0;
      sh.hist[e] = n;
    }
    if (want_a) {
      const double P = ldexp(static_cast<double>(atomicExch(a.aux_acc + e, 0ull)), -32);
      aux_term += (static_cast<double>(c) / (Td * k)) * (P / Td);
    }
  }
  if (want_a) {
    const double sum = block_sum(aux_term, red);
    if (threadIdx.x == 0) *a.aux_loss = p.T > 0 ? static_cast<float>(p.aux_coeff * E * sum) : 0.0f;
  }
  if (want_lse) {
    double zz = 0.0;
    for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += kThreads) zz += __ldcg(a.z_partials + b);
    const double sum = block_sum(zz, red);
    if (threadIdx.x == 0) *a.z_loss = p.T > 0 ? static_cast<float>(p.z_coeff * sum / Td) : 0.0f;
  }
  if (p.seq_coeff != 0.0f && p.T == 0 && threadIdx.x == 0) *a.seq_loss = 0.0f;  // no sequence: no seq kernel
  if (select) {  // exclusive scan of the list sizes (E <= 2 kThreads), integers
    __syncthreads();
    const int i0 = 2 * threadIdx.x;
    const int32_t v0 = i0 < E ? sh.hist[i0] : 0, v1 = i0 + 1 < E ? sh.hist[i0 + 1] : 0;
    int32_t x = v0 + v1;
    for (int o = 1; o < 32; o *= 2) {
      const int32_t y = __shfl_up_sync(kFull, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    int32_t before = 0;
    for (int w = 0; w < warp; ++w) before += warp_total[w];
    const int32_t excl = before + x - (v0 + v1);
    if (i0 < E) a.cand_offset[i0] = excl;
    if (i0 + 1 < E) a.cand_offset[i0 + 1] = excl + v0;
  }
  if (threadIdx.x == 0) a.tickets[0] = 0;
}

// Sequence-wise balance loss: one block per sequence of L contiguous tokens; the last block sums
// the per-sequence terms in sequence order.
template <int NJ, int G, bool kBF16>
__global__ void __launch_bounds__(kThreads) seq_loss_kernel(RouterForwardArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ double red[kThreads];
  constexpr int RPW = 32 / G;
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, W = p.W;
  FwdShared sh;
  forward_smem(E, G, NJ, W, p.groups, false, 0, smem_raw, &sh);
  const Lanes<G> L = lanes_of<G>();
  const int warp = threadIdx.x / 32;
  for (int e = threadIdx.x; e < E; e += kThreads) sh.hist[e] = 0;
  __syncthreads();
  const int base = L.lane_g * NJ;
  const uint32_t vmask = lane_expert_mask<NJ>(base, E);
  bool bias_ok = true;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (p.bias && ((vmask >> j) & 1u)) bias_ok = bias_ok && fabsf(__ldg(p.bias + base + j)) < INFINITY;
  bias_ok = __all_sync(kFull, bias_ok);
  const bool soft = p.score == ScoreFunction::kSoftmax;

  float acc[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j] = 0.0f;
  const int64_t Ls = p.seq_length, first = int64_t{blockIdx.x} * Ls;
  const int64_t tiles = (Ls + RPW - 1) / RPW;
  for (int64_t tile = warp; tile < tiles; tile += kRouterWarps) {
    const int64_t r = tile * RPW + L.slot, t = first + r;
    RawRow<NJ, kBF16> raw;
    load_row<NJ, kBF16>(p, t, r < Ls, base, raw);
    // Uniform across the warp (as in route_rows_kernel): a group past the sequence or with a
    // non-finite row computes along and adds nothing.
    float z[NJ];
    unpack_row<NJ, kBF16>(raw, z);
    const bool bad = group_any(!bias_ok || !row_part_finite<NJ>(z, vmask), L);  // every lane, always
    const bool counted = r < Ls && !bad;
    float s[NJ];
    if (soft) {
      float mx, inv, lse, ex[NJ];
      softmax_parts<NJ>(z, L, false, mx, inv, lse, ex);
#pragma unroll
      for (int j = 0; j < NJ; ++j) s[j] = __fmul_rn(ex[j], inv);
    } else {
      float ss = 0.0f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        s[j] = sigmoid_score(z[j]);
        ss += s[j];
      }
      const float is = 1.0f / group_sum(ss, L);
#pragma unroll
      for (int j = 0; j < NJ; ++j) s[j] *= is;
    }
    if (counted) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[j] += s[j];
      for (int j = L.lane_g; j < k; j += G) atomicAdd(&sh.hist[a.selected[t * W + j]], 1);
    }
  }
  store_warp_sums<NJ>(acc, L, base, vmask, sh.rowbuf + warp * RPW * (G * NJ));
  __syncthreads();
  const float Lf = static_cast<float>(Ls);
  const float f_scale = static_cast<float>(E) / (static_cast<float>(k) * Lf);
  double term = 0.0;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const float P = sum_warp_parts(sh.rowbuf, RPW * (G * NJ), e);
    const int32_t cnt = sh.hist[e];
    a.seq_counts[int64_t{blockIdx.x} * E + e] = cnt;
    term += f_scale * static_cast<float>(cnt) * (P / Lf);
  }
  const double sum = block_sum(term, red);
  if (threadIdx.x == 0) a.seq_partials[blockIdx.x] = sum;
  if (!last_block_done(a.tickets + 1)) return;
  double total = 0.0;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += kThreads) total += __ldcg(a.seq_partials + b);
  total = block_sum(total, red);
  if (threadIdx.x == 0) {
    *a.seq_loss = static_cast<float>(p.seq_coeff * total / gridDim.x);
    a.tickets[1] = 0;
  }
}

// ---- select pass (capacity / token rounding) ----

// Token rounding's target count (the rule of router_rounded_count, docs/router.md).
__device__ __forceinline__ int64_t rounded_count(TokenRounding r, int64_t M, int64_t chosen, int64_t T) {
  const int64_t q = chosen / M, rem = chosen % M;
  int64_t tiles = q;
  if (r == TokenRounding::kUp) tiles = q + (rem != 0);
  if (r == TokenRounding::kNearest) tiles = q + (2 * rem > M || (2 * rem == M && (q % 2) == 1));
  return min(tiles * M, T);
}

// Unique per-expert key: [tier: chosen before candidates (rounding)] [monotone key] [~token].
__global__ void scatter_lists_kernel(RouterForwardArgs a) {
  const int64_t n = int64_t{a.p.T} * a.p.W;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int w = static_cast<int>(i % a.p.W);
    const int e = a.selected[i];
    if (!in_list(a, w, e)) continue;
    const int64_t t = i / a.p.W;
    const uint64_t tier = (a.select == SelectKey::kScore && w < a.p.k) ? 1u : 0u;
    const uint64_t key = (tier << 63) | (uint64_t{float_key(a.slot_key[i])} << 31) |
                         static_cast<uint64_t>(0x7fffffff - t);
    const int32_t pos = a.cand_offset[e] + atomicAdd(&a.cand_cursor[e], 1);
    a.list_key[pos] = key;
    a.list_slot[pos] = static_cast<int32_t>(i);
  }
}

// One block per expert: keep the `target` largest keys of its list. Keys are unique (the token is
// part of them), so the target-th largest, found 8 bits at a time, splits the list exactly. Writes
// the expert's counts.
__global__ void __launch_bounds__(256) select_kernel(RouterForwardArgs a) {
  __shared__ int32_t hist[256];
  __shared__ uint64_t prefix;
  __shared__ int64_t remaining;
  const int e = blockIdx.x;
  const int64_t n = a.cand_count[e];
  const uint64_t* keys = a.list_key + a.cand_offset[e];
  const int32_t* slots = a.list_slot + a.cand_offset[e];
  int64_t target = n;
  if (a.select == SelectKey::kScore)
    target = min(n, rounded_count(a.rounding, a.rounding_tile, a.selection_counts[e], a.p.T));
  else
    target = min(n, a.capacity);
  uint64_t threshold = 0;  // keep keys >= threshold (0 keeps all)
  if (target < n) {
    if (threadIdx.x == 0) {
      prefix = 0;
      remaining = target;
    }
    __syncthreads();
    if (target > 0) {
      for (int pass = 0; pass < 8; ++pass) {
        const int shift = 56 - 8 * pass;
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const uint64_t pre = prefix;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
          const uint64_t key = keys[i];
          if (pass == 0 || (key >> (shift + 8)) == pre) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
          int64_t cum = 0;
          for (int d = 255; d >= 0; --d) {
            if (cum + hist[d] >= remaining) {
              prefix = (pre << 8) | static_cast<uint64_t>(d);
              remaining -= cum;
              break;
            }
            cum += hist[d];
          }
        }
        __syncthreads();
      }
      threshold = prefix;
    }
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (target > 0 && keys[i] >= threshold) a.kept[slots[i]] = 1;
  if (threadIdx.x == 0) {
    a.counts32[e] = static_cast<int32_t>(target);
    if (a.counts64) a.counts64[e] = target;
  }
}

// Outputs from the kept flags: one warp per row.
__global__ void __launch_bounds__(kThreads) write_outputs_kernel(RouterForwardArgs a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t{blockIdx.x} * kRouterWarps + warp;
  if (t >= a.p.T) return;
  const int E = a.p.E, k = a.p.k, W = a.p.W;
  const int64_t i = t * W + lane;
  const bool kept = lane < W && a.kept[i];
  if (a.form == RoutingForm::kTopK) {
    if (lane < k) {
      a.indices[t * k + lane] = kept ? a.selected[i] : -1;
      a.probs[t * k + lane] = kept ? a.slot_prob[i] : 0.0f;
    }
  } else {
    for (int e = lane; e < E; e += 32) {
      a.map[t * E + e] = 0;
      a.probs[t * E + e] = 0.0f;
    }
    __syncwarp();
    if (kept) {
      const int e = a.selected[i];
      a.map[t * E + e] = 1;
      a.probs[t * E + e] = a.slot_prob[i];
    }
  }
}

template <int NJ, int G, bool kBF16, bool kGroups>
void launch_rows(const RouterForwardArgs& a, int blocks, int32_t tiles_per_block, cudaStream_t stream) {
  const RouterRowParams& p = a.p;
  const size_t smem =
      forward_smem(p.E, G, NJ, p.W, p.groups, p.aux_coeff != 0.0f, ring_bytes<NJ, kBF16>(), nullptr, nullptr);
  // A bf16 logit and an expert id fit one 32-bit key.
  auto kernel = kBF16 && p.bias == nullptr ? route_rows_kernel<NJ, G, std::conditional_t<kBF16, Key32, Key64>, kBF16, kGroups>
                                           : route_rows_kernel<NJ, G, Key64, kBF16, kGroups>;
  // Past 48 KiB of shared memory (dynamic + the kernel's static few KiB) a launch needs the opt-in.
  if (smem + 8 * 1024 > 48 * 1024)
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<blocks, kThreads, smem, stream>>>(a, tiles_per_block);
  MOE_CUDA_CHECK_LAUNCH();
  if (p.seq_coeff != 0.0f && p.T > 0) {
    const size_t seq_smem = forward_smem(p.E, G, NJ, p.W, p.groups, false, 0, nullptr, nullptr);
    seq_loss_kernel<NJ, G, kBF16><<<p.T / p.seq_length, kThreads, seq_smem, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
  }
}

// The instantiation for the row layout: G lanes per row (1..32) with NJ = 8, or a full warp with
// NJ = 16 (E > 256).
template <bool kBF16, bool kGroups>
void launch_rows_for(const RouterForwardArgs& a, int blocks, int32_t tiles_per_block, cudaStream_t stream) {
  if (router_experts_per_lane(a.p.E) == 16) return launch_rows<16, 32, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
  switch (a.p.G) {
    case 1: return launch_rows<8, 1, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
    case 2: return launch_rows<8, 2, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
    case 4: return launch_rows<8, 4, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
    case 8: return launch_rows<8, 8, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
    case 16: return launch_rows<8, 16, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
    default: return launch_rows<8, 32, kBF16, kGroups>(a, blocks, tiles_per_block, stream);
  }
}

}  // namespace
}  // namespace router

RouterRowGrid router_row_grid(int64_t T, int G) {
  const int64_t rows_per_warp = 32 / G;
  const int64_t tiles = (T + rows_per_warp - 1) / rows_per_warp;
  const int64_t b = (tiles + kRouterWarps - 1) / kRouterWarps;
  RouterRowGrid g;
  g.blocks = static_cast<int>(std::clamp<int64_t>(b, 1, kRouterMaxBlocks));
  g.tiles_per_block = static_cast<int32_t>((tiles + g.blocks - 1) / g.blocks);
  return g;
}

void launch_router_forward(const RouterForwardArgs& a, cudaStream_t stream) {
  using namespace router;
  const RouterRowParams& p = a.p;
  const int E = p.E;
  if (router_topk_rows_apply(a)) return launch_router_topk_rows(a, stream);
  if (router_biased_rows_apply(a)) return launch_router_biased_rows(a, stream);
  const bool select = a.select != SelectKey::kNone;
  // The row kernel (one launch, whatever T: it ends with the counts and losses written).
  const RouterRowGrid grid = router_row_grid(p.T, p.G);
  using Launch = void (*)(const RouterForwardArgs&, int, int32_t, cudaStream_t);
  static constexpr Launch kLaunch[2][2] = {  // [bf16][groups]
      {launch_rows_for<false, false>, launch_rows_for<false, true>},
      {launch_rows_for<true, false>, launch_rows_for<true, true>}};
  kLaunch[p.bf16][p.groups > 1](a, grid.blocks, grid.tiles_per_block, stream);
  if (select) {
    if (p.T > 0) {
      const int64_t n = int64_t{p.T} * p.W;
      const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
      scatter_lists_kernel<<<grid, 256, 0, stream>>>(a);
      MOE_CUDA_CHECK_LAUNCH();
    }
    select_kernel<<<E, 256, 0, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
    if (p.T > 0) {
      write_outputs_kernel<<<(p.T + kRouterWarps - 1) / kRouterWarps, kThreads, 0, stream>>>(a);
      MOE_CUDA_CHECK_LAUNCH();
    }
  }
}

}  // namespace moe::kernels
