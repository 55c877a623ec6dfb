// The gathering A operand of the fused row-tile GEMMs (fused fc1, fused fc2 dgrad): 128 (or 64) rows
// x 64 columns per stage, K-major with the 128-byte swizzle WGMMA reads, copied by the 128 producer
// threads with 16-byte cp.async straight from the token-major source through the dispatch row map
// (TMA tiles cannot gather rows). Padding rows and rows past the tile are zero-filled, never read.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "fused/async_copy.cuh"
#include "fused/row_tiles.cuh"

namespace moe::fused {

constexpr int kGatherRows = 128, kGatherCols = 64;  // one stage: 128 rows x 64 columns (128 bytes)
constexpr int kGatherThreads = 128;                 // the producer warp group
// Thread copies chunk tid % 8 of rows tid / 8 + 16 i of a stage of `rows` rows.
constexpr int rows_per_thread(int rows) { return rows / (kGatherThreads / 8); }
constexpr int kRowsPerThread = rows_per_thread(kGatherRows);

// Byte offset of 16-byte chunk c of row r in a 128-byte swizzled K-major tile: one 64-column row is
// 128 bytes, eight rows make a 1024-byte swizzle atom and the atoms stack along the rows.
__host__ __device__ constexpr uint32_t swizzled_chunk(int r, int c) {
  return static_cast<uint32_t>((r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4));
}

// This producer thread's rows of a tile, resolved once per tile: each row's start address in the
// source and a copy size (16, or 0 for a zero-filled padding row or row past the tile, whose address
// is then the source's row 0). A k block then costs an add and a copy per row; rebuilding each
// row's 64-bit address from its index every k block kept the copies behind the consumers.
template <int N>
struct GatherRows {
  const char* src[N];
  uint32_t bytes[N];
};

// Source row row_slots[m0 + r] / slots (or row m0 + r itself when row_slots is null) of rows
// r = r0 + 16 i of the tile.
template <int N>
__device__ __forceinline__ void gather_source_rows(GatherRows<N>& g, const RowTile& tile, const int32_t* row_slots,
                                                   int slots, int r0, const __nv_bfloat16* a, int cols) {
  // All N map loads are issued before any is used: loads behind per-row branches went out one
  // at a time, N L2 round trips at every tile start.
  int64_t src[N];
  if (row_slots != nullptr) {
    int slot[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = r0 + 16 * i;
      slot[i] = r < tile.rows ? __ldg(row_slots + tile.m0 + r) : -1;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) src[i] = slot[i] >= 0 ? slot[i] / slots : -1;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int r = r0 + 16 * i;
      src[i] = r < tile.rows ? tile.m0 + r : -1;
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    g.bytes[i] = src[i] >= 0 ? 16u : 0u;
    g.src[i] = reinterpret_cast<const char*>(a + (src[i] >= 0 ? src[i] * cols : 0));
  }
}

// Copies this thread's chunks of k block kb into the stage at shared address `dst` (the thread's
// first chunk): columns kb * 64 + 8 c .. + 7 of its rows; zeros past `cols` or for a zero-size row.
template <int N>
__device__ __forceinline__ void gather_stage(uint32_t dst, const GatherRows<N>& g, int cols, int kb, int c) {
  const int k = kb * kGatherCols + c * 8;
  const bool k_in = k < cols;
  // Past `cols` the copies read nothing and keep the row's start address (in bounds).
  const int64_t step = k_in ? 2 * static_cast<int64_t>(k) : 0;
  const uint32_t keep = k_in ? 0xffffffffu : 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) cp_async_16_bytes(dst + i * 2048, g.src[i] + step, g.bytes[i] & keep);
}

// Writes a landed stage of kRows rows (the gathered rows, zeros on padding rows) to rows
// m0 .. m0 + rows of the row-major [R, cols] `out`: each of the `kThreads` consumer threads moves its
// 16-byte chunks.
template <int kThreads, int kRows = kGatherRows>
__device__ __forceinline__ void store_gathered_stage(const uint8_t* stage, __nv_bfloat16* out, const RowTile& tile,
                                                     int cols, int kb, int ctid) {
  const int c = ctid & 7;
  const int k = kb * kGatherCols + c * 8;
  if (k >= cols) return;
#pragma unroll
  for (int i = 0; i < kRows * 8 / kThreads; ++i) {
    const int r = (ctid >> 3) + i * (kThreads / 8);
    if (r >= tile.rows) break;
    const uint4 v = *reinterpret_cast<const uint4*>(stage + swizzled_chunk(r, c));
    *reinterpret_cast<uint4*>(out + (tile.m0 + r) * cols + k) = v;
  }
}

}  // namespace moe::fused
