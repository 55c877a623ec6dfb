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

// The source rows of this producer thread's rows of a tile (-1: zero fill): row
// row_slots[m0 + r] / slots of the source, or row m0 + r itself when row_slots is null. 32-bit
// indices: 64-bit addresses kept across the k loop would need more registers than the producer has.
template <int N>
__device__ __forceinline__ void gather_source_rows(int (&src)[N], const RowTile& tile, const int32_t* row_slots,
                                                   int slots, int r0) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int r = r0 + 16 * i;
    int s = -1;
    if (r < tile.rows) {
      const int64_t row = tile.m0 + r;
      if (row_slots != nullptr) {
        const int slot = row_slots[row];
        if (slot >= 0) s = slot / slots;
      } else {
        s = static_cast<int>(row);
      }
    }
    src[i] = s;
  }
}

// Copies this thread's chunks of k block kb into the stage at shared address `dst` (the thread's
// first chunk): columns kb * 64 + 8 (tid % 8) .. + 7 of its rows; zeros past `cols` or for row -1.
template <int N>
__device__ __forceinline__ void gather_stage(uint32_t dst, const int (&src)[N], const __nv_bfloat16* a, int cols,
                                             int kb, int c) {
  const int k = kb * kGatherCols + c * 8;
  const bool k_in = k < cols;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    int row = src[i];
    asm volatile("" : "+r"(row));  // opaque: no hoisted 64-bit address
    const bool v = row >= 0 && k_in;
    cp_async_16(dst + i * 2048, v ? a + (static_cast<int64_t>(row) * cols + k) : a, v);
  }
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
