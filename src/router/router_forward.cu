// Router forward on the device (see docs/router.md):
//   1. route_rows: one warp per token row -- scores, group limit, top-k (+ rounding candidates),
//      probs, selection counts, per-block partial sums of the balancing scores and of lse^2.
//   2. seq_loss (sequence aux loss only): one block per sequence.
//   3. with a capacity or token rounding, the select pass: per-expert candidate lists, one block
//      per expert keeping its best entries by a unique 64-bit key (radix select), then the outputs.
//   4. finalize: counts and the loss scalars, summed in a fixed order.
// Integer counts use atomics (exact whatever the order); every float sum has a fixed order.
#include <algorithm>

#include "device/cuda_check.h"
#include "moe/device_errors.h"
#include "router/router_kernels.h"
#include "router/router_math.cuh"

namespace moe::kernels {
namespace router {
namespace {

constexpr int kThreads = kRouterWarps * 32;

struct SharedLayout {
  int32_t* hist;   // [E] selection counts of the block
  int32_t* chist;  // [E] candidate-list entries of the block
  float* part;     // [warps, E] balancing-score sums of each warp
  float* gbuf;     // [warps, E] group-scoring values of each warp's row
  float* zpart;    // [warps]
};

__host__ __device__ inline size_t shared_bytes(int E) {
  return sizeof(int32_t) * 2 * E + sizeof(float) * (2 * kRouterWarps * E + kRouterWarps);
}

__device__ inline SharedLayout carve(unsigned char* raw, int E) {
  SharedLayout s;
  s.hist = reinterpret_cast<int32_t*>(raw);
  s.chist = s.hist + E;
  s.part = reinterpret_cast<float*>(s.chist + E);
  s.gbuf = s.part + kRouterWarps * E;
  s.zpart = s.gbuf + kRouterWarps * E;
  return s;
}

// Does slot w (expert e >= 0) enter the per-expert lists of the select pass?
__device__ __forceinline__ bool in_list(const RouterForwardArgs& a, int w, int e) {
  return e >= 0 && (a.select == SelectKey::kScore || w < a.p.k);
}

// Winner of (value desc, id asc) over the warp; id < 0 means "none" and always loses.
__device__ __forceinline__ void warp_argmax(float& v, int& id) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, id, o);
    if (oi >= 0 && (id < 0 || ov > v || (ov == v && oi < id))) {
      v = ov;
      id = oi;
    }
  }
}

