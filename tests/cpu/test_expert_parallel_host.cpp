// Host-side parts of expert parallelism that need no GPU: the EpDispatcher's configuration checks
// (every bad field named before any device work), and the in-process group's collective protocol
// (a host barrier per all_to_all; a mismatched call or an abort wakes every waiting rank with an
// error instead of a hang). Exchanges of zero-byte blocks enqueue no copies, so they run here.
// The chunk layout of the overlapped pipeline (src/ep/chunk_layout.h): the host arithmetic the
// dispatcher and the capacity kernel share. The dropless mode's host arithmetic
// (src/ep/dropless_counts.h: per-peer rows and block starts from the count matrix, the checks of
// the matrix, the byte spans of an exchange lane) and the in-process variable-size all-to-all's
// protocol.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ep/chunk_layout.h"
#include "ep/dropless_counts.h"
#include "moe/error.h"
#include "moe/expert_parallel.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using ::moe::testing::expect_error_naming;

EpDispatcherConfig good_config() {
  EpDispatcherConfig c;
  c.ranks = 2;
  c.local_experts = 2;
  c.hidden = 64;
  c.topk = 2;
  c.capacity = 8;
  c.max_tokens = 16;
  return c;
}

TEST(ExpertParallelHost, ConfigurationErrorsNameTheField) {
  InProcessGroup group(2);
  auto bad = [&](const std::function<void(EpDispatcherConfig&)>& edit, const std::string& name) {
    EpDispatcherConfig c = good_config();
    edit(c);
    expect_error_naming([&] { EpDispatcher ep(c, group.endpoint(0)); }, name);
  };
  bad([](EpDispatcherConfig& c) { c.ranks = 0; }, "'ranks'");
  bad([](EpDispatcherConfig& c) { c.ranks = 4; }, "'transport'");
  bad([](EpDispatcherConfig& c) { c.local_experts = 0; }, "'local_experts'");
  bad([](EpDispatcherConfig& c) { c.row_dtype = DType::kFP8E4M3; }, "'row_dtype'");
  bad([](EpDispatcherConfig& c) { c.hidden = 3; }, "'hidden'");
  bad([](EpDispatcherConfig& c) { c.topk = 0; }, "'topk'");
  bad([](EpDispatcherConfig& c) { c.align = 5; }, "'align'");
  bad([](EpDispatcherConfig& c) { c.capacity = -1; }, "'capacity'");
  bad([](EpDispatcherConfig& c) { c.max_tokens = -1; }, "'max_tokens'");
  bad([](EpDispatcherConfig& c) { c.row_bound = -2; }, "'row_bound'");
  bad([](EpDispatcherConfig& c) { c.chunks = 0; }, "'chunks'");
  bad([](EpDispatcherConfig& c) { c.chunks = 9; }, "'chunks'");  // more chunks than capacity rows (8)
  bad([](EpDispatcherConfig& c) { c.capacity = 100, c.chunks = 65; }, "'chunks'");
  bad([](EpDispatcherConfig& c) { c.capacity = 0, c.chunks = 2; }, "'chunks'");
  bad([](EpDispatcherConfig& c) { c.mode = static_cast<EpMode>(7); }, "'mode'");
  // Dropless mode: capacity is unused (any value >= 0 passes these checks), chunks must be 1.
  auto dropless = [](EpDispatcherConfig& c) { c.mode = EpMode::kDroplessEager; };
  bad([&](EpDispatcherConfig& c) { dropless(c), c.chunks = 2; }, "'chunks'");
  bad([&](EpDispatcherConfig& c) { dropless(c), c.capacity = 100, c.chunks = 4; }, "'chunks'");
  bad([&](EpDispatcherConfig& c) { dropless(c), c.dropless_max_rows = -2; }, "'dropless_max_rows'");
  bad([&](EpDispatcherConfig& c) { dropless(c), c.dropless_max_rows = int64_t{1} << 31; }, "'dropless_max_rows'");
  // The default bound P * T_max * min(k, E_local) past int32 (T_max * k within it): named too.
  bad([&](EpDispatcherConfig& c) { dropless(c), c.max_tokens = int64_t{1} << 28; }, "'dropless_max_rows'");
  // T_max * slots past int32, and products that would wrap around to a small size (2^62 tokens,
  // 2^62 rows per pair): refused before any buffer is sized from them.
  bad([&](EpDispatcherConfig& c) { dropless(c), c.max_tokens = int64_t{1} << 29; }, "'max_tokens'");
  bad([&](EpDispatcherConfig& c) { dropless(c), c.max_tokens = int64_t{1} << 62; }, "'max_tokens'");
  bad([](EpDispatcherConfig& c) { c.max_tokens = int64_t{1} << 62; }, "'max_tokens'");
  bad([](EpDispatcherConfig& c) { c.capacity = int64_t{1} << 62; }, "'capacity'");
  bad([](EpDispatcherConfig& c) { c.hidden = (int64_t{1} << 62) + 8; }, "'hidden'");
  expect_error_naming([] { InProcessGroup g(0); }, "'ranks'");
  expect_error_naming([&] { group.endpoint(2); }, "'rank'");
  expect_error_naming([&] { group.endpoint(0).all_to_all_counts(nullptr, nullptr, nullptr); }, "'send'");
#if MOE_HAVE_NCCL
  expect_error_naming([] { NcclTransport t(nullptr); }, "'comm'");
#else
  EXPECT_THROW(NcclTransport t(nullptr), Error);
#endif
}

