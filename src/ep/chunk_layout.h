// The chunk layout of the capacity exchange (docs/expert_parallel.md, Overlapped pipeline), one
// definition for the host (EpDispatcher, tests) and the capacity kernel.
//
// Chunk j (0 <= j < n) carries the rows [begin(j), begin(j + 1)) of every (source, destination)
// pair's capacity block, begin(j) = floor(j * C / n): sizes differ by at most one and none is empty
// when n <= C. The send and receive buffers are chunk-major: chunk j is the contiguous rows
// [P * begin(j), P * begin(j + 1)), holding one block of size(j) rows per peer (destination d's at
// first_row(j) + d * size(j) in the send buffer, source s's at the same place in the receive
// buffer), so one chunk's exchange is one all-to-all of blocks of size(j) rows. With n = 1 this is
// the unchunked layout: d's block at d * C.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_EP_HD __host__ __device__ __forceinline__
#else
#define MOE_EP_HD inline
#endif

namespace moe::ep {

struct ChunkLayout {
  int64_t P = 1;  // ranks
  int64_t C = 0;  // capacity rows per pair
  int n = 1;      // chunks, 1 <= n <= max(C, 1)

  // First row of chunk j inside a pair's block (begin(n) = C).
  MOE_EP_HD int64_t begin(int j) const { return j * C / n; }
  // Rows of chunk j per pair.
  MOE_EP_HD int64_t size(int j) const { return begin(j + 1) - begin(j); }
  // The largest size(j): ceil(C / n).
  MOE_EP_HD int64_t max_size() const { return (C + n - 1) / n; }
  // First buffer row of chunk j; rows of the chunk: P * size(j).
  MOE_EP_HD int64_t first_row(int j) const { return P * begin(j); }
  // The chunk holding row q (0 <= q < C) of a pair's block: the largest j with begin(j) <= q, i.e.
  // j * C < (q + 1) * n.
  MOE_EP_HD int chunk_of(int64_t q) const { return static_cast<int>(((q + 1) * n - 1) / C); }
  // Buffer row of row q of peer d's block (the send row for destination d, or the receive row from
  // source d).
  MOE_EP_HD int64_t row(int64_t d, int64_t q) const {
    const int j = chunk_of(q);
    return first_row(j) + d * size(j) + (q - begin(j));
  }
};

}  // namespace moe::ep
