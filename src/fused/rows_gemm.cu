// The grouped GEMM over contiguous expert rows (rows_gemm.h; design in docs/gemm.md).
//
// Persistent and warp-specialized, one CTA per SM, clusters of 2, 384 threads -- the fused fc2
// dgrad's skeleton (fc2_dgrad_activation.cu) with the token rows read in place and a plain epilogue:
//   * warp group 0 (producer) copies the A rows of each tile with 16-byte cp.async (the row-tile
//     gather with the identity map: gather_rows.cuh), 64 columns of the reduction at a time, into a
//     5-stage (ping-pong) or 4-stage (cooperative) ring. The weight tile -- 256 output columns x 64
//     of the reduction -- comes by TMA from one [E, ., .] tensor map: two CTAs of a cluster, two row
//     blocks of one expert, each load half of it and multicast it to both (on an expert's odd last
//     row block, split by feature block, each CTA loads the whole tile itself). Fprop form (B_e
//     [out, red]): two 128-row K-major boxes, as the fused fc1's. Dgrad form (B_e [red, out]): four
//     64 x 64 MN-major boxes, as the fused fc2 dgrad's.
//   * warp groups 1 and 2 (consumers) run WGMMA 64x256x16, then round the accumulators to bf16,
//     transpose them inside each quad of lanes (fragment_pack.cuh) and store 16-byte vectors: a
//     warp writes 8 rows x 64 contiguous bytes. Ping-pong: the warp groups take the CTA's tiles in
//     turn (64 rows each), one's epilogue under the other's main loop, in the stage order the fused
//     fc2 dgrad keeps with its order barriers. Cooperative: both take every 128-row tile.
// Tiles: (expert, cluster of row blocks, block of 256 output columns), numbered expert by expert
// (row_tiles.cuh); the per-expert prefix is computed on the device at kernel start, so a captured
// graph replays with new group sizes. Moving to another expert changes a base row and the tensor
// map's expert coordinate, nothing else.
// A third schedule, ping-pong 128x192 (namespace pong192 below), gives each consumer warp group a
// whole 128 x 192 tile and loads both operands by TMA from one producer thread.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include <cuda.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

#include "device/cuda_check.h"
#include "device/device_groups.cuh"
#include "fused/async_copy.cuh"
#include "fused/cluster_launch.h"
#include "fused/consumer_loop.cuh"
#include "fused/consumer_turns.cuh"
#include "fused/fragment_pack.cuh"
#include "fused/gather_rows.cuh"
#include "fused/pipeline.cuh"
#include "fused/row_tile_limits.h"
#include "fused/row_tile_schedule.cuh"
#include "fused/row_tiles.cuh"
#include "fused/rows_gemm.h"
#include "fused/tensor_map.h"
#include "moe/device_errors.h"
#include "moe/error.h"

