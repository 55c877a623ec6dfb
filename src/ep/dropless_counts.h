// The host arithmetic of the dropless mode (docs/expert_parallel.md, Dropless mode): from the P x P
// count matrix every rank receives in the counts exchange (counts[s * P + d] = rows source s sends
// to destination d), one rank's per-peer row counts and where each peer's block sits in its send
// and receive buffers (both packed back to back in rank order), the check of those counts against
// the buffers sized at construction, and the byte spans of one exchange lane. Host only; tested in
// tests/cpu/test_expert_parallel_host.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::ep {

// One rank's part of a dropless exchange, in rows.
struct PeerRows {
  std::vector<int64_t> send, send_first;  // [P] rows to destination d, and the first send row of its block
  std::vector<int64_t> recv, recv_first;  // [P] rows from source s, and the first receive row of its block
  int64_t send_total = 0, recv_total = 0;
};

// The block starts are the exclusive prefix sums of the counts (peer d's block at the sum of the
// counts of the peers before it).
PeerRows peer_rows(const std::vector<int64_t>& send, const std::vector<int64_t>& recv);

// `rank`'s row and column of the count matrix.
PeerRows peer_rows_of(const int64_t* counts, int P, int rank);

// Every rank checks the whole matrix, so every rank reaches the same verdict and none is left
// waiting in a collective: throws moe::Error naming 'dropless_max_rows' (the rank and its rows)
// when a rank would receive more than max_recv rows, and one naming the counts exchange when an
// entry is negative or a source's total exceeds max_send (a corrupt exchange, never a routing).
void check_counts(const int64_t* counts, int P, int64_t max_send, int64_t max_recv);

// The byte spans of one lane (`row_bytes` per row) of a peer-rows layout, for EpVarExchange:
// send_bytes[d] = send[d] * row_bytes at send_first[d] * row_bytes, and likewise for recv.
struct LaneSpans {
  std::vector<size_t> send_bytes, send_offsets, recv_bytes, recv_offsets;  // [P]
};
LaneSpans lane_spans(const PeerRows& rows, int64_t row_bytes);
// The same lane in the opposite direction (the combine's and the dispatch backward's return:
// receive layout -> send layout).
LaneSpans reverse(const LaneSpans& l);

}  // namespace moe::ep
