// Host-side parts of expert parallelism that need no GPU: the EpDispatcher's configuration checks
// (every bad field named before any device work), and the in-process group's collective protocol
// (a host barrier per all_to_all; a mismatched call or an abort wakes every waiting rank with an
// error instead of a hang). Exchanges of zero-byte blocks enqueue no copies, so they run here.
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

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

}  // namespace
}  // namespace moe