namespace moe::fused {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

constexpr int kBN = WideRowTiles::kBN, kBK = WideRowTiles::kBK, kCluster = WideRowTiles::kCluster;
constexpr int kProducerThreads = WideRowTiles::kProducerThreads, kGroupThreads = WideRowTiles::kGroupThreads;
constexpr int kConsumerGroups = WideRowTiles::kConsumerGroups, kThreads = WideRowTiles::kThreads;
constexpr int kStageBytesB = WideRowTiles::kStageBytesB;
constexpr int kMaxExperts = kMaxRowTileExperts;
// Fprop form: two boxes of 128 output rows x 64 reduction columns (16 KiB each).
constexpr int kOutRowsPerBox = kBN / 2, kOutMajorBoxBytes = kOutRowsPerBox * kBK * 2;
// Dgrad form: four boxes of 64 output columns (128 bytes) x 64 reduction rows (8 KiB each).
constexpr int kOutColsPerBox = 64, kRedMajorBoxBytes = kOutColsPerBox * kBK * 2;

// kCoop: the schedule (row_tile_schedule.cuh). kOutMajor: B_e stored [out, red] (K-major for the
// WGMMA, the fprop form) or [red, out] (MN-major, the dgrad form).
template <bool kCoop, bool kOutMajor>
using Config = WideRowTileSchedule<kCoop, kOutMajor ? GMMA::Major::K : GMMA::Major::MN>;
template <class C>
using SharedStorage = WideRowTileStorage<C>;

struct Params {
  CUtensorMap b_map;  // the experts' matrices as a 3D tensor (boxes: see weight_map)
  CUtensorMap a_map;  // ping-pong 128x192 only: a as a 2D tensor, 64 x 128 boxes (see rows_map)
  const __nv_bfloat16* a;
  __nv_bfloat16* d;
  const int32_t* offsets;
  const int32_t* a_row_begin;  // windows (rows_gemm.h), or null
  int64_t a_rows;
  uint32_t* error_word;
  int E;
  int64_t R;
  int red, out;
  int feature_tiles;  // blocks of 256 (ping-pong 128x192: 192) output columns
};

// A tile's rows of D (tile.m0, tile.rows) and where its rows of A start.
struct WindowedTile {
  RowTile tile;
  int64_t a_m0;
};

// With windows, expert e's rows of A start at a_row_begin[e], clamped into [0, a_rows], and the rows
// past the end of A are cut from the tile (neither read nor written), as the GEMM prep does.
template <class C>
__device__ __forceinline__ WindowedTile decode_tile(int t, const int32_t* start, const Params& p, int rank) {
  WindowedTile w;
  w.tile = decode_row_tile<C::kBM, kCluster, true>(t, start, p.offsets, p.E, p.R, p.feature_tiles, rank);
  w.a_m0 = w.tile.m0;
  if (p.a_row_begin != nullptr) {
    int64_t begin, end;
    kernels::group_rows(p.offsets, w.tile.e, p.R, &begin, &end);
    const int64_t a_begin = min(max(static_cast<int64_t>(p.a_row_begin[w.tile.e]), int64_t(0)), p.a_rows);
    w.a_m0 = a_begin + (w.tile.m0 - begin);
    const int64_t left = p.a_rows - w.a_m0;
    if (left < w.tile.rows) w.tile.rows = left > 0 ? static_cast<int>(left) : 0;
  }
  return w;
}

// Offsets that are not 0-based, decrease or run past the rows raise kErrBadGroupOffsets (the GEMM
// prep kernel's rule; the tiles use the clamped groups either way). One warp.
__device__ void report_bad_offsets(const Params& p, int lane) {
  for (int e = lane; e < p.E; e += 32) {
    const int32_t lo = p.offsets[e], hi = p.offsets[e + 1];
    if ((e == 0 && lo != 0) || hi < lo || (e == p.E - 1 && hi > p.R)) atomicOr(p.error_word, kErrBadGroupOffsets);
    if (p.a_row_begin != nullptr) {  // a window that had to be clamped to A's rows
      int64_t begin, end;
      kernels::group_rows(p.offsets, e, p.R, &begin, &end);
      const int64_t a_begin = p.a_row_begin[e];
      if (a_begin < 0 || a_begin + (end - begin) > p.a_rows) atomicOr(p.error_word, kErrBadGroupOffsets);
    }
  }
}

// The weight tile of k block kb into `stage_b` (thread 0 of the producer): our half multicast to
// both CTAs of the cluster, or, on an odd last row block (tile.solo), the whole tile for this CTA
// alone. Rows and columns past the matrix arrive as zeros.
template <bool kOutMajor>
__device__ __forceinline__ void load_weight_stage(const Params& p, uint64_t* full, char* stage_b, const RowTile& tile,
                                                  int kb, int rank) {
  constexpr uint64_t kEvictLast = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);
  constexpr uint16_t kBoth = (1 << kCluster) - 1;
  constexpr int kBoxes = kOutMajor ? kBN / kOutRowsPerBox : kBN / kOutColsPerBox;
  constexpr int kBoxBytes = kOutMajor ? kOutMajorBoxBytes : kRedMajorBoxBytes;
  constexpr int kBoxesPerCta = kBoxes / kCluster;
  const int out0 = tile.nt * kBN, red0 = kb * kBK;
  const auto coords = [&](int box, int* c0, int* c1) {
    if constexpr (kOutMajor) *c0 = red0, *c1 = out0 + box * kOutRowsPerBox;
    else *c0 = out0 + box * kOutColsPerBox, *c1 = red0;
  };
  if (tile.solo) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      int c0, c1;
      coords(box, &c0, &c1);
      SM90_TMA_LOAD_3D::copy(&p.b_map, full, kEvictLast, stage_b + box * kBoxBytes, c0, c1, tile.e);
    }
  } else {
#pragma unroll
    for (int b = 0; b < kBoxesPerCta; ++b) {
      const int box = rank * kBoxesPerCta + b;
      int c0, c1;
      coords(box, &c0, &c1);
      SM90_TMA_LOAD_MULTICAST_3D::copy(&p.b_map, full, kBoth, kEvictLast, stage_b + box * kBoxBytes, c0, c1, tile.e);
    }
  }
}

