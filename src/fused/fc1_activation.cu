// The fused fc1 + activation x prob kernel (fc1_activation.h; design in docs/fused.md).
//
// Persistent and warp-specialized, one CTA per SM, 384 threads:
//   * warp group 0 (producer) gathers the A rows of each 128-row tile straight from x through the
//     dispatch map with 16-byte cp.async (TMA cannot gather rows), 64 columns at a time, into a
//     4-stage ring of 128-byte-swizzled shared-memory tiles. A weight tile holds the gate rows and
//     the linear rows of the same 128 features, so the epilogue finds both halves of a GLU pair in
//     one thread. With single-grouped weights and GLU interleave 0 (or no GLU) the weight tile
//     comes by TMA, and two CTAs of a cluster -- two row blocks of one expert -- each load one
//     half of it and multicast it to both: half the L2 -> SM traffic for weights, which is what
//     bounds a 128x256 tile here. Other interleaves and per-expert weights copy the weight rows with
//     cp.async too (one CTA per cluster).
//   * warp groups 1 and 2 (consumers) run WGMMA 64x256x16 on rows 0-63 and 64-127 and then the
//     epilogue from registers: round h to bf16, add the bias, store h, apply the activation x prob,
//     store act. While they do, the producer already fills the ring for the next tile.
// Tiles are (expert, cluster of 128-row blocks, feature block) triples numbered expert by expert
// (a cluster of 2 CTAs takes 2 row blocks of one expert; an odd last row block is taken by both,
// with two feature blocks and no multicast); each cluster walks them with a stride of
// the number of clusters. The prefix of tiles per expert is computed on the device
// at kernel start from the group offsets (graph-safe; empty experts take no tile).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <cuda.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include "device/cuda_check.h"
#include "fused/async_copy.cuh"
#include "fused/fragment_pack.cuh"
#include "fused/gather_rows.cuh"
#include "fused/pipeline.cuh"
#include "fused/cluster_launch.h"
#include "fused/consumer_loop.cuh"
#include "fused/fc1_activation.h"
#include "fused/row_tile_limits.h"
#include "fused/row_tiles.cuh"
#include "fused/tensor_map.h"
#include "kernels/activation_math.cuh"

namespace moe::fused {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using kernels::ActConsts;
using kernels::ActOp;

constexpr int kBM = kGatherRows, kBN = 256, kBK = kGatherCols, kStages = 4;
static_assert(kBM == 128 && kBK == 64, "the gathered A stage (gather_rows.cuh) is 128 x 64");
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
constexpr int kStageBytesA = kBM * kBK * 2;  // 16 KiB
constexpr int kStageBytesB = kBN * kBK * 2;  // 32 KiB
constexpr int kMaxExperts = kMaxRowTileExperts;
constexpr int kHalfBytesB = kStageBytesB / 2;  // one 128-row TMA box of the weight tile
// Register split between the roles (multiples of 8; 128 * 88 + 256 * 208 <= 64K registers; no spills at this split).
constexpr int kProducerRegs = 88, kConsumerRegs = 208;

// 128-byte swizzled K-major tiles: the layout WGMMA reads. One 64-column row is 128 bytes, eight
// rows make a 1024-byte swizzle atom and the atoms stack along the rows.
using SmemAtom = GMMA::Layout_K_SW128_Atom<bf16>;
using SmemLayoutA = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
using SmemLayoutB = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
using TiledMma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{},
                                         Layout<Shape<_2, _1, _1>>{}));

struct SharedStorage {
  alignas(1024) uint8_t a[kStages][kStageBytesA];
  alignas(1024) uint8_t b[kStages][kStageBytesB];
  alignas(8) uint64_t full[kStages];   // producer -> consumers: the stage's copies landed
  alignas(8) uint64_t empty[kStages];  // consumers -> producer: the stage's WGMMAs are done
  int32_t tile_start[kMaxExperts + 1];  // only E + 1 entries are used (and allocated)
};
constexpr size_t kFixedSmemBytes = offsetof(SharedStorage, tile_start);

struct Params {
  CUtensorMap w1_map;  // TMA kernels: fc1 weights as a 3D [E, fc1_out, H] tensor (64 x 128 boxes)
  const __nv_bfloat16* a;
  __nv_bfloat16* a_out;  // x_perm written with the gathered rows, or null
  const int32_t* row_slots;
  int slots;
  const int32_t* offsets;
  int E;
  int64_t R;
  int H, F;
  int feature_tiles;  // NT: feature blocks per row block
  const __nv_bfloat16* w1_base;
  int64_t w1_stride;  // elements
  const __nv_bfloat16* const* w1_table;
  const __nv_bfloat16* b1_base;
  const __nv_bfloat16* const* b1_table;
  const float* probs;
  int interleave;
  ActConsts consts;
  __nv_bfloat16* h;
  __nv_bfloat16* act;
};

