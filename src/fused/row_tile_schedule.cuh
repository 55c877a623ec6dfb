// The tiles, stage ring and register split shared by the row-tile kernels whose consumer warp groups
// each hold 64 rows x 256 columns (the fused fc2 dgrad, the rows GEMM), in their two schedules
// (consumer_turns.cuh): ping-pong -- a 64-row tile per warp group, a 5-stage ring -- or cooperative
// -- one 128-row tile for both, a 4-stage ring. Clusters of two CTAs share the weight tile.
// A: K-major, 128-byte swizzled, 64 columns of the reduction a stage (gather_rows.cuh).
// B: the 256-column x 64 weight tile, K-major (256 rows of 128 bytes, as the fused fc1's) or
// MN-major (64 consecutive columns of one reduction row are 128 bytes; the atoms of one 64-column
// box stack along the reduction first, so a box is 8 KiB of contiguous shared memory, exactly what
// one TMA box writes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

#include "fused/gather_rows.cuh"
#include "fused/row_tile_limits.h"

namespace moe::fused {

struct WideRowTiles {
  static constexpr int kBN = 256, kBK = kGatherCols, kCluster = 2;
  static constexpr int kProducerThreads = kGatherThreads, kGroupThreads = 128, kConsumerGroups = 2;
  static constexpr int kThreads = kProducerThreads + kConsumerGroups * kGroupThreads;
  static constexpr int kStageBytesB = kBN * kBK * 2;  // 32 KiB: the whole weight tile lands in every CTA
  static_assert(kBK == 64, "the A stage (gather_rows.cuh) is 64 columns wide");
};

template <bool kCoop, cute::GMMA::Major kMajorB>
struct WideRowTileSchedule : WideRowTiles {
  using bf16 = cutlass::bfloat16_t;
  static constexpr int kBM = kCoop ? 128 : 64;
  static constexpr int kStages = kCoop ? 4 : 5;
  static constexpr int kRows = rows_per_thread(kBM);  // rows of a tile one producer thread copies
  static constexpr int kStageBytesA = kBM * kBK * 2;  // 8 or 16 KiB
  // Registers a producer / consumer thread keeps of the launch pool (128 * P + 256 * C <= 384 * 168):
  // ping-pong 56 / 224; the cooperative producer copies twice the rows a stage and at 56 spilled
  // (ptxas: 20 bytes of stores), at 72 it does not.
  static constexpr int kProducerRegs = kCoop ? 72 : 56, kConsumerRegs = kCoop ? 216 : 224;
  static_assert(kProducerThreads * kProducerRegs + kConsumerGroups * kGroupThreads * kConsumerRegs <=
                    kThreads * (65536 / kThreads / 8 * 8),
                "the register split fits the launch pool (168 registers a thread at launch)");
  using SmemLayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<bf16>{},
                                                   cute::make_shape(cute::Int<kBM>{}, cute::Int<kBK>{},
                                                                    cute::Int<kStages>{})));
  using SmemLayoutB = std::conditional_t<
      kMajorB == cute::GMMA::Major::K,
      decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<bf16>{},
                                   cute::make_shape(cute::Int<kBN>{}, cute::Int<kBK>{}, cute::Int<kStages>{}))),
      decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<bf16>{},
                                   cute::make_shape(cute::Int<kBN>{}, cute::Int<kBK>{}, cute::Int<kStages>{}),
                                   cute::Step<cute::_2, cute::_1, cute::_3>{}))>;
  static_assert(cute::cosize_v<SmemLayoutB> == kStages * kBN * kBK, "the weight stages are contiguous");
  // One warp group per tile (ping-pong) or both along the tile's rows (cooperative).
  using TiledMma = decltype(cute::make_tiled_mma(cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, kMajorB>{},
                                                 cute::Layout<cute::Shape<cute::Int<kCoop ? 2 : 1>, cute::_1, cute::_1>>{}));
};

template <class S>
struct WideRowTileStorage {
  alignas(1024) uint8_t a[S::kStages][S::kStageBytesA];
  alignas(1024) typename S::bf16 b[cute::cosize_v<typename S::SmemLayoutB>];
  alignas(8) uint64_t full[S::kStages];   // producer -> consumers: the stage's copies and boxes landed
  alignas(8) uint64_t empty[S::kStages];  // consumers of both CTAs -> producer: the stage's WGMMAs are done
  alignas(8) uint64_t order[S::kConsumerGroups];  // ping-pong: consumer warp group g may start its next main loop
  int32_t tile_start[kMaxRowTileExperts + 1];     // only E + 1 entries are used (and allocated)
};

// Dynamic shared memory of a launch for `experts` experts (1024 bytes of alignment slack).
template <class S>
size_t wide_row_tile_smem_bytes(int experts) {
  return 1024 + offsetof(WideRowTileStorage<S>, tile_start) + sizeof(int32_t) * (experts + 1);
}

}  // namespace moe::fused