// The epilogue: a warp group's kRows x kCols accumulators (WGMMA 64 x kCols atoms stacked along the
// rows) rounded to bf16 and stored to rows tile.m0 + r of D, r < tile.rows, columns below `out`.
// Accumulator v0 + 2 v1 + 4 v2 + (kCols / 2) mb is row r_first + 8 v1 + 64 mb, column
// 8 v2 + 2 (lane % 4) + v0; after the quad transpose of packed bf16 pairs each lane holds 8
// consecutive columns of a row (the fused fc1's epilogue), stored as one 16-byte vector: a warp
// writes 8 rows x 64 contiguous bytes.
template <int kRows, int kCols, class Acc>
__device__ __forceinline__ void store_tile(const Acc& acc, int r_first, const RowTile& tile, const Params& p,
                                           int lane) {
  const int j = lane & 3;
#pragma unroll
  for (int mb = 0; mb < kRows / 64; ++mb)
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = r_first + 64 * mb + 8 * v1;
      const bool row_ok = r < tile.rows;
      __nv_bfloat16* d_row = p.d + (row_ok ? (tile.m0 + r) * p.out : 0);
#pragma unroll
      for (int m = 0; m < kCols / 32; ++m) {
        uint32_t v[4];
        pack_transpose_pairs(acc, (kCols / 2) * mb + 2 * v1 + 16 * m, j, v);  // all lanes: before the row check
        const int n = tile.nt * kCols + 8 * (4 * m + j);
        if (row_ok && n < p.out) *reinterpret_cast<uint4*>(d_row + n) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
}

template <class C, bool kOutMajor>
__device__ void produce(SharedStorage<C>& s, const Params& p, int total, int rank) {
  constexpr int kStages = C::kStages;
  const int tid = threadIdx.x;  // 0..127
  const int c = tid & 7, r0 = tid >> 3;
  const uint32_t a_dst = smem_u32(s.a[0]) + swizzled_chunk(r0, c);
  const int k_blocks = (p.red + kBK - 1) / kBK;
  RingPosition<kStages> ring;
  ring.phase = 1;  // a fresh barrier counts as released for parity 1
  for (int t = blockIdx.x / kCluster; t < total; t += gridDim.x / kCluster) {
    const WindowedTile w = decode_tile<C>(t, s.tile_start, p, rank);
    const RowTile& tile = w.tile;
    RowTile a_tile = tile;  // the tile's rows of A: the gather with the identity map from a_m0
    a_tile.m0 = w.a_m0;
    GatherRows<C::kRows> a_rows;
    gather_source_rows(a_rows, a_tile, nullptr, 1, r0, p.a, p.red);
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase);
      if (tid == 0) {
        // Both CTAs' boxes land here: this barrier expects the whole tile's bytes.
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage], kStageBytesB);
        load_weight_stage<kOutMajor>(p, &s.full[ring.stage], reinterpret_cast<char*>(s.b) + ring.stage * kStageBytesB,
                                     tile, kb, rank);
      }
      gather_stage(a_dst + ring.stage * C::kStageBytesA, a_rows, p.red, kb, c);
      // Arrives on full[stage] once this thread's copies have landed.
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
      ring.advance();
    }
  }
  cute::cp_async_wait<0>();
}