template <int NJ, bool kSelectPass>
__global__ void __launch_bounds__(kThreads) route_rows_kernel(RouterForwardArgs a, int32_t rows_per_block) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k, W = p.W;
  const SharedLayout sh = carve(smem_raw, E);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e < E; e += kThreads) sh.hist[e] = sh.chist[e] = 0;
  __syncthreads();

  const bool want_a = p.aux_coeff != 0.0f, want_lse = p.z_coeff != 0.0f;
  const bool by_logit = !p.softmax_after && p.bias == nullptr;  // order of z == order of s
  float acc[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j] = 0.0f;
  float zacc = 0.0f;
  uint32_t bits = 0;
  const int32_t t0 = blockIdx.x * rows_per_block, t1 = min(p.T, t0 + rows_per_block);
  for (int32_t t = t0 + warp; t < t1; t += kRouterWarps) {
    float z[NJ];
    load_row<NJ>(p, t, lane, z);
    if (!row_finite<NJ>(p, lane, z)) {
      bits |= kErrNonFiniteLogit;  // routed nowhere; kept[] stays 0 in the select pass
      if (lane < W) a.selected[int64_t{t} * W + lane] = -1;
      if (!kSelectPass) {
        if (a.form == RoutingForm::kTopK) {
          if (lane < k) {
            a.indices[int64_t{t} * k + lane] = -1;
            a.probs[int64_t{t} * k + lane] = 0.0f;
          }
        } else {
          for (int e = lane; e < E; e += 32) {
            a.map[int64_t{t} * E + e] = 0;
            a.probs[int64_t{t} * E + e] = 0.0f;
          }
        }
      }
      continue;
    }
    RowScores<NJ> sc;
    row_scores<NJ>(p, lane, z, want_a, want_lse, sc);

    // Selection values: v orders the experts of a row, sv is the comparable score (biased).
    float v[NJ], sv[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const int e = j * 32 + lane;
      if (e < E) {
        sv[j] = (p.softmax_after ? z[j] : sc.s[j]) + (p.bias ? __ldg(p.bias + e) : 0.0f);
        v[j] = by_logit ? z[j] : sv[j];
      } else {
        sv[j] = v[j] = -INFINITY;
      }
    }
    if (p.groups > 1) {
      float* g = sh.gbuf + warp * E;
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        if (j * 32 + lane < E) g[j * 32 + lane] = sv[j];
      __syncwarp();
      const int gs = E / p.groups;
      float gscore = -INFINITY;
      if (lane < p.groups) {
        float top1 = -INFINITY, top2 = -INFINITY;
        for (int i = 0; i < gs; ++i) {
          const float x = g[lane * gs + i];
          if (x > top1) {
            top2 = top1;
            top1 = x;
          } else if (x > top2) {
            top2 = x;
          }
        }
        gscore = gs > 1 ? top1 + top2 : top1;
      }
      __syncwarp();  // g is rewritten by the next row
      uint32_t keep = 0;
      bool taken = lane >= p.groups;
      for (int i = 0; i < p.topk_groups; ++i) {
        float bv = gscore;
        int bi = taken ? -1 : lane;
        warp_argmax(bv, bi);
        keep |= 1u << bi;
        if (lane == bi) taken = true;
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int e = j * 32 + lane;
        if (e < E && !((keep >> (e / gs)) & 1u)) v[j] = -INFINITY;
      }
    }

    // Top-W, one slot per step; lane w keeps slot w's expert and values.
    uint32_t taken = 0;
    int my_e = -1;
    float my_s = 0.0f, my_z = 0.0f, my_sv = 0.0f;
    for (int w = 0; w < W; ++w) {
      float bv = -INFINITY;
      int be = -1;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int e = j * 32 + lane;
        if (e < E && !((taken >> j) & 1u) && (be < 0 || v[j] > bv)) {
          bv = v[j];
          be = e;
        }
      }
      warp_argmax(bv, be);
      if (lane == be % 32) taken |= 1u << (be / 32);
      const int e_w = bv == -INFINITY ? -1 : be;  // a masked group: no expert left for this slot
      float s_w = 0.0f, z_w = 0.0f, sv_w = 0.0f;
      if (e_w >= 0) {
        s_w = from_owner<NJ>(sc.s, e_w);
        z_w = from_owner<NJ>(z, e_w);
        sv_w = from_owner<NJ>(sv, e_w);
      }
      if (lane == w) {
        my_e = e_w;
        my_s = s_w;
        my_z = z_w;
        my_sv = sv_w;
      }
    }

    // Probs: the chosen slots are lanes 0..k-1, candidates k..W-1.
    const bool chosen = lane < k;
    float prob = my_s;
    if (p.softmax_after) {
      const float zm = warp_max(chosen ? my_z : -INFINITY);
      const float ex = chosen ? expf(my_z - zm) : 0.0f;
      prob = ex / warp_sum(ex);
    } else if (p.normalize) {
      const float den = warp_sum(chosen ? my_s : 0.0f);
      if (chosen) prob = my_s / den;
    }
    prob *= p.alpha;

    const int64_t row = t;
    if (lane < W) a.selected[row * W + lane] = my_e;
    if (chosen) atomicAdd(&sh.hist[my_e], 1);
    if (!kSelectPass) {
      if (a.form == RoutingForm::kTopK) {
        if (chosen) {
          a.indices[row * k + lane] = my_e;
          a.probs[row * k + lane] = prob;
        }
      } else {
        for (int e = lane; e < E; e += 32) {
          a.map[row * E + e] = 0;
          a.probs[row * E + e] = 0.0f;
        }
        __syncwarp();  // orders the zeros before the writes of the chosen experts
        if (chosen) {
          a.map[row * E + my_e] = 1;
          a.probs[row * E + my_e] = prob;
        }
      }
    } else if (lane < W) {
      a.slot_prob[row * W + lane] = prob;
      a.slot_key[row * W + lane] =
          a.select == SelectKey::kProb ? prob : a.select == SelectKey::kScore ? my_sv : 0.0f;
      if (in_list(a, lane, my_e)) atomicAdd(&sh.chist[my_e], 1);
    }
    if (want_a) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) acc[j] += sc.a[j];
    }
    zacc += sc.lse * sc.lse;  // same on every lane; lane 0's is used
  }

  if (lane == 0 && bits) atomicOr(a.error_word, bits);
  if (want_a) {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
      if (j * 32 + lane < E) sh.part[warp * E + j * 32 + lane] = acc[j];
  }
  if (lane == 0) sh.zpart[warp] = zacc;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (want_a) {
      float sum = 0.0f;
      for (int w = 0; w < kRouterWarps; ++w) sum += sh.part[w * E + e];
      a.loss_partials[int64_t{blockIdx.x} * E + e] = sum;
    }
    if (sh.hist[e]) atomicAdd(&a.selection_counts[e], sh.hist[e]);
    if (kSelectPass && sh.chist[e]) atomicAdd(&a.cand_count[e], sh.chist[e]);
  }
  if (threadIdx.x == 0 && want_lse) {
    float sum = 0.0f;
    for (int w = 0; w < kRouterWarps; ++w) sum += sh.zpart[w];
    a.z_partials[blockIdx.x] = sum;
  }
}

