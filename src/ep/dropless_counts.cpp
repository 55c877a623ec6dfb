// Host arithmetic of the dropless exchange (see dropless_counts.h).
#include "ep/dropless_counts.h"

#include "moe/error.h"

namespace moe::ep {

namespace {

void prefix(const std::vector<int64_t>& n, std::vector<int64_t>& first, int64_t& total) {
  first.assign(n.size(), 0);
  total = 0;
  for (size_t i = 0; i < n.size(); ++i) {
    first[i] = total;
    total += n[i];
  }
}

}  // namespace

PeerRows peer_rows(const std::vector<int64_t>& send, const std::vector<int64_t>& recv) {
  MOE_CHECK(send.size() == recv.size(), "argument 'recv': expected ", send.size(), " peers, got ", recv.size());
  PeerRows r;
  r.send = send;
  r.recv = recv;
  prefix(r.send, r.send_first, r.send_total);
  prefix(r.recv, r.recv_first, r.recv_total);
  return r;
}

PeerRows peer_rows_of(const int64_t* counts, int P, int rank) {
  MOE_CHECK(rank >= 0 && rank < P, "argument 'rank': expected 0..", P - 1, ", got ", rank);
  std::vector<int64_t> send(P), recv(P);
  for (int p = 0; p < P; ++p) {
    send[p] = counts[int64_t{rank} * P + p];
    recv[p] = counts[int64_t{p} * P + rank];
  }
  return peer_rows(send, recv);
}

void check_counts(const int64_t* counts, int P, int64_t max_send, int64_t max_recv) {
  for (int s = 0; s < P; ++s) {
    int64_t sent = 0;
    for (int d = 0; d < P; ++d) {
      const int64_t n = counts[int64_t{s} * P + d];
      // Each count is bounded before it is added, so that no sum can wrap around and pass.
      MOE_CHECK(n >= 0 && n <= max_send, "EpDispatcher counts exchange: rank ", s, " sends ", n, " rows to rank ",
                d, " (corrupt counts)");
      sent += n;
    }
    MOE_CHECK(sent <= max_send, "EpDispatcher counts exchange: rank ", s, " sends ", sent,
              " rows, more than its T_max * slots = ", max_send, " (corrupt counts)");
  }
  for (int d = 0; d < P; ++d) {
    int64_t received = 0;
    for (int s = 0; s < P; ++s) received += counts[int64_t{s} * P + d];  // each <= max_send: no wrap
    MOE_CHECK(received <= max_recv, "argument 'dropless_max_rows' (config): rank ", d, " would receive ", received,
              " rows in this dispatch, more than dropless_max_rows = ", max_recv,
              "; raise it (its buffers are sized at construction) -- nothing was dropped or moved");
  }
}

LaneSpans lane_spans(const PeerRows& rows, int64_t row_bytes) {
  const size_t P = rows.send.size(), b = static_cast<size_t>(row_bytes);
  LaneSpans l;
  l.send_bytes.resize(P);
  l.send_offsets.resize(P);
  l.recv_bytes.resize(P);
  l.recv_offsets.resize(P);
  for (size_t p = 0; p < P; ++p) {
    l.send_bytes[p] = static_cast<size_t>(rows.send[p]) * b;
    l.send_offsets[p] = static_cast<size_t>(rows.send_first[p]) * b;
    l.recv_bytes[p] = static_cast<size_t>(rows.recv[p]) * b;
    l.recv_offsets[p] = static_cast<size_t>(rows.recv_first[p]) * b;
  }
  return l;
}

LaneSpans reverse(const LaneSpans& l) { return {l.recv_bytes, l.recv_offsets, l.send_bytes, l.send_offsets}; }

}  // namespace moe::ep
