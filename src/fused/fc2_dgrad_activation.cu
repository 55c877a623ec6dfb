// The fused fc2 dgrad + activation backward kernel (fc2_dgrad_activation.h; design in docs/fused.md).
//
// Persistent and warp-specialized, one CTA per SM, 384 threads, in one of two schedules
// (Fc2DgradSchedule): ping-pong, 64-row tiles, or cooperative, 128-row tiles.
//   * warp group 0 (producer) gathers the dY rows of each tile straight from dy through the
//     dispatch map with 16-byte cp.async (gather_rows.cuh), 64 columns (of H) at a time, into a
//     5-stage (ping-pong) or 4-stage (cooperative) ring. The fc2 weight tile -- 64 rows of H x 256
//     features of W2[e], MN-major for the WGMMA -- comes by TMA in four 64 x 64 boxes: two CTAs of a
//     cluster, two row blocks of one expert, each load two boxes and multicast them to both (on an
//     expert's odd last row block, split by feature block, each CTA loads its own four). Per-expert
//     weights (no single tensor for a TMA map) are copied by cp.async instead, each CTA its own.
//   * warp groups 1 and 2 (consumers) run WGMMA 64x256x16 (A K-major, B MN-major) over 64 rows of a
//     tile, then the epilogue from registers -- round dact to bf16, read the saved pre-activation
//     of the same features, write dh over it, sum dact x act for dprobs (a quad of lanes holds a
//     row's 256 features: two shuffles, no atomics), optionally write the recomputed act x prob.
//     The epilogue waits on memory (h in, dh and act out); it keeps the loads of h a few chunks
//     ahead of its arithmetic, so that its 16 chunks do not each wait for a round trip to memory.
//     Ping-pong: the warp groups take the CTA's tiles in turn, so that one's epilogue runs while
//     the other's main loop keeps the tensor cores busy; they read one stage ring in tile order: a
//     warp group skips the stages of the other's tiles, and an order barrier lets it start a main
//     loop only after the other has finished its previous one. That keeps every wait on a stage
//     barrier at most one phase ahead of it (a parity wait two phases ahead would pass on the wrong
//     phase). Cooperative: both take every tile, 64 rows each, so a weight stage serves 128 rows
//     (half the weight bytes per row), and the tensor cores idle through the epilogue.
// Tiles: (expert, cluster of row blocks, feature block of 256) as in the fused fc1 (row_tiles.cuh;
// an odd last row block split by feature block). With more than one feature block, each writes
// its dprobs partial sum and a second kernel adds them in feature-block order (deterministic).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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
#include "fused/async_copy.cuh"
#include "fused/cluster_launch.h"
#include "fused/consumer_loop.cuh"
#include "fused/consumer_turns.cuh"
#include "fused/fc2_dgrad_activation.h"
#include "fused/fragment_pack.cuh"
#include "fused/gather_rows.cuh"
#include "fused/pipeline.cuh"
#include "fused/row_tile_limits.h"
#include "fused/row_tile_schedule.cuh"
#include "fused/row_tiles.cuh"
#include "fused/tensor_map.h"
#include "kernels/activation_math.cuh"
#include "moe/error.h"