// The consumer warp groups: each tile's k blocks, then its epilogue from registers. kCoop: both warp
// groups share a C::kBM-row tile (64 rows each); otherwise each takes whole tiles in turn. kTileN:
// the tile's output columns (256, or 192 for the ping-pong 128x192). Smem: the schedule's storage.
template <class C, bool kCoop, int kTileN, class Smem>
__device__ void consume(Smem& s, const Params& p, int total, int rank) {
  constexpr int kBM = C::kBM, kGroupRows = kBM / (kCoop ? 2 : 1);
  const int ctid = threadIdx.x - kProducerThreads;
  const int group = ctid / kGroupThreads, gtid = ctid % kGroupThreads;
  const int ttid = kCoop ? ctid : gtid;  // the thread among those that share a tile
  const int lane = threadIdx.x & 31;
  typename C::TiledMma mma;
  mma.accumulate_ = GMMA::ScaleOut::One;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<bf16*>(s.a[0])), typename C::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename C::SmemLayoutB{});
  auto thr = mma.get_thread_slice(ttid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kTileN>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kTileN>>{}));
  static_assert(size(decltype(acc){}) == kGroupRows * kTileN / kGroupThreads,
                "a warp group's rows x the tile's columns, spread over its threads");

  const int k_blocks = (p.red + kBK - 1) / kBK;
  ConsumerTurns<kCoop, C::kStages> turns(group, k_blocks);  // ping-pong or cooperative (consumer_turns.cuh)
  const int stride = gridDim.x / kCluster;
  for (int turn = turns.first_turn(), t = blockIdx.x / kCluster + turn * stride; t < total;
       turn += turns.kTurnStep, t += turns.kTurnStep * stride) {
    const RowTile tile = decode_tile<C>(t, s.tile_start, p, rank).tile;
    // Cleared here rather than by a zero scale on the first WGMMA, so that the accumulators are dead
    // between one tile's epilogue and the next tile's clear (the epilogue gets their registers).
    clear(acc);
    turns.begin(s.order, turn);
    consume_k_blocks<kCluster>(mma, tCrA, tCrB, acc, s.full, s.empty, turns.ring, k_blocks, lane, [](int, int) {},
                               [](int, int) {}, false);
    turns.end(s.order, lane);

    store_tile<kGroupRows, kTileN>(acc, get<0>(coord(0)), tile, p, lane);
  }
}

template <bool kCoop, bool kOutMajor>
__global__ void __launch_bounds__(kThreads, 1) rows_gemm_kernel(const __grid_constant__ Params p) {
  using C = Config<kCoop, kOutMajor>;
  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the address bits: the tiles must start 1024-byte aligned.
  SharedStorage<C>& s = *reinterpret_cast<SharedStorage<C>*>(align_smem_1024(smem_raw));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp == 0) {
    prefix_row_tiles<C::kBM, kCluster, true>(s.tile_start, p.offsets, p.E, p.R, p.feature_tiles, lane);
    if (blockIdx.x == 0 && p.error_word != nullptr) report_bad_offsets(p, lane);
  } else if (warp == 1 && lane == 0) {
    // full: every producer thread's cp.async arrival + the TMA issuer's expect-tx arrival; empty: the
    // warps of the consumer warp group that took the stage (ping-pong) or of both (cooperative), in
    // both CTAs of the cluster; order (ping-pong only): the warps of the other consumer warp group.
    for (int g = 0; g < kConsumerGroups; ++g) cutlass::arch::ClusterBarrier::init(&s.order[g], kGroupThreads / 32);
    init_stage_barriers<C::kStages>(s.full, s.empty, kProducerThreads + 1,
                                    kCluster * stage_releases((kCoop ? kConsumerGroups : 1) * kGroupThreads, false));
  }
  if (threadIdx.x == 0) cute::prefetch_tma_descriptor(&p.b_map);
  // The peer's barriers must be initialized before anything arrives on them.
  cute::cluster_sync();
  const int total = s.tile_start[p.E];
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegs>();
    produce<C, kOutMajor>(s, p, total, rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegs>();
    consume<C, kCoop, kBN>(s, p, total, rank);
  }
  // No CTA may leave while its peer can still multicast into it or arrive on its barriers.
  cute::cluster_sync();
}

template <class C>
size_t smem_bytes(int experts) { return wide_row_tile_smem_bytes<C>(experts); }