using Tile = RowTile;

// Clusters of 2 split an expert's odd last row block between their CTAs by feature block
// (row_tiles.cuh): each loads its own weight tile there, and a CTA runs a tile without rows only
// when the feature blocks are odd in number (one per odd expert instead of one per feature block).
template <int kCluster>
__device__ __forceinline__ Tile decode_tile(int t, const int32_t* start, const Params& p, int rank) {
  return decode_row_tile<kBM, kCluster, kCluster == 2>(t, start, p.offsets, p.E, p.R, p.feature_tiles, rank);
}

// Physical fc1 row of row j of a weight tile (-1: past F, zero-filled).
template <bool kGated>
__device__ __forceinline__ int weight_row(int j, int nt, const Params& p) {
  if constexpr (kGated) {
    const bool linear = j >= kBN / 2;
    const int f = nt * (kBN / 2) + (linear ? j - kBN / 2 : j);
    if (f >= p.F) return -1;
    return linear ? kernels::linear_col(f, p.F, p.interleave) : kernels::gate_col(f, p.F, p.interleave);
  } else {
    const int f = nt * kBN + j;
    return f < p.F ? f : -1;
  }
}

// First fc1 row of half `half` (0 or 1) of feature block nt's weight tile, interleave 0.
template <bool kGated>
__device__ __forceinline__ int tma_row(int half, int nt, const Params& p) {
  if constexpr (kGated) return half == 0 ? nt * (kBN / 2) : p.F + nt * (kBN / 2);
  else return nt * kBN + half * (kBN / 2);
}

template <bool kGated, bool kTma>
__device__ void produce(SharedStorage& s, const Params& p, int total, int rank) {
  constexpr int kCluster = kTma ? 2 : 1;
  const int tid = threadIdx.x;  // 0..127
  const int c = tid & 7, r0 = tid >> 3;
  // Each thread copies chunk c of rows r0 + 16 i: 8 rows of A and 16 of B per stage; a warp covers
  // 4 whole 128-byte row segments per instruction.
  const uint32_t a_dst = smem_u32(s.a[0]) + swizzled_chunk(r0, c);
  const uint32_t b_dst = smem_u32(s.b[0]) + swizzled_chunk(r0, c);
  const int k_blocks = (p.H + kBK - 1) / kBK;
  RingPosition<kStages> ring;
  ring.phase = 1;  // a fresh barrier counts as released for parity 1
  for (int t = blockIdx.x / kCluster; t < total; t += gridDim.x / kCluster) {
    const Tile tile = decode_tile<kCluster>(t, s.tile_start, p, rank);
    GatherRows<kRowsPerThread> a_rows;
    gather_source_rows(a_rows, tile, p.row_slots, p.slots, r0, p.a, p.H);
    const __nv_bfloat16* w = p.w1_table != nullptr ? p.w1_table[tile.e] : p.w1_base + tile.e * p.w1_stride;
    int b_row[kBN / 16];
#pragma unroll
    for (int i = 0; i < kBN / 16; ++i) b_row[i] = kTma ? -1 : weight_row<kGated>(r0 + 16 * i, tile.nt, p);

#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase);
      const int k = kb * kBK + c * 8;
      const bool k_in = k < p.H;
      const uint32_t da = a_dst + ring.stage * kStageBytesA, db = b_dst + ring.stage * kStageBytesB;
      if (kTma && tid == 0) {
        // Both halves land here: ours and the peer's multicast, or, on an expert's odd last row
        // block (tile.solo, the peer on another feature block), both loaded by this CTA alone.
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage], kStageBytesB);
        constexpr uint64_t kEvictLast = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);
        if (tile.solo) {
          for (int half = 0; half < 2; ++half)
            SM90_TMA_LOAD_3D::copy(&p.w1_map, &s.full[ring.stage], kEvictLast, s.b[ring.stage] + half * kHalfBytesB,
                                   kb * kBK, tma_row<kGated>(half, tile.nt, p), tile.e);
        } else {
          SM90_TMA_LOAD_MULTICAST_3D::copy(&p.w1_map, &s.full[ring.stage], static_cast<uint16_t>((1 << kCluster) - 1),
                                           kEvictLast, s.b[ring.stage] + rank * kHalfBytesB, kb * kBK,
                                           tma_row<kGated>(rank, tile.nt, p), tile.e);
        }
      }
      gather_stage(da, a_rows, p.H, kb, c);
