// SlotDivisor (src/device/slot_divisor.h): the multiply-and-shift division the gathered weight
// gradient uses to turn a dispatch slot into its token, against the integer division -- exhaustively
// for small slot numbers and near the multiples around 2^20 and 2^31 for the top-k values models
// use, and for large divisors.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "device/slot_divisor.h"

namespace moe {
namespace {

void expect_exact(int d, int n) {
  ASSERT_EQ(SlotDivisor::make(d).divide(n), n / d) << "n = " << n << ", d = " << d;
}

TEST(SlotDivisor, MatchesIntegerDivision) {
  for (int d = 1; d <= 64; ++d) {
    const SlotDivisor v = SlotDivisor::make(d);
    for (int n = 0; n < 100000; ++n) ASSERT_EQ(v.divide(n), n / d) << "n = " << n << ", d = " << d;
    for (int64_t q : {int64_t{1} << 20, (int64_t{1} << 31) / d - 1, (int64_t{1} << 31) / d})
      for (int64_t n = q * d - 2; n <= q * d + 2; ++n)
        if (n >= 0 && n < (int64_t{1} << 31)) expect_exact(d, static_cast<int>(n));
    expect_exact(d, 2147483647);
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const int d = static_cast<int>(rng() % 2147483647u) + 1;
    const int n = static_cast<int>(rng() % 2147483648u);
    expect_exact(d, n);
    expect_exact(d, 2147483647);
  }
  expect_exact(2147483647, 2147483646);
  expect_exact(2147483647, 2147483647);
}

TEST(SlotDivisor, NonPositiveDivisorActsAsOne) {
  EXPECT_EQ(SlotDivisor::make(0).divide(12345), 12345);
  EXPECT_EQ(SlotDivisor::make(-3).divide(12345), 12345);
}

}  // namespace
}  // namespace moe
