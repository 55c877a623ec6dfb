// The check that bound weight gradients share no byte with a weight or with each other
// (src/layer/bound_ranges.h). The views are never dereferenced: made-up addresses suffice.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "layer/bound_ranges.h"
#include "moe/error.h"

namespace moe {
namespace {

TensorView at(uintptr_t address, int64_t elements) {
  return TensorView(reinterpret_cast<void*>(address), DType::kBF16, {elements});
}

// The error's message, or "" when the check passes.
std::string refusal(const std::vector<BoundRange>& grads, const std::vector<BoundRange>& weights) {
  try {
    check_gradients_apart(grads, weights, "call");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(BoundRanges, RangesOfEachLayout) {
  std::vector<BoundRange> r;
  add_bound_ranges(r, {at(0x1000, 64)}, "fc1.weight");                    // single grouped
  add_bound_ranges(r, {at(0x2000, 8), at(0x3000, 0), at(0x4000, 8)}, "b");  // per expert, one empty
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].expert, -1);
  EXPECT_EQ(r[0].end - r[0].begin, 128u);
  EXPECT_EQ(r[1].expert, 0);
  EXPECT_EQ(r[2].expert, 2);  // the empty expert 1 holds no byte
}

TEST(BoundRanges, BytesOverlap) {
  EXPECT_TRUE(bytes_overlap(at(0x1000, 64), at(0x1000 + 126, 4)));  // last element shared
  EXPECT_FALSE(bytes_overlap(at(0x1000, 64), at(0x1000 + 128, 4)));  // adjacent
  EXPECT_FALSE(bytes_overlap(at(0x1000, 64), TensorView()));          // null
}

TEST(BoundRanges, ABindingsTensorsByArgumentName) {
  const ExpertTensors t{{at(0x1000, 64)}, {}, {at(0x2000, 8), at(0x3000, 8)}, {at(0x4000, 4)}};
  const std::vector<BoundRange> w = expert_tensor_ranges(t, false), g = expert_tensor_ranges(t, true);
  ASSERT_EQ(w.size(), 4u);
  ASSERT_EQ(g.size(), 4u);
  EXPECT_STREQ(w[0].name, "fc1.weight");
  EXPECT_STREQ(w[1].name, "fc2.weight");
  EXPECT_EQ(w[2].expert, 1);
  EXPECT_STREQ(w[3].name, "fc2.bias");
  EXPECT_STREQ(g[0].name, "fc1.weight grad");
  EXPECT_STREQ(g[3].name, "fc2.bias grad");
}

TEST(BoundRanges, GradientOverAWeightIsRefusedByName) {
  std::vector<BoundRange> w, g;
  add_bound_ranges(w, {at(0x1000, 64), at(0x2000, 64)}, "fc2.weight");
  // Expert 1's gradient starts on the last element of expert 1's weight.
  add_bound_ranges(g, {at(0x8000, 64), at(0x2000 + 126, 64)}, "fc2.weight grad");
  const std::string why = refusal(g, w);
  EXPECT_NE(why.find("'fc2.weight grad' (expert 1)"), std::string::npos) << why;
  EXPECT_NE(why.find("'fc2.weight' (expert 1)"), std::string::npos) << why;
  // Adjacent is not overlapping.
  g.clear();
  add_bound_ranges(g, {at(0x8000, 64), at(0x2000 + 128, 64)}, "fc2.weight grad");
  EXPECT_EQ(refusal(g, w), "");
}

TEST(BoundRanges, GradientsOverEachOtherAreRefusedWeightsMayShare) {
  std::vector<BoundRange> w, g;
  add_bound_ranges(w, {at(0x1000, 64)}, "fc1.weight");
  add_bound_ranges(w, {at(0x1000, 32)}, "fc2.weight");  // weights sharing bytes: only read
  add_bound_ranges(g, {at(0x9000, 64)}, "fc1.weight grad");
  EXPECT_EQ(refusal(g, w), "");
  add_bound_ranges(g, {at(0x9000 + 64, 8)}, "fc1.bias grad");  // inside fc1.weight grad
  const std::string why = refusal(g, w);
  EXPECT_NE(why.find("'fc1.bias grad'"), std::string::npos) << why;
  EXPECT_NE(why.find("'fc1.weight grad'"), std::string::npos) << why;
}

TEST(BoundRanges, AnOverlapHiddenBehindALongerRangeIsFound) {
  // A long weight, then a short weight inside it, then a gradient starting inside the long one past
  // the short one's end: only the furthest-reaching earlier range shows it.
  std::vector<BoundRange> w, g;
  add_bound_ranges(w, {at(0x1000, 1024)}, "fc1.weight");
  add_bound_ranges(w, {at(0x1100, 8)}, "fc2.weight");
  add_bound_ranges(g, {at(0x1200, 8)}, "fc2.bias grad");
  const std::string why = refusal(g, w);
  EXPECT_NE(why.find("'fc2.bias grad' overlaps 'fc1.weight'"), std::string::npos) << why;
  EXPECT_EQ(refusal({}, w), "");
  EXPECT_EQ(refusal(g, {}), "");
}

}  // namespace
}  // namespace moe