// The experts' matrices as a 3D TMA tensor, 128-byte swizzle (the layouts the WGMMA reads), zeros
// past the edges. Fprop form [E, out, red]: boxes of 64 reduction columns x out_rows_per_box output
// rows (half a weight tile: 128, or 96 for ping-pong 128x192). Dgrad form [E, red, out]: boxes of
// 64 output columns x 64 reduction rows.
CUtensorMap weight_map(const RowsGemmArgs& a, int out_rows_per_box) {
  const uint64_t inner = static_cast<uint64_t>(a.b_out_major ? a.red : a.out);
  const uint64_t outer = static_cast<uint64_t>(a.b_out_major ? a.out : a.red);
  const uint64_t dims[3] = {inner, outer, static_cast<uint64_t>(a.experts)};
  const uint64_t strides[2] = {inner * 2, inner * outer * 2};
  const uint32_t box[3] = {kBK, static_cast<uint32_t>(a.b_out_major ? out_rows_per_box : kBK), 1};
  static_assert(kOutColsPerBox == kBK, "a dgrad-form box is 64 x 64");
  return bf16_tensor_map(a.b, 3, dims, strides, box, "rows GEMM");
}

// a [a_rows, red] as a 2D TMA tensor of 64-column x box_rows boxes, 128-byte swizzle (the K-major
// layout the WGMMA reads), zeros past the last row.
CUtensorMap rows_map(const void* a, int64_t rows, int red, int box_rows) {
  const uint64_t dims[2] = {static_cast<uint64_t>(red), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(red) * 2};
  const uint32_t box[2] = {kBK, static_cast<uint32_t>(box_rows)};
  return bf16_tensor_map(a, 2, dims, strides, box, "rows GEMM");
}

// ---- Ping-pong 128x192: each consumer warp group a whole 128 x 192 tile (SonicMoE's tile for short
// reductions), its epilogue under the other's main loop. 192 accumulators a thread need the 232
// registers the CUTLASS ping-pong kernels give their consumers, which leaves the producer 40: too few
// for the row copies, so the producer is one thread issuing TMA for both operands -- the rows of a
// by one 2D tensor map over all of a (rows past the group are the next expert's, computed and never
// stored; rows past a arrive as zeros), the weight tile as above (fprop form: two 96-row K-major
// boxes; dgrad form: three 64-column MN-major boxes).

namespace pong192 {

constexpr int kBM = 128, kBN = 192, kStages = 5;
constexpr int kStageBytesA = kBM * kBK * 2;  // 16 KiB
constexpr int kStageBytesB = kBN * kBK * 2;  // 24 KiB
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducerThreads * kProducerRegs + kConsumerGroups * kGroupThreads * kConsumerRegs <=
                  kThreads * (65536 / kThreads / 8 * 8),
              "the register split fits the launch pool (168 registers a thread at launch)");
constexpr int kOutRowsPerBox = kBN / 2;  // fprop form: two boxes of 96 output rows (12 KiB each)
constexpr int kOutMajorBoxBytes = kOutRowsPerBox * kBK * 2;

template <bool kOutMajor>
struct Config {
  using bf16 = cutlass::bfloat16_t;
  static constexpr int kBM = pong192::kBM, kStages = pong192::kStages;
  static constexpr GMMA::Major kMajorB = kOutMajor ? GMMA::Major::K : GMMA::Major::MN;
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                             make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
  using SmemLayoutB = std::conditional_t<
      kOutMajor,
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}))),
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}),
                             Step<_2, _1, _3>{}))>;
  static_assert(cosize_v<SmemLayoutB> == kStages * kBN * kBK, "the weight stages are contiguous");
  // One warp group, 128 rows: two 64 x 192 WGMMA atoms along M.
  using TiledMma = decltype(make_tiled_mma(SM90_64x192x16_F32BF16BF16_SS<GMMA::Major::K, kMajorB>{},
                                           Layout<Shape<_1, _1, _1>>{}));
};

template <class C>
struct Storage {
  alignas(1024) uint8_t a[kStages][kStageBytesA];
  alignas(1024) typename C::bf16 b[cosize_v<typename C::SmemLayoutB>];
  alignas(8) uint64_t full[kStages];   // the producer's expect-tx arrival; the stage's boxes landed
  alignas(8) uint64_t empty[kStages];  // consumers of both CTAs: the stage's WGMMAs are done
  alignas(8) uint64_t order[kConsumerGroups];
  int32_t tile_start[kMaxExperts + 1];
};