namespace moe::fused {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using kernels::ActConsts;
using kernels::ActOp;
using kernels::kVec;

constexpr int kBN = WideRowTiles::kBN, kBK = WideRowTiles::kBK, kCluster = WideRowTiles::kCluster;
constexpr int kProducerThreads = WideRowTiles::kProducerThreads, kGroupThreads = WideRowTiles::kGroupThreads;
constexpr int kConsumerGroups = WideRowTiles::kConsumerGroups, kThreads = WideRowTiles::kThreads;
constexpr int kStageBytesB = WideRowTiles::kStageBytesB;
constexpr int kBoxCols = 64;                               // one TMA box: 64 features (128 bytes) x 64 rows of H
constexpr int kBoxBytes = kBoxCols * kBK * 2;              // 8 KiB
constexpr int kBoxesPerCta = kBN / kBoxCols / kCluster;    // 2
constexpr int kMaxExperts = kMaxRowTileExperts;
// Chunks of h (8 features of a row) a consumer thread has loaded ahead of the one it works on in the
// epilogue: 2 and 4 measured alike, 8 spills.
constexpr int kHAhead = 4;

// The two schedules (row_tile_schedule.cuh): ping-pong or cooperative; B MN-major (W2[e] [H, F]:
// 64 consecutive features of one row of H are 128 contiguous bytes).
template <bool kCoop>
using Schedule = WideRowTileSchedule<kCoop, GMMA::Major::MN>;
template <bool kCoop>
using SharedStorage = WideRowTileStorage<Schedule<kCoop>>;

struct Params {
  CUtensorMap w2_map;  // TMA kernels: fc2 weights as a 3D [E, H, F] tensor (64 x 64 boxes)
  const __nv_bfloat16* const* w2_table;  // cp.async kernels: W2[e] [H, F]
  const __nv_bfloat16* dy;
  __nv_bfloat16* dy_out;
  const int32_t* row_slots;
  int slots;
  const int32_t* offsets;
  int E;
  int64_t R;
  int H, F;
  int feature_tiles;
  const float* probs;
  int interleave;
  ActConsts consts;
  __nv_bfloat16* h;
  __nv_bfloat16* act_out;
  float* dprobs;  // [R] (one feature block) or the partials [feature_tiles, R]; null: none
};

// An expert's odd last row block is split between the cluster's CTAs by feature block
// (row_tiles.cuh): each loads its own weight tile there, and a CTA runs a tile without rows only
// when the feature blocks are odd in number (with one feature block, F <= 256, nothing changes).
template <bool kCoop>
__device__ __forceinline__ RowTile decode_tile(int t, const int32_t* start, const Params& p, int rank) {
  return decode_row_tile<Schedule<kCoop>::kBM, kCluster, true>(t, start, p.offsets, p.E, p.R, p.feature_tiles, rank);
}

// Byte offset of the 16-byte chunk holding features f .. f + 7 of row k of a weight stage: the
// unswizzled position from the layout's plain part, then the 128-byte swizzle on byte addresses
// (bits 4-6 ^= bits 7-9; the stages are 1024-byte aligned).
template <bool kCoop>
__device__ __forceinline__ uint32_t b_chunk_offset(int f, int k) {
  const uint32_t linear = 2u * static_cast<uint32_t>(typename Schedule<kCoop>::SmemLayoutB{}.layout_b()(f, k, 0));
  return linear ^ ((linear >> 3) & 0x70u);
}

// The weight tile by cp.async (per-expert weights): thread copies features f0 + 8 (tid % 32) of
// rows tid / 32 + 4 i of k block kb; zeros past F and H.
template <bool kCoop>
__device__ __forceinline__ void copy_weight_stage(uint32_t dst, const __nv_bfloat16* w, const Params& p, int f0,
                                                  int kb, int tid) {
  const int f = f0 + 8 * (tid & 31);
#pragma unroll
  for (int i = 0; i < kBK / 4; ++i) {
    const int kr = (tid >> 5) + 4 * i;
    const int k = kb * kBK + kr;
    const bool v = f < p.F && k < p.H;
    cp_async_16(dst + b_chunk_offset<kCoop>(8 * (tid & 31), kr), v ? w + (static_cast<int64_t>(k) * p.F + f) : w, v);
  }
}

template <bool kTma, bool kCoop>
__device__ void produce(SharedStorage<kCoop>& s, const Params& p, int total, int rank) {
  using S = Schedule<kCoop>;
  constexpr int kStages = S::kStages, kStageBytesA = S::kStageBytesA;
  const int tid = threadIdx.x;  // 0..127
  const int c = tid & 7, r0 = tid >> 3;
  const uint32_t a_dst = smem_u32(s.a[0]) + swizzled_chunk(r0, c);
  const uint32_t b_dst = smem_u32(s.b);
  const int k_blocks = (p.H + kBK - 1) / kBK;
  RingPosition<kStages> ring;
  ring.phase = 1;  // a fresh barrier counts as released for parity 1
  for (int t = blockIdx.x / kCluster; t < total; t += gridDim.x / kCluster) {
    const RowTile tile = decode_tile<kCoop>(t, s.tile_start, p, rank);
    GatherRows<S::kRows> a_rows;
    gather_source_rows(a_rows, tile, p.row_slots, p.slots, r0, p.dy, p.H);
    const int f0 = tile.nt * kBN;
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase);
      if constexpr (!kTma) {
        copy_weight_stage<kCoop>(b_dst + ring.stage * kStageBytesB, p.w2_table[tile.e], p, f0, kb, tid);
      } else if (tid == 0) {
        // All four boxes land here: ours (boxes 2 rank and 2 rank + 1) and the peer's multicast,
        // or, on an expert's odd last row block (tile.solo, the peer on another feature block),
        // all four loaded by this CTA alone. Features past F and rows past H arrive as zeros.
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage], kStageBytesB);
        constexpr uint64_t kEvictLast = static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST);
        char* stage_b = reinterpret_cast<char*>(s.b) + ring.stage * kStageBytesB;
        if (tile.solo) {
#pragma unroll
          for (int box = 0; box < kBoxesPerCta * kCluster; ++box)
            SM90_TMA_LOAD_3D::copy(&p.w2_map, &s.full[ring.stage], kEvictLast, stage_b + box * kBoxBytes,
                                   f0 + box * kBoxCols, kb * kBK, tile.e);
        } else {
#pragma unroll
          for (int b = 0; b < kBoxesPerCta; ++b) {
            const int box = rank * kBoxesPerCta + b;
            SM90_TMA_LOAD_MULTICAST_3D::copy(&p.w2_map, &s.full[ring.stage], static_cast<uint16_t>((1 << kCluster) - 1),
                                             kEvictLast, stage_b + box * kBoxBytes, f0 + box * kBoxCols, kb * kBK,
                                             tile.e);
          }
        }
      }
      gather_stage(a_dst + ring.stage * kStageBytesA, a_rows, p.H, kb, c);
      // Arrives on full[stage] once this thread's copies have landed.
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
      ring.advance();
    }
  }
  cute::cp_async_wait<0>();
}