// fn(rank) on P threads; returns how many threw.
int run_threads(int P, const std::function<void(int)>& fn) {
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < P; ++p)
    threads.emplace_back([&, p] {
      try {
        fn(p);
      } catch (const Error&) {
        ++failures;
      }
    });
  for (auto& t : threads) t.join();
  return failures.load();
}

TEST(ExpertParallelHost, InProcessAllToAllIsACollectivePerCall) {
  for (int P : {1, 2, 4, 8}) {
    InProcessGroup group(P);
    std::atomic<int> done{0};
    const int failures = run_threads(P, [&](int p) {
      const EpExchange x{nullptr, nullptr, 0};
      for (int round = 0; round < 50; ++round) group.endpoint(p).all_to_all(&x, 1, nullptr);
      ++done;
    });
    EXPECT_EQ(failures, 0) << "P = " << P;
    EXPECT_EQ(done.load(), P);
    EXPECT_FALSE(group.aborted());
  }
}

TEST(ExpertParallelHost, MismatchedCallsFailOnEveryRank) {
  InProcessGroup group(4);
  const int failures = run_threads(4, [&](int p) {
    const EpExchange x[2] = {{nullptr, nullptr, 0}, {nullptr, nullptr, 0}};
    group.endpoint(p).all_to_all(x, p == 3 ? 2 : 1, nullptr);  // rank 3 makes another call
  });
  EXPECT_EQ(failures, 4);
  EXPECT_TRUE(group.aborted());
}

TEST(ExpertParallelHost, AbortWakesWaitingRanks) {
  InProcessGroup group(3);
  const int failures = run_threads(3, [&](int p) {
    if (p == 2) {  // a rank that fails before its collective
      group.abort();
      throw Error("rank 2 failed");
    }
    const EpExchange x{nullptr, nullptr, 0};
    group.endpoint(p).all_to_all(&x, 1, nullptr);
  });
  EXPECT_EQ(failures, 3);
}