// The weight tile of k block kb (thread 0): fprop form, our 96-row half multicast to both CTAs;
// dgrad form, 64-column box b loaded by CTA b % 2 and multicast. On an odd last row block (solo)
// the whole tile for this CTA alone.
template <bool kOutMajor>
__device__ __forceinline__ void load_weight_stage(const Params& p, uint64_t* full, char* stage_b, const RowTile& tile,
                                                  int kb, int rank) {
  constexpr uint64_t kEvictLast = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);
  constexpr uint16_t kBoth = (1 << kCluster) - 1;
  constexpr int kBoxes = kOutMajor ? kBN / kOutRowsPerBox : kBN / kOutColsPerBox;  // 2 or 3
  constexpr int kBoxBytes = kOutMajor ? kOutMajorBoxBytes : kRedMajorBoxBytes;
  const int out0 = tile.nt * kBN, red0 = kb * kBK;
#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    const int c0 = kOutMajor ? red0 : out0 + box * kOutColsPerBox;
    const int c1 = kOutMajor ? out0 + box * kOutRowsPerBox : red0;
    if (tile.solo)
      SM90_TMA_LOAD_3D::copy(&p.b_map, full, kEvictLast, stage_b + box * kBoxBytes, c0, c1, tile.e);
    else if (box % kCluster == rank)
      SM90_TMA_LOAD_MULTICAST_3D::copy(&p.b_map, full, kBoth, kEvictLast, stage_b + box * kBoxBytes, c0, c1, tile.e);
  }
}

template <class C, bool kOutMajor>
__device__ void produce(Storage<C>& s, const Params& p, int total, int rank) {
  const int k_blocks = (p.red + kBK - 1) / kBK;
  RingPosition<kStages> ring;
  ring.phase = 1;  // a fresh barrier counts as released for parity 1
  for (int t = blockIdx.x / kCluster; t < total; t += gridDim.x / kCluster) {
    const WindowedTile w = decode_tile<C>(t, s.tile_start, p, rank);
    // The tile's rows of a from a_m0 (int32 TMA coordinates: a has fewer than 2^31 rows).
    const int a_row = static_cast<int>(w.a_m0);
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage],
                                                                     kStageBytesA + kStageBytesB);
      // The rows are read again by the tiles of the row block's other output blocks: normal eviction.
      constexpr uint64_t kEvictNormal = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL);
      SM90_TMA_LOAD_2D::copy(&p.a_map, &s.full[ring.stage], kEvictNormal, s.a[ring.stage], kb * kBK, a_row);
      pong192::load_weight_stage<kOutMajor>(p, &s.full[ring.stage],
                                            reinterpret_cast<char*>(s.b) + ring.stage * kStageBytesB, w.tile, kb, rank);
      ring.advance();
    }
  }
}

template <bool kOutMajor>
__global__ void __launch_bounds__(kThreads, 1) kernel(const __grid_constant__ Params p) {
  using C = Config<kOutMajor>;
  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  extern __shared__ uint8_t smem_raw[];
  Storage<C>& s = *reinterpret_cast<Storage<C>*>(align_smem_1024(smem_raw));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp == 0) {
    prefix_row_tiles<kBM, kCluster, true>(s.tile_start, p.offsets, p.E, p.R, p.feature_tiles, lane);
    if (blockIdx.x == 0 && p.error_word != nullptr) report_bad_offsets(p, lane);
  } else if (warp == 1 && lane == 0) {
    // full: the TMA issuer's expect-tx arrival; empty: the warps of the warp group that took the
    // stage, in both CTAs; order: the warps of the other warp group.
    for (int g = 0; g < kConsumerGroups; ++g) cutlass::arch::ClusterBarrier::init(&s.order[g], kGroupThreads / 32);
    init_stage_barriers<kStages>(s.full, s.empty, 1, kCluster * stage_releases(kGroupThreads, false));
  }
  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(&p.a_map);
    cute::prefetch_tma_descriptor(&p.b_map);
  }
  cute::cluster_sync();
  const int total = s.tile_start[p.E];
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    if (threadIdx.x == 0) pong192::produce<C, kOutMajor>(s, p, total, rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume<C, false, pong192::kBN>(s, p, total, rank);
  }
  cute::cluster_sync();
}

size_t smem_bytes(int experts) {
  return 1024 + offsetof(Storage<Config<true>>, tile_start) + sizeof(int32_t) * (experts + 1);
}
static_assert(sizeof(Storage<Config<true>>) == sizeof(Storage<Config<false>>), "both forms take the same storage");