template <Activation A, bool kCoop>
__device__ void consume(SharedStorage<kCoop>& s, const Params& p, int total, int rank) {
  using S = Schedule<kCoop>;
  constexpr int kBM = S::kBM;
  constexpr bool kGated = A != Activation::kSquaredReLU;
  const int ctid = threadIdx.x - kProducerThreads;
  const int group = ctid / kGroupThreads, gtid = ctid % kGroupThreads;
  // The threads that share a tile: one warp group (ping-pong) or both (cooperative).
  constexpr int kTileThreads = kCoop ? kConsumerGroups * kGroupThreads : kGroupThreads;
  const int ttid = kCoop ? ctid : gtid;
  const int lane = threadIdx.x & 31;
  typename S::TiledMma mma;
  mma.accumulate_ = GMMA::ScaleOut::One;
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<bf16*>(s.a[0])), typename S::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename S::SmemLayoutB{});
  auto thr = mma.get_thread_slice(ttid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  static_assert(size(decltype(acc){}) == 128, "64x256 per warp group: 128 accumulators per thread");

  const int k_blocks = (p.H + kBK - 1) / kBK;
  const int64_t h_cols = kGated ? 2 * static_cast<int64_t>(p.F) : p.F;
  ConsumerTurns<kCoop, S::kStages> turns(group, k_blocks);
  const int stride = gridDim.x / kCluster;
  for (int turn = turns.first_turn(), t = blockIdx.x / kCluster + turn * stride; t < total;
       turn += turns.kTurnStep, t += turns.kTurnStep * stride) {
    const RowTile tile = decode_tile<kCoop>(t, s.tile_start, p, rank);
    // Cleared here rather than by a zero scale on the first WGMMA: the accumulators are then dead
    // from the end of one tile's epilogue to the next tile's clear, so the epilogue gets their
    // registers (with a zero scale they stay live around the tile loop: the WGMMA reads them).
    clear(acc);
    turns.begin(s.order, turn);
    consume_k_blocks<kCluster>(
        mma, tCrA, tCrB, acc, s.full, s.empty, turns.ring, k_blocks, lane,
        [](int, int) {},
        // While the tensor cores run: the gathered dY rows out to dY_perm, spread over the feature
        // blocks of a row block (each writes every feature_tiles-th k block), as in the fused fc1.
        [&](int stage, int kb) {
          if (p.dy_out != nullptr && kb % p.feature_tiles == tile.nt)
            store_gathered_stage<kTileThreads, kBM>(s.a[stage], p.dy_out, tile, p.H, kb, ttid);
        },
        p.dy_out != nullptr);  // those copies read the stage: each thread releases its own reads
    turns.end(s.order, lane);

    // Epilogue. Accumulator index v0 + 2 v1 + 4 v2 is row r + 8 v1, feature 8 v2 + 2 (lane % 4) + v0;
    // after a quad transpose of packed bf16 pairs each lane holds 8 consecutive features of a row
    // (see the fused fc1), so h, dh and act move as 16-byte vectors. The bf16 packing is the
    // rounding of dact the unfused path stores. A thread works through 16 chunks of 8 features
    // (chunk i: row v1 = i / 8, column block m = i % 8) and loads the saved pre-activation of chunk
    // i + kHAhead before it works on chunk i: dh is written over h, so without the loads in flight
    // ahead each chunk would wait for its own round trip to memory.
    const int j = lane & 3;
    const int r_first = get<0>(coord(0));
    constexpr int kChunksPerRow = kBN / 32, kChunks = 2 * kChunksPerRow;
    bool row_ok[2];
    float prob[2];
    __nv_bfloat16* h_row[2];
    __nv_bfloat16* act_row[2];
#pragma unroll
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = r_first + 8 * v1;
      row_ok[v1] = r < tile.rows;
      const int64_t row = tile.m0 + r;
      prob[v1] = (p.probs != nullptr && row_ok[v1]) ? p.probs[row] : 1.0f;
      h_row[v1] = p.h + row * h_cols;
      act_row[v1] = p.act_out != nullptr ? p.act_out + row * p.F : nullptr;
    }
    const auto chunk_f = [&](int i) { return tile.nt * kBN + 8 * (4 * (i % kChunksPerRow) + j); };
    const auto chunk_ok = [&](int i) { return row_ok[i / kChunksPerRow] && chunk_f(i) < p.F; };
    const auto load_chunk = [&](int i) {
      return chunk_ok(i) ? kernels::load_h_x8<A>(h_row[i / kChunksPerRow], chunk_f(i), p.F, p.interleave)
                         : kernels::HChunk{};
    };
    kernels::HChunk ahead[kHAhead];
#pragma unroll
    for (int i = 0; i < kHAhead; ++i) ahead[i] = load_chunk(i);
    // dact rounded to bf16 pairs and transposed at once (all lanes take part: before any row
    // check), which frees half of the accumulators' registers for the chunks in flight.
    uint32_t dact[kChunks][4];
#pragma unroll
    for (int i = 0; i < kChunks; ++i)
      pack_transpose_pairs(acc, 2 * (i / kChunksPerRow) + 16 * (i % kChunksPerRow), j, dact[i]);
    float dp = 0.0f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int v1 = i / kChunksPerRow, m = i % kChunksPerRow;
      const kernels::HChunk h = ahead[i % kHAhead];
      if (i + kHAhead < kChunks) ahead[i % kHAhead] = load_chunk(i + kHAhead);
      if (chunk_ok(i)) {
        float go[kVec];
        unpack_bf16x8(dact[i], go);
        kernels::activation_backward_x8<A>(h, h_row[v1], chunk_f(i), p.F, p.interleave, p.consts, go, prob[v1], dp,
                                           act_row[v1]);
      }
      if (m == kChunksPerRow - 1) {
        // The row's 256 features live in the 4 lanes of a quad: a fixed two-step sum.
        dp += __shfl_xor_sync(kernels::kFullMask, dp, 1);
        dp += __shfl_xor_sync(kernels::kFullMask, dp, 2);
        if (p.dprobs != nullptr && row_ok[v1] && j == 0)
          p.dprobs[static_cast<int64_t>(tile.nt) * p.R + tile.m0 + r_first + 8 * v1] = dp;
        dp = 0.0f;
      }
    }
  }
}

