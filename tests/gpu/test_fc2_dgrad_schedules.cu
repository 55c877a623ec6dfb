// The fused fc2 dgrad's two schedules (fused/fc2_dgrad_activation.h): ping-pong 64-row tiles and
// cooperative 128-row tiles compute every output bit for bit alike -- each row's dact is the same
// chain of WGMMAs over the same k blocks, and its epilogue the same code -- so the cooperative one
// is held bitwise to the ping-pong one, which the layer tests hold to the unfused reference path
// (tests/gpu/test_grouped_mlp.cpp). Covered: dh written over h, dprobs (one feature block, and two
// or three with the partial sums), the recomputed act x prob, the gathered rows written to dY_perm,
// gathering through a row map with padding rows and reading dY_perm directly, uneven and empty
// groups (single-block groups, whose one block is split between the cluster's CTAs by feature
// block, groups shorter than a tile and of several tiles), the TMA and the per-expert (cp.async)
// weights, and grids of a few SMs so that each CTA runs several tiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "fused/fc2_dgrad_activation.h"
#include "moe/float_convert.h"
#include "support/gpu.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using Bits = uint16_t;

struct Case {
  Activation kind;
  int H, F;
  bool gather;      // dY rows through the row map (else dY_perm itself)
  bool table;       // per-expert weights (cp.async) instead of one [E, H, F] tensor (TMA)
  int sm_count;     // 0: the device's
};

struct Outputs {
  std::vector<Bits> dh, act, dy_out;
  std::vector<float> dprobs;
};

Outputs run(const Case& c, fused::Fc2DgradSchedule schedule, cudaStream_t stream) {
  constexpr int E = 7, slots = 4;
  // Rows per expert (padded to multiples of 8): empty, one short of a 64-row block, two 128-row
  // blocks with a partial one, six with a partial one, exactly two, a few rows, and three 128-row
  // blocks with a partial one (odd for both tile heights: five 64-row blocks, three 128-row ones,
  // so the block split between the cluster's CTAs is not the group's first).
  const std::vector<int> counts = {0, 63, 3 * 64 + 5, 5 * 128 + 17, 256, 9, 2 * 128 + 5};
  constexpr int align = 8;  // padding rows (row map -1) to a multiple of 8 per group
  std::mt19937_64 rng(1234 + c.H + 7 * c.F + (c.gather ? 1 : 0) + (c.table ? 2 : 0));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t T = 500;
  std::vector<int32_t> pairs(T * slots);
  std::iota(pairs.begin(), pairs.end(), 0);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::vector<int32_t> off{0}, row_slots;
  size_t next = 0;
  for (int e = 0; e < E; ++e) {
    const int padded = (counts[e] + align - 1) / align * align;
    for (int i = 0; i < padded; ++i) row_slots.push_back(i < counts[e] ? pairs.at(next++) : -1);
    off.push_back(static_cast<int32_t>(row_slots.size()));
  }
  const int64_t R = static_cast<int64_t>(row_slots.size());
  const int64_t fc1_out = fc1_out_features(c.kind, c.F);
  auto random_bits = [&](size_t n, float scale) {
    std::vector<Bits> v(n);
    for (Bits& b : v) b = float_to_bf16_bits(scale * u(rng));
    return v;
  };
  const std::vector<Bits> dy = random_bits((c.gather ? T : R) * c.H, 1.0f);
  const std::vector<Bits> w2 = random_bits(int64_t(E) * c.H * c.F, 0.05f);
  const std::vector<Bits> h = random_bits(R * fc1_out, 2.0f);
  std::vector<float> probs(R);
  for (float& p : probs) p = 0.5f + 0.5f * u(rng);

  DeviceBuffer<Bits> d_dy(dy), d_w2(w2), d_h(h), d_act(R * c.F), d_dy_out(R * c.H);
  DeviceBuffer<int32_t> d_off(off), d_slots(row_slots);
  DeviceBuffer<float> d_probs(probs), d_dprobs(R), d_partial(int64_t(fused::fc2_dgrad_feature_blocks(c.F)) * R);
  std::vector<const void*> table(E);
  for (int e = 0; e < E; ++e) table[e] = d_w2.get() + int64_t(e) * c.H * c.F;
  DeviceBuffer<const void*> d_table(table);
  d_act.fill_bytes(0x7f);
  d_dy_out.fill_bytes(0x7f);
  d_dprobs.fill_bytes(0x7f);

  fused::Fc2DgradActivationArgs a;
  a.dy = d_dy.get();
  a.row_slots = c.gather ? d_slots.get() : nullptr;
  a.slots = slots;
  a.dy_out = c.gather ? d_dy_out.get() : nullptr;
  a.group_offsets = d_off.get();
  a.experts = E;
  a.R = R;
  a.H = c.H;
  a.F = c.F;
  a.w2 = c.table ? nullptr : d_w2.get();
  a.w2_table = c.table ? d_table.get() : nullptr;
  a.probs = d_probs.get();
  a.activation.kind = c.kind;
  a.h = d_h.get();
  a.act_out = d_act.get();
  a.dprobs = d_dprobs.get();
  a.dprobs_partial = d_partial.get();
  a.sm_count = c.sm_count;
  if (a.sm_count == 0) {
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&a.sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  a.schedule = schedule;
  fused::launch_fc2_dgrad_activation(a, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  Outputs o;
  o.dh = d_h.download();
  o.act = d_act.download();
  o.dy_out = d_dy_out.download();
  o.dprobs = d_dprobs.download();
  EXPECT_NE(o.dh, h) << "the kernel wrote no dh";
  return o;
}

class Fc2DgradSchedules : public testing::StreamTest, public ::testing::WithParamInterface<Case> {};

TEST_P(Fc2DgradSchedules, CooperativeIsBitwisePingPong) {
  const Case& c = GetParam();
  const Outputs pong = run(c, fused::Fc2DgradSchedule::kPingPong, stream);
  const Outputs coop = run(c, fused::Fc2DgradSchedule::kCooperative, stream);
  EXPECT_EQ(coop.dh, pong.dh);
  EXPECT_EQ(coop.act, pong.act);
  EXPECT_EQ(coop.dy_out, pong.dy_out);
  ASSERT_EQ(coop.dprobs.size(), pong.dprobs.size());
  for (size_t i = 0; i < coop.dprobs.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &coop.dprobs[i], 4);
    std::memcpy(&y, &pong.dprobs[i], 4);
    ASSERT_EQ(x, y) << "dprobs of row " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Fc2DgradSchedules,
    ::testing::Values(Case{Activation::kSwiGLU, 320, 256, true, false, 0},   // one feature block
                      Case{Activation::kSwiGLU, 648, 384, true, false, 4},   // two, partial sums; 4 SMs
                      Case{Activation::kSwiGLU, 320, 640, true, false, 0},   // three, with dY_perm copied out
                      Case{Activation::kGeGLU, 392, 200, false, false, 0},   // dY_perm read directly
                      Case{Activation::kSquaredReLU, 264, 136, true, true, 6},  // per-expert weights
                      Case{Activation::kClampedSwiGLU, 512, 264, true, true, 0}));

}  // namespace
}  // namespace moe