// Sequence-wise balance loss: one block per sequence of L contiguous tokens.
template <int NJ>
__global__ void __launch_bounds__(kThreads) seq_loss_kernel(RouterForwardArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const RouterRowParams& p = a.p;
  const int E = p.E, k = p.k;
  const SharedLayout sh = carve(smem_raw, E);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e < E; e += kThreads) sh.hist[e] = 0;
  __syncthreads();
  float acc[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) acc[j] = 0.0f;
  const int64_t L = p.seq_length, first = int64_t{blockIdx.x} * L;
  for (int64_t t = first + warp; t < first + L; t += kRouterWarps) {
    float z[NJ];
    load_row<NJ>(p, t, lane, z);
    if (!row_finite<NJ>(p, lane, z)) continue;
    RowScores<NJ> sc;
    row_scores<NJ>(p, lane, z, true, false, sc);
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[j] += sc.a[j];
    if (lane < k) atomicAdd(&sh.hist[a.selected[t * p.W + lane]], 1);
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
    if (j * 32 + lane < E) sh.part[warp * E + j * 32 + lane] = acc[j];
  __syncthreads();
  float* terms = sh.gbuf;
  const float f_scale = static_cast<float>(E) / (static_cast<float>(k) * static_cast<float>(L));
  for (int e = threadIdx.x; e < E; e += kThreads) {
    float P = 0.0f;
    for (int w = 0; w < kRouterWarps; ++w) P += sh.part[w * E + e];
    const int32_t cnt = sh.hist[e];
    a.seq_counts[int64_t{blockIdx.x} * E + e] = cnt;
    terms[e] = f_scale * static_cast<float>(cnt) * (P / static_cast<float>(L));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += terms[e];
    a.seq_partials[blockIdx.x] = sum;
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

__global__ void list_offsets_kernel(const int32_t* cand_count, int E, int32_t* cand_offset, int32_t* cursor) {
  if (threadIdx.x != 0) return;
  int32_t run = 0;
  for (int e = 0; e < E; ++e) {
    cand_offset[e] = run;
    cursor[e] = 0;
    run += cand_count[e];
  }
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
// part of them), so the target-th largest, found 8 bits at a time, splits the list exactly.
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

// Counts (dropless) and the loss scalars; one block, fixed summation orders (fp64 across blocks).
__global__ void __launch_bounds__(512) finalize_kernel(RouterForwardArgs a, int blocks, int64_t sequences,
                                                       bool select) {
  __shared__ double terms[512];
  const RouterRowParams& p = a.p;
  const int E = p.E;
  const int e = threadIdx.x;
  const double T = p.T;
  if (e < E) {
    const int32_t c = a.selection_counts[e];
    if (!select) {
      a.counts32[e] = c;
      if (a.counts64) a.counts64[e] = c;
    }
    if (p.aux_coeff != 0.0f) {
      double P = 0;
      for (int b = 0; b < blocks; ++b) P += a.loss_partials[int64_t{b} * E + e];
      terms[e] = (static_cast<double>(c) / (T * p.k)) * (P / T);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (p.aux_coeff != 0.0f) {
    double sum = 0;
    for (int i = 0; i < E; ++i) sum += terms[i];
    *a.aux_loss = p.T > 0 ? static_cast<float>(p.aux_coeff * E * sum) : 0.0f;
  }
  if (p.z_coeff != 0.0f) {
    double sum = 0;
    for (int b = 0; b < blocks; ++b) sum += a.z_partials[b];
    *a.z_loss = p.T > 0 ? static_cast<float>(p.z_coeff * sum / T) : 0.0f;
  }
  if (p.seq_coeff != 0.0f) {
    double sum = 0;
    for (int64_t b = 0; b < sequences; ++b) sum += a.seq_partials[b];
    *a.seq_loss = sequences > 0 ? static_cast<float>(p.seq_coeff * sum / sequences) : 0.0f;
  }
}

template <int NJ>
void launch_rows(const RouterForwardArgs& a, int blocks, int32_t rows_per_block, bool select, cudaStream_t stream) {
  const size_t smem = shared_bytes(a.p.E);
  if (select)
    route_rows_kernel<NJ, true><<<blocks, kThreads, smem, stream>>>(a, rows_per_block);
  else
    route_rows_kernel<NJ, false><<<blocks, kThreads, smem, stream>>>(a, rows_per_block);
  MOE_CUDA_CHECK_LAUNCH();
  if (a.p.seq_coeff != 0.0f && a.p.T > 0) {
    seq_loss_kernel<NJ><<<a.p.T / a.p.seq_length, kThreads, smem, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace
}  // namespace router

int router_row_blocks(int64_t T) {
  const int64_t b = (T + kRouterWarps - 1) / kRouterWarps;
  return static_cast<int>(b < kRouterMaxBlocks ? b : kRouterMaxBlocks);
}

void launch_router_forward(const RouterForwardArgs& a, cudaStream_t stream) {
  using namespace router;
  const int E = a.p.E;
  const bool select = a.select != SelectKey::kNone;
  MOE_CUDA_CHECK(cudaMemsetAsync(a.selection_counts, 0, sizeof(int32_t) * E, stream));
  if (select) {
    MOE_CUDA_CHECK(cudaMemsetAsync(a.cand_count, 0, sizeof(int32_t) * E, stream));
    if (a.p.T > 0) MOE_CUDA_CHECK(cudaMemsetAsync(a.kept, 0, int64_t{a.p.T} * a.p.W, stream));
  }
  const int blocks = router_row_blocks(a.p.T);
  if (blocks > 0) {
    const int32_t rows_per_block = static_cast<int32_t>((int64_t{a.p.T} + blocks - 1) / blocks);
    if (E <= 32)
      launch_rows<1>(a, blocks, rows_per_block, select, stream);
    else if (E <= 64)
      launch_rows<2>(a, blocks, rows_per_block, select, stream);
    else if (E <= 128)
      launch_rows<4>(a, blocks, rows_per_block, select, stream);
    else if (E <= 256)
      launch_rows<8>(a, blocks, rows_per_block, select, stream);
    else
      launch_rows<16>(a, blocks, rows_per_block, select, stream);
  }
  if (select) {
    list_offsets_kernel<<<1, 32, 0, stream>>>(a.cand_count, E, a.cand_offset, a.cand_cursor);
    MOE_CUDA_CHECK_LAUNCH();
    if (a.p.T > 0) {
      const int64_t n = int64_t{a.p.T} * a.p.W;
      const int grid = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
      scatter_lists_kernel<<<grid, 256, 0, stream>>>(a);
      MOE_CUDA_CHECK_LAUNCH();
    }
    select_kernel<<<E, 256, 0, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
    if (a.p.T > 0) {
      write_outputs_kernel<<<(a.p.T + kRouterWarps - 1) / kRouterWarps, kThreads, 0, stream>>>(a);
      MOE_CUDA_CHECK_LAUNCH();
    }
  }
  const int64_t sequences = a.p.seq_coeff != 0.0f ? a.p.T / a.p.seq_length : 0;
  finalize_kernel<<<1, 512, 0, stream>>>(a, blocks, sequences, select);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