template <bool kOutMajor>
void launch(const Params& p, int sm_count, cudaStream_t stream) {
  const int grid = row_tile_grid<kBM>(p.R, p.E, p.feature_tiles, kCluster, sm_count);
  launch_clustered(kernel<kOutMajor>, p, grid, kThreads, kCluster, smem_bytes(p.E), smem_bytes(kMaxExperts), stream);
}

}  // namespace pong192

template <bool kCoop, bool kOutMajor>
void launch_kernel(const Params& p, int sm_count, cudaStream_t stream) {
  using C = Config<kCoop, kOutMajor>;
  const int grid = row_tile_grid<C::kBM>(p.R, p.E, p.feature_tiles, kCluster, sm_count);
  launch_clustered(rows_gemm_kernel<kCoop, kOutMajor>, p, grid, kThreads, kCluster, smem_bytes<C>(p.E),
                   smem_bytes<C>(kMaxExperts), stream);
}

template <bool kCoop>
void launch_form(const Params& p, bool out_major, int sm_count, cudaStream_t stream) {
  if (out_major) launch_kernel<kCoop, true>(p, sm_count, stream);
  else launch_kernel<kCoop, false>(p, sm_count, stream);
}

}  // namespace

std::string rows_gemm_unsupported(int experts, int64_t R, int64_t red, int64_t out) {
  if (experts < 1 || experts > kMaxExperts)
    return "the rows GEMM takes 1 to " + std::to_string(kMaxExperts) + " experts";
  if (red < 8 || red % 8 != 0 || out < 8 || out % 8 != 0)
    return "the rows GEMM needs the reduction and the output width to be multiples of 8";
  if (red >= (int64_t(1) << 30) || out >= (int64_t(1) << 30)) return "the rows GEMM needs dimensions below 2^30";
  if (R < 0 || R >= (int64_t(1) << 31)) return "the rows GEMM needs fewer than 2^31 rows";
  return "";
}

void launch_rows_gemm(const RowsGemmArgs& a, cudaStream_t stream) {
  const std::string why = rows_gemm_unsupported(a.experts, a.R, a.red, a.out);
  MOE_CHECK(why.empty(), "rows GEMM: ", why);
  if (a.R == 0) return;
  MOE_CHECK(a.sm_count >= kCluster, "rows GEMM: needs at least ", kCluster, " SMs, got ", a.sm_count);
  MOE_CHECK(a.a_row_begin == nullptr || (a.a_rows >= 0 && a.a_rows < (int64_t(1) << 31)),
            "rows GEMM: windows need an input of fewer than 2^31 rows, got ", a.a_rows);
  // Windows over an input without rows: every tile is cut to nothing (and reported); a TMA map cannot
  // describe zero rows, so the cp.async schedule runs them.
  const bool pong192 = a.schedule == RowsGemmSchedule::kPingPong128x192 && (a.a_row_begin == nullptr || a.a_rows > 0);
  Params p;
  p.b_map = weight_map(a, pong192 ? pong192::kOutRowsPerBox : kOutRowsPerBox);
  p.a = static_cast<const __nv_bfloat16*>(a.a);
  p.d = static_cast<__nv_bfloat16*>(a.d);
  p.offsets = a.group_offsets;
  p.a_row_begin = a.a_row_begin;
  p.a_rows = a.a_row_begin != nullptr ? a.a_rows : a.R;
  p.error_word = a.error_word;
  p.E = a.experts;
  p.R = a.R;
  p.red = a.red;
  p.out = a.out;
  const int bn = pong192 ? pong192::kBN : kBN;
  p.feature_tiles = static_cast<int>((a.out + bn - 1) / bn);
  if (pong192) {
    p.a_map = rows_map(a.a, p.a_rows, a.red, pong192::kBM);
    if (a.b_out_major) pong192::launch<true>(p, a.sm_count, stream);
    else pong192::launch<false>(p, a.sm_count, stream);
    return;
  }
  std::memset(&p.a_map, 0, sizeof p.a_map);
  if (a.schedule == RowsGemmSchedule::kCooperative) launch_form<true>(p, a.b_out_major, a.sm_count, stream);
  else launch_form<false>(p, a.b_out_major, a.sm_count, stream);
}

}  // namespace moe::fused