// Variable-size exchanges of zero bytes enqueue nothing: the barrier protocol runs here.
TEST(ExpertParallelHost, InProcessAllToAllVIsACollectivePerCall) {
  for (int P : {1, 2, 4, 8}) {
    InProcessGroup group(P);
    const std::vector<size_t> zeros(P, 0);
    const int failures = run_threads(P, [&](int p) {
      const EpVarExchange x{nullptr, nullptr, zeros.data(), zeros.data(), zeros.data(), zeros.data()};
      for (int round = 0; round < 20; ++round) {
        group.endpoint(p).all_to_all_v(&x, 1, nullptr);
        const EpExchange f{nullptr, nullptr, 0};
        group.endpoint(p).all_to_all(&f, 1, nullptr);  // the two kinds interleave
      }
    });
    EXPECT_EQ(failures, 0) << "P = " << P;
    EXPECT_FALSE(group.aborted());
  }
}

// Sizes of a pair that disagree between its two ranks, or one rank calling the other kind of
// all-to-all: every rank fails, before any copy is enqueued (the pointers are never used).
TEST(ExpertParallelHost, InProcessAllToAllVMismatchFailsEveryRank) {
  {
    InProcessGroup group(2);
    char dummy[64];
    const int failures = run_threads(2, [&](int p) {
      // Rank 0 sends 16 bytes to rank 1, which expects 0.
      const size_t send[2] = {0, p == 0 ? size_t{16} : size_t{0}}, zero[2] = {0, 0};
      const EpVarExchange x{dummy, dummy + 32, send, zero, zero, zero};
      group.endpoint(p).all_to_all_v(&x, 1, nullptr);
    });
    EXPECT_EQ(failures, 2);
    EXPECT_TRUE(group.aborted());
  }
  {
    InProcessGroup group(3);
    const size_t zero[3] = {0, 0, 0};
    const int failures = run_threads(3, [&](int p) {
      if (p == 1) {
        const EpExchange f{nullptr, nullptr, 0};
        group.endpoint(p).all_to_all(&f, 1, nullptr);
      } else {
        const EpVarExchange x{nullptr, nullptr, zero, zero, zero, zero};
        group.endpoint(p).all_to_all_v(&x, 1, nullptr);
      }
    });
    EXPECT_EQ(failures, 3);
  }
  InProcessGroup group(2);
  const size_t some[2] = {0, 8}, zero[2] = {0, 0};
  expect_error_naming([&] {
    const EpVarExchange x{nullptr, nullptr, some, zero, zero, zero};  // 8 bytes to send, no send pointer
    group.endpoint(0).all_to_all_v(&x, 1, nullptr);
  }, "'exchanges[0].send'");
  expect_error_naming([&] {
    const EpVarExchange x{nullptr, nullptr, zero, nullptr, zero, zero};
    group.endpoint(0).all_to_all_v(&x, 1, nullptr);
  }, "'exchanges[0]'");
  EXPECT_FALSE(group.aborted());  // argument errors are raised before the barrier
}

// A 3-rank count matrix worked by hand: each rank's row (what it sends) and column (what it
// receives), block starts as exclusive prefix sums, the byte spans of a lane and their reverse.
TEST(ExpertParallelHost, DroplessPeerRowsFromTheCountMatrix) {
  // counts[s * 3 + d]: rows s sends to d.
  const std::vector<int64_t> M = {2, 0, 5,   //
                                  1, 3, 0,   //
                                  0, 0, 4};
  const ep::PeerRows r1 = ep::peer_rows_of(M.data(), 3, 1);
  EXPECT_EQ(r1.send, (std::vector<int64_t>{1, 3, 0}));
  EXPECT_EQ(r1.send_first, (std::vector<int64_t>{0, 1, 4}));
  EXPECT_EQ(r1.send_total, 4);
  EXPECT_EQ(r1.recv, (std::vector<int64_t>{0, 3, 0}));
  EXPECT_EQ(r1.recv_first, (std::vector<int64_t>{0, 0, 3}));
  EXPECT_EQ(r1.recv_total, 3);
  const ep::PeerRows r2 = ep::peer_rows_of(M.data(), 3, 2);
  EXPECT_EQ(r2.recv, (std::vector<int64_t>{5, 0, 4}));
  EXPECT_EQ(r2.recv_first, (std::vector<int64_t>{0, 5, 5}));
  EXPECT_EQ(r2.recv_total, 9);
  EXPECT_EQ(r2.send_total, 4);
  const ep::LaneSpans l = ep::lane_spans(r2, 6);
  EXPECT_EQ(l.send_bytes, (std::vector<size_t>{0, 0, 24}));
  EXPECT_EQ(l.send_offsets, (std::vector<size_t>{0, 0, 0}));
  EXPECT_EQ(l.recv_bytes, (std::vector<size_t>{30, 0, 24}));
  EXPECT_EQ(l.recv_offsets, (std::vector<size_t>{0, 30, 30}));
  const ep::LaneSpans b = ep::reverse(l);
  EXPECT_EQ(b.send_bytes, l.recv_bytes);
  EXPECT_EQ(b.send_offsets, l.recv_offsets);
  EXPECT_EQ(b.recv_bytes, l.send_bytes);
  EXPECT_EQ(b.recv_offsets, l.send_offsets);
  expect_error_naming([&] { ep::peer_rows_of(M.data(), 3, 3); }, "'rank'");
  expect_error_naming([] { ep::peer_rows({1, 2}, {1}); }, "'recv'");
}

