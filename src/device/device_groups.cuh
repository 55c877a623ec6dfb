// Expert groups of a permuted [R, N] buffer read from the device group offsets (graph-safe), shared
// by the GEMM prep, activation and bias kernels, and row e of a per-expert parameter in either
// weight layout. Offsets are clamped to [0, R] so that bad offsets (e.g. a dispatch that
// overflowed its row bound, which it reports itself) can never cause an out-of-bounds access.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moe::kernels {

// offsets[i] clamped into [0, R].
__device__ __forceinline__ int64_t clamped_offset(const int32_t* offsets, int i, int64_t R) {
  const int64_t v = offsets[i];
  return v < 0 ? 0 : (v > R ? R : v);
}

// Rows [start, end) of group e, clamped into [0, R]; decreasing offsets give an empty group.
__device__ __forceinline__ void group_rows(const int32_t* offsets, int e, int64_t R, int64_t* start, int64_t* end) {
  const int64_t lo = clamped_offset(offsets, e, R);
  const int64_t hi = clamped_offset(offsets, e + 1, R);
  *start = lo;
  *end = hi > lo ? hi : lo;
}

struct DeviceGroups {
  const int32_t* offsets;  // [E + 1]
  int E;
  int64_t R;

  __device__ __forceinline__ int64_t begin(int e) const { return clamped_offset(offsets, e, R); }
  // Rows at or past this are skipped.
  __device__ __forceinline__ int64_t valid() const { return begin(E); }
  // The e in [0, E) whose rows [begin(e), begin(e + 1)) hold r (r < valid()); E if none (only for
  // non-monotonic, i.e. invalid, offsets).
  __device__ __forceinline__ int expert_of(int64_t r) const {
    int lo = 0, hi = E;
    while (lo < hi) {
      int mid = (lo + hi) / 2;
      if (begin(mid + 1) <= r) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
};

// Row e of a per-expert parameter: one [E, cols] block or a table of E row pointers.
template <typename T>
struct DeviceRows {
  T* stacked;
  T* const* table;
  int64_t cols;
  __device__ __forceinline__ T* row(int e) const { return table != nullptr ? table[e] : stacked + e * cols; }
};

}  // namespace moe::kernels