#pragma unroll
      for (int i = 0; i < (kTma ? 0 : kBN / 16); ++i) {
        int row = b_row[i];
        asm volatile("" : "+r"(row));
        const bool v = row >= 0 && k_in;
        cp_async_16(db + i * 2048, v ? w + (static_cast<int64_t>(row) * p.H + k) : w, v);
      }
      // Arrives on full[stage] once this thread's copies have landed.
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
      ring.advance();
    }
  }
  cute::cp_async_wait<0>();
}


// kInterleave0: the GLU interleave is 0 (or there is no GLU), known at compile time.
template <Activation A, int kCluster, bool kInterleave0>
__device__ void consume(SharedStorage& s, const Params& p, int total, int rank) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  const int ctid = threadIdx.x - kProducerThreads;
  const int lane = threadIdx.x & 31;
  TiledMma mma;
  mma.accumulate_ = GMMA::ScaleOut::One;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<bf16*>(s.a[0])), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<bf16*>(s.b[0])), SmemLayoutB{});
  auto thr = mma.get_thread_slice(ctid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage) descriptors
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  static_assert(size(decltype(acc){}) == 128, "64x256 per warp group: 128 accumulators per thread");

  const int k_blocks = (p.H + kBK - 1) / kBK;
  const int F = p.F;
  const int64_t h_cols = kGated ? 2 * static_cast<int64_t>(F) : F;
  RingPosition<kStages> ring;
  ring.phase = 0;
  for (int t = blockIdx.x / kCluster; t < total; t += gridDim.x / kCluster) {
    const Tile tile = decode_tile<kCluster>(t, s.tile_start, p, rank);
    // Cleared here rather than by a zero scale on the first WGMMA: the accumulators are then dead
    // from the end of one tile's epilogue to the next tile's clear, so the epilogue gets their
    // registers (with a zero scale they stay live around the tile loop: the WGMMA reads them).
    clear(acc);
    // The rows' probs, loaded now so that their latency hides under the main loop, not the epilogue.
    const int r_first = get<0>(coord(0));
    float prob[2];
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = r_first + 8 * v1;
      prob[v1] = (p.probs != nullptr && r < tile.rows) ? p.probs[tile.m0 + r] : 1.0f;
    }
    consume_k_blocks<kCluster>(
        mma, tCrA, tCrB, acc, s.full, s.empty, ring, k_blocks, lane,
        [](int, int) {},
        // While the tensor cores run: the gathered rows of this stage out to x_perm, so the backward
        // finds x_perm without another pass over x. Each feature block of a row block writes every
        // feature_tiles-th k block: the writes spread evenly over all tiles instead of saturating
        // HBM during the first feature block's tiles.
        [&](int stage, int kb) {
          if (p.a_out != nullptr && kb % p.feature_tiles == tile.nt)
            store_gathered_stage<kConsumerThreads>(s.a[stage], p.a_out, tile, p.H, kb, ctid);
        },
        p.a_out != nullptr);  // those copies read the stage: each thread releases its own reads

    // Epilogue. Accumulator (v0, v1, v2) = index v0 + 2 v1 + 4 v2 is row r + 8 v1, column
    // 8 v2 + 2 (lane % 4) + v0 (gated: v2 < 16 gate, v2 + 16 its linear partner). The 4 lanes of a
    // quad hold 4 column blocks of 8 of a row as column pairs; a 4 x 4 transpose of packed bf16
    // pairs gives each lane one whole block, so every store is a 16-byte vector (a warp writes 8
    // rows x 64 contiguous bytes) and the bias is one 16-byte load per vector.
    const int j = lane & 3;
    const __nv_bfloat16* bias = p.b1_table != nullptr ? p.b1_table[tile.e]
                                : p.b1_base != nullptr ? p.b1_base + tile.e * h_cols
                                                       : nullptr;
    constexpr int kBlocks = kGated ? 4 : 8;  // groups of 4 column blocks of 8 (gate half when gated)
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = r_first + 8 * v1;
      const bool row_ok = r < tile.rows;
      const int64_t row = tile.m0 + r;