// Every rank's spans over every pair agree (what rank s sends to d is what d expects from s, at
// blocks that tile both buffers), for random matrices; the totals are the row and column sums.
TEST(ExpertParallelHost, DroplessSpansOfAllRanksAgree) {
  uint64_t z = 12345;
  auto next = [&] { return (z = z * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
  for (int P : {1, 2, 3, 8}) {
    for (int round = 0; round < 20; ++round) {
      std::vector<int64_t> M(static_cast<size_t>(P) * P);
      for (auto& v : M) v = next() % 4 == 0 ? 0 : static_cast<int64_t>(next() % 50);
      std::vector<ep::LaneSpans> spans;
      for (int p = 0; p < P; ++p) spans.push_back(ep::lane_spans(ep::peer_rows_of(M.data(), P, p), 4));
      for (int s = 0; s < P; ++s) {
        size_t end_send = 0, end_recv = 0;
        int64_t row = 0, col = 0;
        for (int d = 0; d < P; ++d) {
          ASSERT_EQ(spans[s].send_bytes[d], spans[d].recv_bytes[s]) << "P " << P << " s " << s << " d " << d;
          EXPECT_EQ(spans[s].send_offsets[d], end_send);  // blocks back to back, in rank order
          EXPECT_EQ(spans[s].recv_offsets[d], end_recv);
          end_send += spans[s].send_bytes[d];
          end_recv += spans[s].recv_bytes[d];
          row += M[s * P + d];
          col += M[d * P + s];
        }
        const ep::PeerRows r = ep::peer_rows_of(M.data(), P, s);
        EXPECT_EQ(r.send_total, row);
        EXPECT_EQ(r.recv_total, col);
        EXPECT_EQ(end_send, static_cast<size_t>(row) * 4);
        EXPECT_EQ(end_recv, static_cast<size_t>(col) * 4);
      }
    }
  }
}

// The bound check sees the whole matrix: the column sums against dropless_max_rows (error naming
// it and the rank), the row sums against the send bound and negative entries (a corrupt exchange).
TEST(ExpertParallelHost, DroplessCountChecks) {
  const std::vector<int64_t> M = {2, 0, 5,   //
                                  1, 3, 0,   //
                                  0, 0, 4};  // columns 3, 3, 9; rows 7, 4, 4
  EXPECT_NO_THROW(ep::check_counts(M.data(), 3, 7, 9));
  expect_error_naming([&] { ep::check_counts(M.data(), 3, 7, 8); }, "'dropless_max_rows'");
  expect_error_naming([&] { ep::check_counts(M.data(), 3, 7, 8); }, "rank 2 would receive 9 rows");
  expect_error_naming([&] { ep::check_counts(M.data(), 3, 6, 9); }, "rank 0 sends 7 rows");
  std::vector<int64_t> neg = M;
  neg[4] = -1;
  expect_error_naming([&] { ep::check_counts(neg.data(), 3, 7, 9); }, "corrupt");
  // Counts whose sums wrap around int64 (four of 2^62: each row sums to 2^63, i.e. negative) are each
  // refused, not summed into a small total that passes.
  const std::vector<int64_t> huge(4, int64_t{1} << 62);
  expect_error_naming([&] { ep::check_counts(huge.data(), 2, 1000, 1000); }, "corrupt");
  const int64_t none[1] = {0};
  EXPECT_NO_THROW(ep::check_counts(none, 1, 0, 0));
}

// Every (P, C, n): chunk j is the rows [floor(j C / n), floor((j + 1) C / n)) of each pair's block,
// sizes differ by at most one and none is empty; chunk_of inverts begin; row(d, q) is a bijection
// onto [0, P * C) that puts chunk j at the contiguous rows [P * begin(j), P * begin(j + 1)), peer
// d's part of it at first_row(j) + d * size(j) in q order; one chunk is the unchunked layout.
TEST(ExpertParallelHost, ChunkLayoutIsAChunkMajorPermutationOfTheCapacityBlocks) {
  for (int64_t P : {1, 2, 3, 8})
    for (int64_t C : {1, 2, 5, 13, 16, 45, 64, 1000})
      for (int n : {1, 2, 3, 4, 7, 8, 16, 64}) {
        if (n > C) continue;
        SCOPED_TRACE("P " + std::to_string(P) + " C " + std::to_string(C) + " n " + std::to_string(n));
        const ep::ChunkLayout L{P, C, n};
        ASSERT_EQ(L.begin(0), 0);
        ASSERT_EQ(L.begin(n), C);
        int64_t lo = C, hi = 0;
        for (int j = 0; j < n; ++j) {
          lo = std::min(lo, L.size(j));
          hi = std::max(hi, L.size(j));
          EXPECT_EQ(L.first_row(j), P * L.begin(j));
        }
        EXPECT_GE(lo, 1);
        EXPECT_LE(hi - lo, 1);
        EXPECT_EQ(hi, L.max_size());
        std::vector<int> seen(static_cast<size_t>(P * C), 0);
        for (int64_t d = 0; d < P; ++d)
          for (int64_t q = 0; q < C; ++q) {
            const int j = L.chunk_of(q);
            ASSERT_TRUE(j >= 0 && j < n) << "q " << q;
            ASSERT_TRUE(L.begin(j) <= q && q < L.begin(j + 1)) << "q " << q << " chunk " << j;
            const int64_t r = L.row(d, q);
            ASSERT_EQ(r, L.first_row(j) + d * L.size(j) + (q - L.begin(j))) << "d " << d << " q " << q;
            ASSERT_TRUE(r >= L.first_row(j) && r < L.first_row(j) + P * L.size(j)) << "d " << d << " q " << q;
            ++seen[static_cast<size_t>(r)];
            if (n == 1) EXPECT_EQ(r, d * C + q);
          }
        EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int v) { return v == 1; })) << "not a bijection";
      }
  // The balanced split, worked by hand: C = 45 in 4 chunks is 11, 11, 11, 12 rows per pair.
  const ep::ChunkLayout L{2, 45, 4};
  EXPECT_EQ((std::vector<int64_t>{L.size(0), L.size(1), L.size(2), L.size(3)}), (std::vector<int64_t>{11, 11, 11, 12}));
  EXPECT_EQ(L.row(1, 0), 11);   // chunk 0, peer 1's first row
  EXPECT_EQ(L.row(0, 11), 22);  // chunk 1 starts at 2 * 11
  EXPECT_EQ(L.row(1, 44), 89);  // the last row of the buffer
}

}  // namespace
}  // namespace moe
