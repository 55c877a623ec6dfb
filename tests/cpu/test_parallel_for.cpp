// parallel_for (src/checkpoint/parallel_for.h), which the checkpoint conversions decode with: every
// index handled exactly once, an exception from any index reaches the caller, nothing to do is fine.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "checkpoint/parallel_for.h"

namespace moe {
namespace {

TEST(ParallelFor, EveryIndexOnce) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{10000}}) {
    std::vector<std::atomic<int>> seen(n);
    detail::parallel_for(n, [&](size_t i) { ++seen[i]; });
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i].load(), 1) << "n = " << n << ", index " << i;
  }
}

TEST(ParallelFor, AnExceptionReachesTheCaller) {
  std::atomic<int> ran{0};
  EXPECT_THROW(detail::parallel_for(1000,
                                    [&](size_t i) {
                                      ++ran;
                                      if (i == 500) throw std::runtime_error("index 500");
                                    }),
               std::runtime_error);
  EXPECT_GE(ran.load(), 1);
  EXPECT_LE(ran.load(), 1000);
}

}  // namespace
}  // namespace moe