#pragma unroll
      for (int m = 0; m < kBlocks; ++m) {
        uint32_t g_out[4], l_out[4];
        pack_transpose_pairs(acc, 2 * v1 + 16 * m, j, g_out);  // all lanes take part: before any row check
        if constexpr (kGated) pack_transpose_pairs(acc, 2 * v1 + 16 * m + 64, j, l_out);
        const int f = tile.nt * (kGated ? kBN / 2 : kBN) + 8 * (4 * m + j);  // first feature of this lane's 8
        if (!row_ok || f >= F) continue;
        float g[kernels::kVec], l[kernels::kVec], out[kernels::kVec];
        unpack_bf16x8(g_out, g);
        if constexpr (kGated) unpack_bf16x8(l_out, l);
        __nv_bfloat16* hr = p.h + row * h_cols;
        if constexpr (kGated) {
          const bool alternating = !kInterleave0 && p.interleave == 1;
          const int gc = kInterleave0 ? f : kernels::gate_col(f, F, p.interleave);
          const int lc = kInterleave0 ? F + f : kernels::linear_col(f, F, p.interleave);
          if (bias != nullptr) {
            float bg[kernels::kVec], bl[kernels::kVec];
            if (alternating) {
              kernels::load_glu_alternating(bias, f, bg, bl);
            } else {
              kernels::load_bf16x8(bias + gc, bg);
              kernels::load_bf16x8(bias + lc, bl);
            }
#pragma unroll
            for (int e = 0; e < kernels::kVec; ++e) {
              g[e] = round_bf16(g[e] + bg[e]);
              l[e] = round_bf16(l[e] + bl[e]);
            }
          }
          if (alternating) {
            kernels::store_glu_alternating(hr, f, g, l);
          } else {
            kernels::store_bf16x8(hr + gc, g);
            kernels::store_bf16x8(hr + lc, l);
          }
#pragma unroll
          for (int e = 0; e < kernels::kVec; ++e) out[e] = ActOp<A>::value(g[e], l[e], p.consts) * prob[v1];
        } else {
          if (bias != nullptr) {
            float b[kernels::kVec];
            kernels::load_bf16x8(bias + f, b);
#pragma unroll
            for (int e = 0; e < kernels::kVec; ++e) g[e] = round_bf16(g[e] + b[e]);
          }
          kernels::store_bf16x8(hr + f, g);
#pragma unroll
          for (int e = 0; e < kernels::kVec; ++e) out[e] = ActOp<A>::value(g[e], 0.0f, p.consts) * prob[v1];
        }
        kernels::store_bf16x8(p.act + row * F + f, out);
      }
    }
  }
}

template <Activation A, bool kTma>
__global__ void __launch_bounds__(kThreads, 1) fc1_activation_kernel(const __grid_constant__ Params p) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  constexpr int kCluster = kTma ? 2 : 1;
  const int rank = kCluster == 1 ? 0 : static_cast<int>(cute::block_rank_in_cluster());
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the address bits: the tiles must start 1024-byte aligned.
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(align_smem_1024(smem_raw));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;

  if (warp == 0) {
    prefix_row_tiles<kBM, kCluster, kCluster == 2>(s.tile_start, p.offsets, p.E, p.R, p.feature_tiles, lane);
  } else if (warp == 1 && lane == 0) {
    // full: every producer thread's cp.async arrival (+ the TMA issuer's expect-tx arrival);
    // empty: every consumer warp of every CTA of the cluster (every consumer thread when the
    // consumers copy the stages out to x_perm).
    init_stage_barriers<kStages>(s.full, s.empty, kProducerThreads + (kTma ? 1 : 0),
                                 kCluster * stage_releases(kConsumerThreads, p.a_out != nullptr));
  }
  if (kTma && threadIdx.x == 0) cute::prefetch_tma_descriptor(&p.w1_map);
  // The peer's barriers must be initialized before anything arrives on them.
  if constexpr (kCluster > 1) cute::cluster_sync();
  else __syncthreads();
  const int total = s.tile_start[p.E];

  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    produce<kGated, kTma>(s, p, total, rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume<A, kCluster, kTma>(s, p, total, rank);
  }
  // No CTA may leave while its peer can still arrive on its barriers.
  if constexpr (kCluster > 1) cute::cluster_sync();
}

size_t smem_bytes(int experts) { return 1024 + kFixedSmemBytes + sizeof(int32_t) * (experts + 1); }

