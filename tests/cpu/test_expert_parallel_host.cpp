// Host-side parts of expert parallelism that need no GPU: the EpDispatcher's configuration checks
// (every bad field named before any device work), and the in-process group's collective protocol
// (a host barrier per all_to_all; a mismatched call or an abort wakes every waiting rank with an
// error instead of a hang). Exchanges of zero-byte blocks enqueue no copies, so they run here.
// The chunk layout of the overlapped pipeline (src/ep/chunk_layout.h): the host arithmetic the
// dispatcher and the capacity kernel share.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ep/chunk_layout.h"
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