template <Activation A, bool kTma, bool kCoop>
__global__ void __launch_bounds__(kThreads, 1) fc2_dgrad_activation_kernel(const __grid_constant__ Params p) {
  using S = Schedule<kCoop>;
  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the address bits: the tiles must start 1024-byte aligned.
  SharedStorage<kCoop>& s = *reinterpret_cast<SharedStorage<kCoop>*>(align_smem_1024(smem_raw));
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (warp == 0) {
    prefix_row_tiles<S::kBM, kCluster, true>(s.tile_start, p.offsets, p.E, p.R, p.feature_tiles, lane);
  } else if (warp == 1 && lane == 0) {
    // full: every producer thread's cp.async arrival (+ the TMA issuer's expect-tx arrival);
    // empty: the warps of the consumer warp group that took the stage (ping-pong) or of both
    // (cooperative), in both CTAs of the cluster (their threads when they copy the stages out to
    // dY_perm); order (ping-pong only): the warps of the other consumer warp group.
    for (int g = 0; g < kConsumerGroups; ++g) cutlass::arch::ClusterBarrier::init(&s.order[g], kGroupThreads / 32);
    init_stage_barriers<S::kStages>(s.full, s.empty, kProducerThreads + (kTma ? 1 : 0),
                                    kCluster * stage_releases((kCoop ? kConsumerGroups : 1) * kGroupThreads,
                                                              p.dy_out != nullptr));
  }
  if (kTma && threadIdx.x == 0) cute::prefetch_tma_descriptor(&p.w2_map);
  // The peer's barriers must be initialized before anything arrives on them.
  cute::cluster_sync();
  const int total = s.tile_start[p.E];
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<S::kProducerRegs>();
    produce<kTma, kCoop>(s, p, total, rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<S::kConsumerRegs>();
    consume<A, kCoop>(s, p, total, rank);
  }
  // No CTA may leave while its peer can still multicast into it or arrive on its barriers.
  cute::cluster_sync();
}