template <Activation A, bool kTma>
void launch_kernel(const Params& p, int grid, cudaStream_t stream) {
  launch_clustered(fc1_activation_kernel<A, kTma>, p, grid, kThreads, kTma ? 2 : 1, smem_bytes(p.E),
                   smem_bytes(kMaxExperts), stream);
}

template <Activation A>
void launch_kind(const Params& p, bool tma, int grid, cudaStream_t stream) {
  if (tma) launch_kernel<A, true>(p, grid, stream);
  else launch_kernel<A, false>(p, grid, stream);
}

// fc1 weights [E, rows, H] as a TMA tensor: 64-column x 128-row boxes, 128-byte swizzle (the
// shared-memory layout the WGMMA reads), zeros past the edges.
CUtensorMap weight_map(const void* base, int E, int64_t rows, int H) {
  const uint64_t dims[3] = {static_cast<uint64_t>(H), static_cast<uint64_t>(rows), static_cast<uint64_t>(E)};
  const uint64_t strides[2] = {static_cast<uint64_t>(H) * 2, static_cast<uint64_t>(rows * H * 2)};
  const uint32_t box[3] = {kBK, kBN / 2, 1};
  return bf16_tensor_map(base, 3, dims, strides, box, "fused fc1");
}

}  // namespace

std::string fc1_activation_unsupported(int experts, int64_t H, int64_t F, const ActivationParams& activation) {
  return row_tile_sizes_unsupported("the fused fc1", experts, H, F, activation);
}

void launch_fc1_activation(const Fc1ActivationArgs& a, cudaStream_t stream) {
  const std::string why = fc1_activation_unsupported(a.experts, a.H, a.F, a.activation);
  MOE_CHECK(why.empty(), "fused fc1: ", why);
  if (a.R == 0) return;
  const bool gated = is_gated(a.activation.kind);
  Params p;
  p.a = static_cast<const __nv_bfloat16*>(a.a);
  p.a_out = static_cast<__nv_bfloat16*>(a.a_out);
  p.row_slots = a.row_slots;
  p.slots = a.slots;
  p.offsets = a.group_offsets;
  p.E = a.experts;
  p.R = a.R;
  p.H = a.H;
  p.F = a.F;
  p.feature_tiles = gated ? (a.F + kBN / 2 - 1) / (kBN / 2) : (a.F + kBN - 1) / kBN;
  p.w1_base = static_cast<const __nv_bfloat16*>(a.w1_base);
  p.w1_stride = a.w1_stride_bytes / 2;
  p.w1_table = reinterpret_cast<const __nv_bfloat16* const*>(a.w1_table);
  p.b1_base = static_cast<const __nv_bfloat16*>(a.b1_base);
  p.b1_table = reinterpret_cast<const __nv_bfloat16* const*>(a.b1_table);
  p.probs = a.probs;
  p.interleave = a.activation.glu_interleave;
  p.consts = ActConsts{a.activation.alpha, a.activation.limit, a.activation.offset};
  p.h = static_cast<__nv_bfloat16*>(a.h);
  p.act = static_cast<__nv_bfloat16*>(a.act);
  // TMA weight tiles need one [E, fc1_out, H] tensor and contiguous gate / linear halves.
  const bool tma = a.w1_table == nullptr && (!gated || a.activation.glu_interleave == 0);
  // The tensor map describes contiguous [E, fc1_out, H] weights.
  MOE_CHECK(!tma || a.w1_stride_bytes == (gated ? 2 * int64_t(a.F) : a.F) * a.H * 2,
            "fused fc1: single-grouped fc1 weights must be one contiguous [E, fc1_out, H] tensor");
  const int cluster = tma ? 2 : 1;
  if (tma) {
    p.w1_map = weight_map(a.w1_base, a.experts, gated ? 2 * int64_t(a.F) : a.F, a.H);
  } else {
    std::memset(&p.w1_map, 0, sizeof p.w1_map);
  }
  const int grid = row_tile_grid<kBM>(a.R, a.experts, p.feature_tiles, cluster, a.sm_count);
  switch (a.activation.kind) {
    case Activation::kSwiGLU: launch_kind<Activation::kSwiGLU>(p, tma, grid, stream); break;
    case Activation::kGeGLU: launch_kind<Activation::kGeGLU>(p, tma, grid, stream); break;
    case Activation::kClampedSwiGLU: launch_kind<Activation::kClampedSwiGLU>(p, tma, grid, stream); break;
    case Activation::kSquaredReLU: launch_kind<Activation::kSquaredReLU>(p, tma, grid, stream); break;
  }
}

}  // namespace moe::fused
