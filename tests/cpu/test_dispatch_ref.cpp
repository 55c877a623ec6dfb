// CPU reference of dispatch (docs/semantics.md: Routing input, Dispatch, Errors): hand-computed
// plans for both routing forms, alignment, pre-padded input, overflow and every bad-input flag;
// permute / unpermute values; fp64 finite-difference checks of both backwards; edge cases (T = 0,
// empty experts, one expert takes everything, k = 1, k = E).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/dispatch.h"
#include "moe/error.h"
#include "reference/dispatch_ref.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/expect_error.h"

namespace moe::ref {
namespace {

using V64 = std::vector<int64_t>;

using ::moe::testing::expect_error_naming;

Routing topk(int64_t T, int E, int k, std::vector<int32_t> idx, std::vector<double> probs = {}) {
  return topk_routing(T, E, k, std::move(idx), std::move(probs));
}

DispatchOptions opts(int align = 0, int64_t R = -1, bool pre_padded = false) {
  DispatchOptions o;
  o.align = align;
  o.row_bound = R;
  o.pre_padded = pre_padded;
  return o;
}

std::vector<double> iota_rows(int64_t T, int64_t H) {
  std::vector<double> x(static_cast<size_t>(T * H));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<double>(i) + 1.0;
  return x;
}

std::vector<double> random_vec(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// The running example: T=4, E=3, k=2.
//   t0 -> {0, 2}, t1 -> {2, empty}, t2 -> {1, 0}, t3 -> {0, 1}
Routing example() { return topk(4, 3, 2, {0, 2, 2, -1, 1, 0, 0, 1}); }

TEST(PlanDispatch, TopKNoAlignment) {
  DispatchPlan p = plan_dispatch(example(), opts());
  EXPECT_EQ(p.R, 8);  // default bound T*k
  EXPECT_EQ(p.slots, 2);
  EXPECT_EQ(p.count, (V64{3, 2, 2}));
  EXPECT_EQ(p.padded, (V64{3, 2, 2}));
  EXPECT_EQ(p.offset, (V64{0, 3, 5}));
  // expert 0: t0, t2, t3 -> rows 0, 1, 2; expert 1: t2, t3 -> 3, 4; expert 2: t0, t1 -> 5, 6.
  EXPECT_EQ(p.slot_row, (V64{0, 5, 6, -1, 3, 1, 2, 4}));
  EXPECT_EQ(p.slot_expert, (std::vector<int32_t>{0, 2, 2, -1, 1, 0, 0, 1}));
  EXPECT_EQ(p.row_token, (V64{0, 2, 3, 2, 3, 0, 1, -1}));
  EXPECT_EQ(p.row_slot, (V64{0, 5, 6, 4, 7, 1, 2, -1}));
  EXPECT_EQ(p.error_bits, 0u);
  for (int e = 0; e < 3; ++e) EXPECT_EQ(p.rows_in_bound(e), p.padded[e]);
}

TEST(PlanDispatch, TopKAligned) {
  DispatchPlan p = plan_dispatch(example(), opts(16));
  EXPECT_EQ(p.R, 8 + 3 * 15);
  EXPECT_EQ(p.count, (V64{3, 2, 2}));
  EXPECT_EQ(p.padded, (V64{16, 16, 16}));
  EXPECT_EQ(p.offset, (V64{0, 16, 32}));
  EXPECT_EQ(p.slot_row, (V64{0, 32, 33, -1, 16, 1, 2, 17}));
  EXPECT_EQ(p.error_bits, 0u);

  // permute: pad rows and rows past sum(padded) are zero, probs travel with the rows.
  const int64_t H = 3;
  std::vector<double> x = iota_rows(4, H), x_perm(p.R * H, -7.0), probs_perm(p.R, -7.0);
  permute(p, x.data(), H, x_perm.data(), probs_perm.data());
  auto expect_row = [&](int64_t r, int64_t t) {
    for (int64_t h = 0; h < H; ++h) EXPECT_EQ(x_perm[r * H + h], t < 0 ? 0.0 : x[t * H + h]) << "row " << r;
  };
  const std::vector<std::pair<int64_t, int64_t>> rows = {{0, 0}, {1, 2}, {2, 3}, {16, 2}, {17, 3}, {32, 0}, {33, 1}};
  for (int64_t r = 0; r < p.R; ++r) {
    int64_t t = -1;
    for (auto [rr, tt] : rows)
      if (rr == r) t = tt;
    expect_row(r, t);
  }
  // probs of the example are 0.125 * (slot + 1).
  EXPECT_EQ(probs_perm[0], 0.125 * 1);   // t0 slot 0
  EXPECT_EQ(probs_perm[1], 0.125 * 6);   // t2 slot 1
  EXPECT_EQ(probs_perm[2], 0.125 * 7);   // t3 slot 0
  EXPECT_EQ(probs_perm[16], 0.125 * 5);  // t2 slot 0
  EXPECT_EQ(probs_perm[17], 0.125 * 8);  // t3 slot 1
  EXPECT_EQ(probs_perm[32], 0.125 * 2);  // t0 slot 1
  EXPECT_EQ(probs_perm[33], 0.125 * 3);  // t1 slot 0
  for (int64_t r : {3, 15, 18, 31, 34, 47, 48, 52}) EXPECT_EQ(probs_perm[r], 0.0) << r;
}

TEST(PlanDispatch, AllAlignments) {
  Routing r = make_topk_routing(100, 7, 3, 11);
  for (int A : {0, 16, 32, 64, 128, 256}) {
    DispatchPlan p = plan_dispatch(r, opts(A));
    int64_t off = 0;
    for (int e = 0; e < 7; ++e) {
      EXPECT_EQ(p.padded[e], A ? (p.count[e] + A - 1) / A * A : p.count[e]);
      if (A) EXPECT_EQ(p.padded[e] % A, 0);
      EXPECT_EQ(p.offset[e], off);
      off += p.padded[e];
    }
    EXPECT_LE(off, p.R);
    EXPECT_EQ(p.error_bits, 0u);
  }
}

TEST(PlanDispatch, MapForm) {
  // T=3, E=4: t0 -> {1, 3}, t1 -> {}, t2 -> {0, 1, 2, 3}.
  Routing r;
  r.form = RoutingForm::kMap;
  r.T = 3;
  r.E = 4;
  r.map = {0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1};
  r.probs = {0, 0.5, 0, 0.25, 0, 0, 0, 0, 0.1, 0.2, 0.3, 0.4};
  expect_error_naming([&] { plan_dispatch(r, opts()); }, "row_bound");  // map form needs R
  DispatchPlan p = plan_dispatch(r, opts(0, 10));
  EXPECT_EQ(p.slots, 4);
  EXPECT_EQ(p.count, (V64{1, 2, 1, 2}));
  EXPECT_EQ(p.offset, (V64{0, 1, 3, 4}));
  EXPECT_EQ(p.slot_row, (V64{-1, 1, -1, 4, -1, -1, -1, -1, 0, 2, 3, 5}));
  EXPECT_EQ(p.row_token, (V64{2, 0, 2, 2, 0, 2, -1, -1, -1, -1}));
  EXPECT_EQ(p.error_bits, 0u);

  std::vector<double> probs_perm(10), x_perm(10 * 2), x = iota_rows(3, 2);
  permute(p, x.data(), 2, x_perm.data(), probs_perm.data());
  EXPECT_EQ(probs_perm, (std::vector<double>{0.1, 0.5, 0.2, 0.3, 0.25, 0.4, 0, 0, 0, 0}));
  EXPECT_EQ(x_perm, (std::vector<double>{5, 6, 1, 2, 5, 6, 5, 6, 1, 2, 5, 6, 0, 0, 0, 0, 0, 0, 0, 0}));

  // With alignment 16: padded 16 each, R must be given; 64 rows fit in 64.
  DispatchPlan a = plan_dispatch(r, opts(16, 64));
  EXPECT_EQ(a.offset, (V64{0, 16, 32, 48}));
  EXPECT_EQ(a.slot_row, (V64{-1, 16, -1, 48, -1, -1, -1, -1, 0, 17, 32, 49}));
  EXPECT_EQ(a.error_bits, 0u);
}

TEST(PlanDispatch, MapFormMatchesTopK) {
  // The same routing in both forms gives the same rows, expert by expert and token by token.
  Routing r = make_topk_routing(50, 8, 3, 5);
  Routing m = topk_to_map(r);
  DispatchPlan pt = plan_dispatch(r, opts(32));
  DispatchPlan pm = plan_dispatch(m, opts(32, pt.R));
  EXPECT_EQ(pt.count, pm.count);
  EXPECT_EQ(pt.offset, pm.offset);
  EXPECT_EQ(pt.row_token, pm.row_token);
  for (int64_t t = 0; t < 50; ++t)
    for (int s = 0; s < 3; ++s) {
      int e = r.indices[t * 3 + s];
      EXPECT_EQ(pt.slot_row[t * 3 + s], pm.slot_row[t * 8 + e]);
    }
}

TEST(PlanDispatch, PrePadded) {
  // 16 tokens to expert 0 and 32 to expert 1: already multiples of 16, no second pad.
  std::vector<int32_t> idx(48);
  for (int t = 0; t < 48; ++t) idx[t] = t < 16 ? 0 : 1;
  DispatchPlan p = plan_dispatch(topk(48, 3, 1, idx), opts(16, -1, true));
  EXPECT_EQ(p.R, 48);  // the default bound has no pad term when pre-padded
  EXPECT_EQ(p.padded, (V64{16, 32, 0}));
  EXPECT_EQ(p.offset, (V64{0, 16, 48}));
  EXPECT_EQ(p.error_bits, 0u);
  // The same routing padded on the fly gives the same layout.
  DispatchPlan q = plan_dispatch(topk(48, 3, 1, idx), opts(16));
  EXPECT_EQ(q.slot_row, p.slot_row);

  // A count that is not a multiple of A: flagged, padded stays the count (never padded here).
  idx[16] = 0;  // 17 and 31
  DispatchPlan bad = plan_dispatch(topk(48, 3, 1, idx), opts(16, -1, true));
  EXPECT_EQ(bad.error_bits, static_cast<uint32_t>(kErrMisalignedPrepadded));
  EXPECT_EQ(bad.padded, (V64{17, 31, 0}));
  EXPECT_EQ(bad.offset, (V64{0, 17, 48}));
  // Without alignment there is nothing to be misaligned with.
  EXPECT_EQ(plan_dispatch(topk(48, 3, 1, idx), opts(0, -1, true)).error_bits, 0u);
}

TEST(PlanDispatch, RowOverflow) {
  // Example with A = 16 needs 48 rows; give 20.
  DispatchPlan p = plan_dispatch(example(), opts(16, 20));
  EXPECT_EQ(p.error_bits, static_cast<uint32_t>(kErrRowOverflow));
  EXPECT_EQ(p.offset, (V64{0, 16, 32}));  // true offsets, past R
  EXPECT_EQ(p.padded, (V64{16, 16, 16}));
  EXPECT_EQ(p.rows_in_bound(0), 16);
  EXPECT_EQ(p.rows_in_bound(1), 4);
  EXPECT_EQ(p.rows_in_bound(2), 0);
  // Expert 2's rows (32, 33) are past R: not written, the slots keep their expert.
  EXPECT_EQ(p.slot_row, (V64{0, -1, -1, -1, 16, 1, 2, 17}));
  EXPECT_EQ(p.slot_expert[1], 2);
  EXPECT_EQ(p.row_token.size(), 20u);
  std::vector<double> x = iota_rows(4, 2), x_perm(20 * 2), y(4 * 2);
  permute(p, x.data(), 2, x_perm.data(), nullptr);
  EXPECT_EQ(x_perm[16 * 2], x[2 * 2]);
  // Combine sees only the rows that exist: t1's only row was dropped.
  unpermute(p, x_perm.data(), 2, false, y.data());
  EXPECT_EQ(y[1 * 2], 0.0);
  EXPECT_EQ(y[0 * 2], x[0]);  // t0 lost its expert-2 row

  // Only pad rows past R also overflow (sum(padded) > R is the condition).
  DispatchPlan q = plan_dispatch(example(), opts(16, 34));
  EXPECT_EQ(q.error_bits, static_cast<uint32_t>(kErrRowOverflow));
  EXPECT_EQ(q.slot_row[1], 32);
  EXPECT_EQ(q.rows_in_bound(2), 2);
  // Exactly enough rows: no flag.
  EXPECT_EQ(plan_dispatch(example(), opts(16, 48)).error_bits, 0u);
}

TEST(PlanDispatch, BadExpertIdsAreSkippedAndFlagged) {
  // -1 is an empty slot (no flag); 3 and -2 are out of range for E = 3.
  DispatchPlan p = plan_dispatch(topk(3, 3, 2, {0, 3, -2, 1, -1, 2}), opts());
  EXPECT_EQ(p.error_bits, static_cast<uint32_t>(kErrExpertOutOfRange));
  EXPECT_EQ(p.count, (V64{1, 1, 1}));
  EXPECT_EQ(p.slot_row, (V64{0, -1, -1, 1, -1, 2}));
  EXPECT_EQ(plan_dispatch(topk(2, 3, 2, {-1, -1, 2, -1}), opts()).error_bits, 0u);
  EXPECT_EQ(plan_dispatch(topk(1, 3, 1, {std::numeric_limits<int32_t>::max()}), opts()).error_bits,
            static_cast<uint32_t>(kErrExpertOutOfRange));
}

TEST(PlanDispatch, DuplicateExpertKeepsTheFirst) {
  // t0 = {1, 1, 0}: the second 1 is skipped. t1 = {2, 0, 2}.
  Routing r = topk(2, 3, 3, {1, 1, 0, 2, 0, 2});
  DispatchPlan p = plan_dispatch(r, opts());
  EXPECT_EQ(p.error_bits, static_cast<uint32_t>(kErrDuplicateExpert));
  EXPECT_EQ(p.count, (V64{2, 1, 1}));
  EXPECT_EQ(p.slot_row, (V64{2, -1, 0, 3, 1, -1}));
  EXPECT_EQ(p.slot_prob[0], r.probs[0]);
  EXPECT_EQ(p.slot_prob[1], 0.0);
  // Repeated empty slots are not duplicates.
  EXPECT_EQ(plan_dispatch(topk(1, 3, 3, {-1, 0, -1}), opts()).error_bits, 0u);
}

TEST(PlanDispatch, NonFiniteProbsAreSkippedAndFlagged) {
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  DispatchPlan p = plan_dispatch(topk(2, 3, 2, {0, 1, 2, 0}, {0.5, nan, -inf, 0.25}), opts());
  EXPECT_EQ(p.error_bits, static_cast<uint32_t>(kErrNonFiniteProb));
  EXPECT_EQ(p.count, (V64{2, 0, 0}));
  EXPECT_EQ(p.slot_row, (V64{0, -1, -1, 1}));
  // The prob of an empty slot is not looked at.
  EXPECT_EQ(plan_dispatch(topk(1, 3, 2, {0, -1}, {0.5, nan}), opts()).error_bits, 0u);
  // A NaN first occurrence is skipped; its repeat is still a duplicate.
  DispatchPlan d = plan_dispatch(topk(1, 3, 2, {1, 1}, {nan, 0.5}), opts());
  EXPECT_EQ(d.error_bits, static_cast<uint32_t>(kErrNonFiniteProb | kErrDuplicateExpert));
  EXPECT_EQ(d.count, (V64{0, 0, 0}));

  // Map form: only routed entries are checked.
  Routing m;
  m.form = RoutingForm::kMap;
  m.T = 2;
  m.E = 2;
  m.map = {1, 0, 1, 1};
  m.probs = {0.5, nan, inf, 0.25};
  DispatchPlan q = plan_dispatch(m, opts(0, 4));
  EXPECT_EQ(q.error_bits, static_cast<uint32_t>(kErrNonFiniteProb));
  EXPECT_EQ(q.slot_row, (V64{0, -1, -1, 1}));
  EXPECT_EQ(q.count, (V64{1, 1}));
}

TEST(PlanDispatch, EveryFlagAtOnce) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  DispatchPlan p = plan_dispatch(topk(3, 2, 2, {0, 0, 5, 1, 1, 0}, {1, 1, 1, nan, 1, 1}), opts(16, 17));
  EXPECT_EQ(p.error_bits,
            static_cast<uint32_t>(kErrDuplicateExpert | kErrExpertOutOfRange | kErrNonFiniteProb | kErrRowOverflow));
  EXPECT_EQ(p.count, (V64{2, 1}));
  EXPECT_EQ(p.slot_row, (V64{0, -1, -1, -1, 16, 1}));
}

TEST(PlanDispatch, HostCheckedArguments) {
  expect_error_naming([] { plan_dispatch(example(), opts(24)); }, "align");
  expect_error_naming([] { plan_dispatch(example(), opts(0, -5)); }, "row_bound");
  Routing r = example();
  r.indices.pop_back();
  expect_error_naming([&] { plan_dispatch(r, opts()); }, "routing.indices");
  r = example();
  r.probs.push_back(1);
  expect_error_naming([&] { plan_dispatch(r, opts()); }, "routing.probs");
}

TEST(PlanDispatch, InvariantsOnRandomRouting) {
  for (double skew : {0.0, 1.0})
    for (int A : {0, 128}) {
      Routing r = make_topk_routing(500, 16, 4, 3, skew);
      DispatchPlan p = plan_dispatch(r, opts(A));
      EXPECT_EQ(p.error_bits, 0u);
      int64_t total = 0;
      for (int e = 0; e < 16; ++e) total += p.count[e];
      EXPECT_EQ(total, 500 * 4);
      // slot_row and row_slot are inverse; rows of an expert hold increasing tokens.
      for (size_t i = 0; i < p.slot_row.size(); ++i) {
        ASSERT_GE(p.slot_row[i], 0);
        EXPECT_EQ(p.row_slot[p.slot_row[i]], static_cast<int64_t>(i));
        const int e = p.slot_expert[i];
        EXPECT_GE(p.slot_row[i], p.offset[e]);
        EXPECT_LT(p.slot_row[i], p.offset[e] + p.count[e]);
      }
      for (int e = 0; e < 16; ++e)
        for (int64_t j = 1; j < p.count[e]; ++j)
          EXPECT_LT(p.row_token[p.offset[e] + j - 1], p.row_token[p.offset[e] + j]);
    }
}

TEST(Combine, HandComputed) {
  DispatchPlan p = plan_dispatch(example(), opts(16));
  const int64_t H = 2;
  std::vector<double> Y(p.R * H);
  for (int64_t r = 0; r < p.R; ++r) Y[r * H] = Y[r * H + 1] = static_cast<double>(r) + 1.0;
  // Pad rows hold garbage that must never be read.
  for (int64_t r : {3, 10, 18, 40}) Y[r * H] = Y[r * H + 1] = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> y(4 * H);
  unpermute(p, Y.data(), H, false, y.data());
  // t0: rows 0 and 32; t1: row 33; t2: rows 16 and 1; t3: rows 2 and 17.
  EXPECT_EQ(y, (std::vector<double>{1 + 33, 1 + 33, 34, 34, 17 + 2, 17 + 2, 3 + 18, 3 + 18}));
  unpermute(p, Y.data(), H, true, y.data());
  const auto& pr = example().probs;
  EXPECT_DOUBLE_EQ(y[0], pr[0] * 1 + pr[1] * 33);
  EXPECT_DOUBLE_EQ(y[2], pr[2] * 34);
  EXPECT_DOUBLE_EQ(y[4], pr[4] * 17 + pr[5] * 2);
  EXPECT_DOUBLE_EQ(y[6], pr[6] * 3 + pr[7] * 18);

  // Backward: dY = w * dy at the token's rows, zero on pad rows; dprobs = <Y[row], dy[t]>.
  std::vector<double> dy = {1, 2, 3, 4, 5, 6, 7, 8}, dY(p.R * H, -1), dprobs(8, -1);
  unpermute_backward(p, Y.data(), dy.data(), H, true, dY.data(), dprobs.data());
  EXPECT_DOUBLE_EQ(dY[32 * H + 1], pr[1] * 2);
  EXPECT_DOUBLE_EQ(dY[33 * H], pr[2] * 3);
  EXPECT_EQ(dY[3 * H], 0.0);
  EXPECT_EQ(dY[52 * H + 1], 0.0);
  EXPECT_DOUBLE_EQ(dprobs[1], 33.0 * 1 + 33.0 * 2);
  EXPECT_EQ(dprobs[3], 0.0);  // empty slot
  unpermute_backward(p, nullptr, dy.data(), H, false, dY.data(), dprobs.data());
  EXPECT_EQ(dY[32 * H + 1], 2.0);
  for (double d : dprobs) EXPECT_EQ(d, 0.0);  // y does not depend on the probs without merging
}

TEST(Combine, TokensRoutedNowhereGetZero) {
  DispatchPlan p = plan_dispatch(topk(3, 2, 2, {-1, -1, 0, 1, -1, -1}), opts());
  std::vector<double> Y = {1, 2, 3, 4, 5, 6, 7, 8}, y(3 * 2, 9.0);
  unpermute(p, Y.data(), 2, true, y.data());
  EXPECT_EQ(y[0], 0.0);
  EXPECT_EQ(y[1], 0.0);
  EXPECT_EQ(y[4], 0.0);
  EXPECT_EQ(y[5], 0.0);
}

TEST(PermuteBackward, HandComputed) {
  DispatchPlan p = plan_dispatch(example(), opts());
  const int64_t H = 1;
  std::vector<double> dxp = {1, 2, 3, 4, 5, 6, 7, 100}, dpp = {10, 20, 30, 40, 50, 60, 70, 800};
  std::vector<double> dx(4), dprobs(8);
  permute_backward(p, dxp.data(), dpp.data(), H, dx.data(), dprobs.data());
  // slot_row = {0, 5, 6, -1, 3, 1, 2, 4}
  EXPECT_EQ(dx, (std::vector<double>{1 + 6, 7, 4 + 2, 3 + 5}));
  EXPECT_EQ(dprobs, (std::vector<double>{10, 60, 70, 0, 40, 20, 30, 50}));
}

// ---- finite-difference gradient checks (fp64) ----

// Central difference of a scalar function of one coordinate.
double central_diff(const std::function<double()>& f, double& coord, double h = 1e-4) {
  const double keep = coord;
  coord = keep + h;
  const double fp = f();
  coord = keep - h;
  const double fm = f();
  coord = keep;
  return (fp - fm) / (2 * h);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Routing with every kind of skipped entry, alignment and overflow, so gradients of skipped and
// dropped entries are checked to be zero too.
struct GradCase {
  Routing routing;
  DispatchOptions o;
};

std::vector<GradCase> grad_cases() {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<GradCase> cases;
  cases.push_back({make_topk_routing(9, 5, 2, 21), opts(16)});
  cases.push_back({topk(5, 4, 3, {0, 0, 2, 3, -1, 9, 1, 2, 3, 3, 2, 1, 0, 1, 2}, random_vec(15, 4)), opts(0, 8)});
  cases.push_back({make_map_routing(7, 4, 4, 8), opts(32, 100)});
  Routing withnan = make_topk_routing(6, 4, 2, 3);
  withnan.probs[3] = nan;
  cases.push_back({withnan, opts(0)});
  return cases;
}

TEST(GradCheck, PermuteBackward) {
  const int64_t H = 3;
  for (auto& c : grad_cases()) {
    Routing r = c.routing;
    const DispatchPlan p0 = plan_dispatch(r, c.o);
    std::vector<double> x = random_vec(r.T * H, 1);
    const std::vector<double> gx = random_vec(p0.R * H, 2), gp = random_vec(p0.R, 3);
    // L(x, probs) = <gx, x_perm> + <gp, probs_perm>
    auto loss = [&] {
      DispatchPlan p = plan_dispatch(r, c.o);
      std::vector<double> xp(p.R * H), pp(p.R);
      permute(p, x.data(), H, xp.data(), pp.data());
      return dot(gx, xp) + dot(gp, pp);
    };
    std::vector<double> dx(r.T * H), dprobs(r.probs.size(), -1);
    permute_backward(p0, gx.data(), gp.data(), H, dx.data(), dprobs.data());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(central_diff(loss, x[i]), dx[i], 1e-9) << "dx " << i;
    for (size_t i = 0; i < r.probs.size(); ++i) {
      if (!std::isfinite(r.probs[i])) {
        EXPECT_EQ(dprobs[i], 0.0);
        continue;
      }
      EXPECT_NEAR(central_diff(loss, r.probs[i]), dprobs[i], 1e-9) << "dprobs " << i;
    }
  }
}

TEST(GradCheck, UnpermuteBackward) {
  const int64_t H = 3;
  for (auto& c : grad_cases())
    for (bool merge : {false, true}) {
      Routing r = c.routing;
      const DispatchPlan p0 = plan_dispatch(r, c.o);
      std::vector<double> Y = random_vec(p0.R * H, 5);
      const std::vector<double> gy = random_vec(r.T * H, 6);
      // L(Y, probs) = <gy, unpermute(Y, probs)>
      auto loss = [&] {
        DispatchPlan p = plan_dispatch(r, c.o);
        std::vector<double> y(r.T * H);
        unpermute(p, Y.data(), H, merge, y.data());
        return dot(gy, y);
      };
      std::vector<double> dY(p0.R * H), dprobs(r.probs.size(), -1);
      unpermute_backward(p0, Y.data(), gy.data(), H, merge, dY.data(), dprobs.data());
      for (size_t i = 0; i < Y.size(); ++i) EXPECT_NEAR(central_diff(loss, Y[i]), dY[i], 1e-9) << "dY " << i;
      for (size_t i = 0; i < r.probs.size(); ++i) {
        if (!std::isfinite(r.probs[i])) {
          EXPECT_EQ(dprobs[i], 0.0);
          continue;
        }
        EXPECT_NEAR(central_diff(loss, r.probs[i]), dprobs[i], 1e-9) << "dprobs " << i << " merge " << merge;
      }
    }
}

// ---- edge cases ----

TEST(EdgeCases, ZeroTokens) {
  DispatchPlan p = plan_dispatch(topk(0, 4, 2, {}), opts(16, 64));
  EXPECT_EQ(p.count, (V64{0, 0, 0, 0}));
  EXPECT_EQ(p.padded, (V64{0, 0, 0, 0}));  // an empty expert stays 0 even with alignment
  EXPECT_EQ(p.offset, (V64{0, 0, 0, 0}));
  EXPECT_EQ(p.error_bits, 0u);
  std::vector<double> xp(64 * 2, 5.0), pp(64, 5.0);
  permute(p, nullptr, 2, xp.data(), pp.data());
  for (double v : xp) EXPECT_EQ(v, 0.0);
  for (double v : pp) EXPECT_EQ(v, 0.0);
  EXPECT_EQ(plan_dispatch(topk(0, 4, 2, {}), opts()).R, 0);
}

TEST(EdgeCases, OneExpertTakesEverything) {
  std::vector<int32_t> idx(40, 2);
  DispatchPlan p = plan_dispatch(topk(40, 4, 1, idx), opts(64));
  EXPECT_EQ(p.count, (V64{0, 0, 40, 0}));
  EXPECT_EQ(p.padded, (V64{0, 0, 64, 0}));
  EXPECT_EQ(p.offset, (V64{0, 0, 0, 64}));
  for (int t = 0; t < 40; ++t) EXPECT_EQ(p.slot_row[t], t);
  EXPECT_EQ(p.rows_in_bound(3), 0);
}

TEST(EdgeCases, TopOneAndTopAll) {
  // k = 1: combine without probs is a pure copy back.
  Routing r1 = make_topk_routing(30, 6, 1, 9);
  DispatchPlan p1 = plan_dispatch(r1, opts(16));
  std::vector<double> x = random_vec(30 * 4, 1), xp(p1.R * 4), y(30 * 4);
  permute(p1, x.data(), 4, xp.data(), nullptr);
  unpermute(p1, xp.data(), 4, false, y.data());
  EXPECT_EQ(y, x);
  // k = E: every token goes to every expert; the combine without probs is E * x.
  Routing rE = make_topk_routing(20, 5, 5, 10);
  DispatchPlan pE = plan_dispatch(rE, opts());
  EXPECT_EQ(pE.count, (V64{20, 20, 20, 20, 20}));
  EXPECT_EQ(pE.error_bits, 0u);
  std::vector<double> xE = iota_rows(20, 2), xpE(pE.R * 2), yE(20 * 2);
  permute(pE, xE.data(), 2, xpE.data(), nullptr);
  unpermute(pE, xpE.data(), 2, false, yE.data());
  for (size_t i = 0; i < xE.size(); ++i) EXPECT_EQ(yE[i], 5 * xE[i]);
  // Expert e's rows hold tokens 0..19 in order.
  for (int e = 0; e < 5; ++e)
    for (int t = 0; t < 20; ++t) EXPECT_EQ(pE.row_token[e * 20 + t], t);
}

TEST(EdgeCases, MapFormTokensWithZeroToAllExperts) {
  Routing m = make_map_routing(64, 7, 7, 12);
  DispatchPlan p = plan_dispatch(m, opts(0, 64 * 7));
  EXPECT_EQ(p.error_bits, 0u);
  int64_t routed = 0;
  for (uint8_t v : m.map) routed += v != 0;
  int64_t total = 0;
  for (int64_t c : p.count) total += c;
  EXPECT_EQ(total, routed);
  // permute then unpermute without probs gives each token times its number of experts.
  std::vector<double> x = iota_rows(64, 2), xp(p.R * 2), y(64 * 2);
  permute(p, x.data(), 2, xp.data(), nullptr);
  unpermute(p, xp.data(), 2, false, y.data());
  for (int64_t t = 0; t < 64; ++t) {
    int n = 0;
    for (int e = 0; e < 7; ++e) n += m.map[t * 7 + e] != 0;
    EXPECT_EQ(y[t * 2], n * x[t * 2]) << t;
  }
}

// Token chunks of the running example, by hand: chunks {t0, t1} and {t2, t3}.
TEST(ChunkWindows, HandComputed) {
  const DispatchPlan p = plan_dispatch(example(), opts());
  const ChunkWindows w = chunk_windows(p, 2);
  EXPECT_EQ(w.Tc, 2);
  // expert 0: rows 0 (t0) | 1, 2 (t2, t3); expert 1: none | 3, 4; expert 2: 5, 6 (t0, t1) | none.
  EXPECT_EQ(w.row_begin[0], (V64{0, 3, 5}));
  EXPECT_EQ(w.offsets[0], (V64{0, 1, 1, 3}));
  EXPECT_EQ(w.row_begin[1], (V64{1, 3, 7}));
  EXPECT_EQ(w.offsets[1], (V64{0, 2, 4, 4}));
  EXPECT_EQ(w.local_row, (V64{0, 1, 2, -1, 2, 0, 1, 3}));
  // One chunk: the windows are the groups' real rows.
  const ChunkWindows one = chunk_windows(p, 1);
  EXPECT_EQ(one.row_begin[0], (V64{0, 3, 5}));
  EXPECT_EQ(one.offsets[0], (V64{0, 3, 5, 7}));
}

// Random routings with padding, skew and row overflow: a chunk's packed rows are exactly its
// tokens' rows, each once, in window order.
TEST(ChunkWindows, PackedRowsAreTheChunksRows) {
  for (const int align : {0, 16, 32})
    for (const int64_t R : {int64_t{-1}, int64_t{70}})
      for (const int chunks : {1, 3, 8, 40}) {
        SCOPED_TRACE(::testing::Message() << "A=" << align << " R=" << R << " chunks=" << chunks);
        const Routing rt = make_topk_routing(37, 6, 3, 11 + chunks, 1.5);
        const DispatchPlan p = plan_dispatch(rt, opts(align, R));
        const ChunkWindows w = chunk_windows(p, chunks);
        std::vector<std::vector<int64_t>> seen(chunks);
        for (int c = 0; c < chunks; ++c) seen[c].assign(w.offsets[c][p.E], -1);
        for (int64_t i = 0; i < p.T * p.slots; ++i) {
          const int64_t r = p.slot_row[i];
          if (r < 0) {
            EXPECT_EQ(w.local_row[i], -1);
            continue;
          }
          const int64_t c = (i / p.slots) / w.Tc, e = p.slot_expert[i], l = w.local_row[i];
          ASSERT_GE(l, w.offsets[c][e]);
          ASSERT_LT(l, w.offsets[c][e + 1]);
          EXPECT_EQ(w.row_begin[c][e] + (l - w.offsets[c][e]), r);  // the packed row is the plan's row
          EXPECT_EQ(seen[c][l], -1) << "packed row " << l << " taken twice";
          seen[c][l] = i;
        }
        for (int c = 0; c < chunks; ++c)
          for (int64_t v : seen[c]) EXPECT_GE(v, 0) << "a packed row of chunk " << c << " belongs to no slot";
      }
}

}  // namespace
}  // namespace moe::ref

namespace moe {
namespace {

// The dispatcher is sized at construction (no device memory is touched there): bounds whose
// products would wrap around int64 into a small plan are refused by name, not taken for a small
// plan that the first forward would write past.
TEST(DispatcherConfig, RefusesBoundsThatWouldWrapIntoASmallPlan) {
  DispatcherConfig c;
  c.max_tokens = 1000;
  c.num_experts = 8;
  c.topk = 2;
  c.hidden = 128;
  Dispatcher ok(c);
  EXPECT_EQ(ok.rows(), 2000);
  auto refuses = [&](const std::function<void(DispatcherConfig&)>& edit, const char* name) {
    DispatcherConfig bad = c;
    edit(bad);
    testing::expect_error_naming([&] { Dispatcher d(bad); }, name);
  };
  refuses([](DispatcherConfig& b) { b.max_tokens = std::numeric_limits<int64_t>::max(); }, "'max_tokens'");
  refuses([](DispatcherConfig& b) { b.max_tokens = int64_t{1} << 62; }, "'max_tokens'");
  refuses([](DispatcherConfig& b) { b.max_tokens = int64_t{1} << 30; }, "'max_tokens'");
  refuses([](DispatcherConfig& b) {
    b.form = RoutingForm::kMap;
    b.options.row_bound = 1000;
    b.max_tokens = int64_t{1} << 61;  // x 8 slots = 2^64
  }, "'max_tokens'");
  refuses([](DispatcherConfig& b) { b.hidden = (int64_t{1} << 62) + 8; }, "'hidden'");
}

}  // namespace
}  // namespace moe