// dprobs[r] = sum over feature blocks, in block order, of the partials; rows past the last group
// (never part of a tile) are left alone, as the unfused activation backward leaves them.
__global__ void sum_dprobs_partials_kernel(const float* __restrict__ partial, int blocks, int64_t R,
                                           const int32_t* __restrict__ offsets, int E, float* __restrict__ dprobs) {
  const int64_t rows = kernels::clamped_offset(offsets, E, R);
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows; r += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int b = 0; b < blocks; ++b) sum += partial[b * R + r];
    dprobs[r] = sum;
  }
}

template <bool kCoop>
size_t smem_bytes(int experts) { return wide_row_tile_smem_bytes<Schedule<kCoop>>(experts); }

// fc2 weights [E, H, F] as a TMA tensor: 64-feature x 64-row boxes, 128-byte swizzle (the MN-major
// layout the WGMMA reads), zeros past the edges.
CUtensorMap weight_map(const void* base, int E, int H, int F) {
  const uint64_t dims[3] = {static_cast<uint64_t>(F), static_cast<uint64_t>(H), static_cast<uint64_t>(E)};
  const uint64_t strides[2] = {static_cast<uint64_t>(F) * 2, static_cast<uint64_t>(H) * F * 2};
  const uint32_t box[3] = {kBoxCols, kBK, 1};
  return bf16_tensor_map(base, 3, dims, strides, box, "fused fc2 dgrad");
}

template <Activation A, bool kCoop>
void launch_kernel(const Params& p, bool tma, int sm_count, cudaStream_t stream) {
  const int grid = row_tile_grid<Schedule<kCoop>::kBM>(p.R, p.E, p.feature_tiles, kCluster, sm_count);
  if (tma) {
    launch_clustered(fc2_dgrad_activation_kernel<A, true, kCoop>, p, grid, kThreads, kCluster, smem_bytes<kCoop>(p.E),
                     smem_bytes<kCoop>(kMaxExperts), stream);
  } else {
    launch_clustered(fc2_dgrad_activation_kernel<A, false, kCoop>, p, grid, kThreads, kCluster,
                     smem_bytes<kCoop>(p.E), smem_bytes<kCoop>(kMaxExperts), stream);
  }
}

// The cooperative schedule where the reduction is long: Nsight Compute on the H200 (docs/fused.md),
// H = 4096 and 7168 2.5-7% faster (fewer L2 bytes per row, a higher clock under the power limit);
// H = 1536 and 2048 level or slower (the epilogue, no longer hidden, weighs more against a short
// main loop).
bool cooperative_schedule(const Fc2DgradActivationArgs& a) {
  switch (a.schedule) {
    case Fc2DgradSchedule::kPingPong: return false;
    case Fc2DgradSchedule::kCooperative: return true;
    case Fc2DgradSchedule::kAuto: break;
  }
  return a.H >= 4096;
}

template <Activation A>
void launch_schedule(const Params& p, bool tma, bool coop, int sm_count, cudaStream_t stream) {
  if (coop)
    launch_kernel<A, true>(p, tma, sm_count, stream);
  else
    launch_kernel<A, false>(p, tma, sm_count, stream);
}

}  // namespace

std::string fc2_dgrad_activation_unsupported(int experts, int64_t H, int64_t F, const ActivationParams& activation) {
  return row_tile_sizes_unsupported("the fused fc2 dgrad", experts, H, F, activation);
}

int fc2_dgrad_feature_blocks(int64_t F) { return static_cast<int>((F + kBN - 1) / kBN); }

void launch_fc2_dgrad_activation(const Fc2DgradActivationArgs& a, cudaStream_t stream) {
  const std::string why = fc2_dgrad_activation_unsupported(a.experts, a.H, a.F, a.activation);
  MOE_CHECK(why.empty(), "fused fc2 dgrad: ", why);
  if (a.R == 0) return;
  MOE_CHECK(a.R < (int64_t(1) << 31), "fused fc2 dgrad: needs fewer than 2^31 rows");
  Params p;
  p.dy = static_cast<const __nv_bfloat16*>(a.dy);
  p.dy_out = static_cast<__nv_bfloat16*>(a.dy_out);
  p.row_slots = a.row_slots;
  p.slots = a.slots;
  p.offsets = a.group_offsets;
  p.E = a.experts;
  p.R = a.R;
  p.H = a.H;
  p.F = a.F;
  p.feature_tiles = fc2_dgrad_feature_blocks(a.F);
  p.probs = a.probs;
  p.interleave = a.activation.glu_interleave;
  p.consts = ActConsts{a.activation.alpha, a.activation.limit, a.activation.offset};
  p.h = static_cast<__nv_bfloat16*>(a.h);
  p.act_out = static_cast<__nv_bfloat16*>(a.act_out);
  const bool partials = a.dprobs != nullptr && p.feature_tiles > 1;
  MOE_CHECK(!partials || a.dprobs_partial != nullptr, "fused fc2 dgrad: F > 256 needs the dprobs partial buffer");
  p.dprobs = partials ? a.dprobs_partial : a.dprobs;
  p.w2_table = reinterpret_cast<const __nv_bfloat16* const*>(a.w2_table);
  const bool tma = a.w2_table == nullptr;
  if (tma) {
    p.w2_map = weight_map(a.w2, a.experts, a.H, a.F);
  } else {
    std::memset(&p.w2_map, 0, sizeof p.w2_map);
  }
  const bool coop = cooperative_schedule(a);
  switch (a.activation.kind) {
    case Activation::kSwiGLU: launch_schedule<Activation::kSwiGLU>(p, tma, coop, a.sm_count, stream); break;
    case Activation::kGeGLU: launch_schedule<Activation::kGeGLU>(p, tma, coop, a.sm_count, stream); break;
    case Activation::kClampedSwiGLU: launch_schedule<Activation::kClampedSwiGLU>(p, tma, coop, a.sm_count, stream); break;
    case Activation::kSquaredReLU: launch_schedule<Activation::kSquaredReLU>(p, tma, coop, a.sm_count, stream); break;
  }
  if (partials) {
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>((a.R + threads - 1) / threads, 4 * int64_t(a.sm_count)));
    sum_dprobs_partials_kernel<<<std::max(blocks, 1), threads, 0, stream>>>(a.dprobs_partial, p.feature_tiles, a.R,
                                                                            a.group_offsets, a.experts, a.dprobs);
    MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moe::fused
