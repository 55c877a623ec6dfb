// Expert-parallel dispatch and combine on the GPU (moe::EpDispatcher in capacity mode,
// docs/expert_parallel.md), P ranks simulated on one GPU (InProcessGroup), against the CPU reference
// and the single-GPU moe::Dispatcher, bitwise (tests/support/ep_checks.h says what each compares).
// Pad rows of Y, d_x_perm and d_probs_perm hold NaN, so a read of one shows up in the outputs.
// Graph capture of every op on every rank, replayed with new routing, equals an eager run bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/dispatch.h"
#include "moe/expert_parallel.h"
#include "reference/ep_dispatch_ref.h"
#include "support/ep_checks.h"
#include "support/ep_harness.h"
#include "support/expect_error.h"
#include "support/gpu.h"

namespace moe {
namespace {

using namespace ::moe::testing;
template <typename T>
using DevBuf = ::moe::testing::DeviceBuffer<T>;

void run_case(const EpCase& c, bool single_gpu_check = true) {
  SCOPED_TRACE(c.name);
  InProcessWorld world(c.P);
  const uint64_t seed = c.seed;
  const EpInputs in = make_ep_inputs(c, seed);
  const std::vector<EpRankOut> out = run_ep_case(c, world.w, in, seed + 100);
  check_against_reference(c, in, out);
  if (single_gpu_check) check_against_single_gpu(c, in, out, seed + 100);
}

// ---- cases ----

TEST(ExpertParallel, TwoRanksNoDrops) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P2 top-2 A0 no drops";
  c.P = 2;
  c.E_local = 3;
  c.k = 2;
  c.C = 200;
  c.T = {40, 33};
  run_case(c);
}

TEST(ExpertParallel, FourRanksSkewedWithDropsAndAnEmptyRank) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 top-4 A16 skewed, drops, T=0 on rank 1";
  c.P = 4;
  c.E_local = 2;
  c.k = 4;
  c.A = 16;
  c.C = 24;
  c.skew = 1.5;
  c.T = {64, 0, 50, 31};
  c.seed = 2;
  run_case(c);
}

TEST(ExpertParallel, EightRanksAlign128Drops) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P8 top-2 A128 skewed";
  c.P = 8;
  c.E_local = 2;
  c.k = 2;
  c.A = 128;
  c.C = 6;
  c.skew = 2.0;
  c.T = {20, 17, 3, 0, 25, 9, 30, 11};
  c.H = 128;
  c.seed = 3;
  run_case(c);
}

TEST(ExpertParallel, MapFormWithDrops) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 map A16";
  c.form = RoutingForm::kMap;
  c.P = 4;
  c.E_local = 2;
  c.k = 3;
  c.A = 16;
  c.C = 10;
  c.T = {30, 25, 0, 17};
  c.seed = 4;
  run_case(c);
}

TEST(ExpertParallel, Fp32RowsAndEveryAlignment) {
  MOE_REQUIRE_GPU();
  for (int A : {0, 16, 128}) {
    EpCase c;
    c.name = "P2 fp32 A" + std::to_string(A);
    c.P = 2;
    c.E_local = 4;
    c.k = 3;
    c.A = A;
    c.C = 20;
    c.T = {21, 14};
    c.H = 32;
    c.dt = DType::kFP32;
    c.seed = 5 + A;
    run_case(c);
  }
}

TEST(ExpertParallel, ZeroCapacityDropsEverything) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P2 C=0";
  c.P = 2;
  c.E_local = 2;
  c.k = 2;
  c.C = 0;
  c.T = {8, 5};
  c.seed = 6;
  run_case(c);
}

TEST(ExpertParallel, AllRanksEmpty) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 T=0 everywhere";
  c.P = 4;
  c.E_local = 2;
  c.k = 2;
  c.A = 16;
  c.C = 4;
  c.T = {0, 0, 0, 0};
  run_case(c);
}

// R_d smaller than the received groups: rows past it are not written and the bit is raised on the
// destination (the reference gives which); the data movement still matches the reference.
TEST(ExpertParallel, RowBoundOverflowFlagsTheDestination) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 R_d = 8";
  c.P = 4;
  c.E_local = 2;
  c.k = 2;
  c.C = 16;
  c.T = {16, 16, 16, 16};
  c.row_bound = 8;
  c.skew = 2.0;
  c.seed = 7;
  run_case(c, /*single_gpu_check=*/false);
}

// Bad routing entries on rank 1 only: skipped and flagged on rank 1, as the reference does.
TEST(ExpertParallel, BadRoutingIsFlaggedOnItsSource) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P2 bad routing on rank 1";
  c.P = 2;
  c.E_local = 2;
  c.k = 2;
  c.C = 64;
  c.T = {6, 6};
  InProcessWorld world(c.P);
  EpInputs in = make_ep_inputs(c, 9);
  in.routing[1].indices[0] = 7;                                   // out of range (E = 4)
  in.routing[1].indices[3] = in.routing[1].indices[2];            // duplicate in token 1
  in.routing[1].probs[4] = std::numeric_limits<double>::infinity();  // non-finite prob
  const std::vector<EpRankOut> out = run_ep_case(c, world.w, in, 109);
  check_against_reference(c, in, out);
  EXPECT_EQ(out[0].error_bits, 0u);
  EXPECT_EQ(out[1].error_bits, kErrExpertOutOfRange | kErrDuplicateExpert | kErrNonFiniteProb);
}

// Graph capture of dispatch, combine and both backwards on every rank; replay with new routing in
// the same buffers == an eager run of that routing, bit for bit. Then the dispatch alone, captured
// and replayed likewise, against the reference, its send / receive workspaces included (which the
// later ops overwrite, so the whole-step graph cannot show them).
TEST(ExpertParallel, GraphReplayWithNewRoutingMatchesEager) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 graph";
  c.P = 4;
  c.E_local = 2;
  c.k = 2;
  c.A = 16;
  c.C = 12;
  c.skew = 1.0;
  c.T = {24, 24, 24, 24};
  InProcessWorld world(c.P);
  const EpInputs a = make_ep_inputs(c, 11), b = make_ep_inputs(c, 12);

  // Backward inputs that do not depend on the layout (no NaN): the same bytes in both runs.
  auto fill_backward = [&](std::vector<EpRank>& ranks) {
    for (int p = 0; p < c.P; ++p) {
      EpRank& r = ranks[p];
      const int64_t R = r.ep->rows();
      r.Y.upload(encode(random_rows(R, c.H, c.dt, 50 + p), c.dt));
      r.d_x_perm.upload(encode(random_rows(R, c.H, c.dt, 60 + p), c.dt));
      r.dy.upload(encode(random_rows(r.T, c.H, c.dt, 70 + p), c.dt));
      const std::vector<double> dpp = random_rows(R, 1, DType::kFP32, 80 + p);
      r.d_probs_perm.upload(std::vector<float>(dpp.begin(), dpp.end()));
    }
  };

  std::vector<EpRank> eager = make_ranks(c, world.w, b);
  fill_backward(eager);
  enqueue_dispatch(c, world.w, eager);
  enqueue_combine_and_backward(c, world.w, eager);
  sync_world(world.w);
  std::vector<EpRankOut> want;
  download_dispatch(world.w, eager, want);
  download_backward(world.w, eager, want);

  std::vector<EpRank> graphed = make_ranks(c, world.w, a);
  fill_backward(graphed);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  // Relaxed: the ranks' threads launch into the capturing stream.
  MOE_CUDA_CHECK(cudaStreamBeginCapture(world.stream, cudaStreamCaptureModeRelaxed));
  enqueue_dispatch(c, world.w, graphed);
  enqueue_combine_and_backward(c, world.w, graphed);
  MOE_CUDA_CHECK(cudaStreamEndCapture(world.stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int p = 0; p < c.P; ++p) upload_routing(c, b, p, graphed[p]);
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, world.stream));
  sync_world(world.w);
  std::vector<EpRankOut> got;
  download_dispatch(world.w, graphed, got);
  download_backward(world.w, graphed, got);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  for (int p = 0; p < c.P; ++p) {
    const std::string at = "rank " + std::to_string(p);
    EXPECT_EQ(got[p].x_perm, want[p].x_perm) << at;
    EXPECT_EQ(got[p].send, want[p].send) << at;
    EXPECT_EQ(got[p].recv, want[p].recv) << at;
    EXPECT_EQ(got[p].probs_perm, want[p].probs_perm) << at;
    EXPECT_EQ(got[p].group_offsets, want[p].group_offsets) << at;
    EXPECT_EQ(got[p].slot_rows, want[p].slot_rows) << at;
    EXPECT_EQ(got[p].dropped, want[p].dropped) << at;
    EXPECT_EQ(got[p].error_bits, want[p].error_bits) << at;
    EXPECT_EQ(got[p].y, want[p].y) << at;
    EXPECT_EQ(got[p].dY, want[p].dY) << at;
    EXPECT_EQ(got[p].dx, want[p].dx) << at;
    expect_same_bytes(got[p].dprobs_combine.data(), want[p].dprobs_combine.data(),
                      want[p].dprobs_combine.size() * 4, at + " combine dprobs");
    expect_same_bytes(got[p].dprobs_dispatch.data(), want[p].dprobs_dispatch.data(),
                      want[p].dprobs_dispatch.size() * 4, at + " dispatch dprobs");
  }
  // The replayed routing is b's: the reference agrees (data movement). Not on the workspaces: both
  // runs read them after the dispatch backward, whose exchange they then hold (the same bytes in
  // both runs, compared above), no longer the dispatch's; x_perm and probs_perm, which the dispatch
  // made from them, are checked.
  check_against_reference(c, b, got, /*workspaces=*/false);

  // The dispatch alone, captured with a's routing in the buffers and replayed with b's: read right
  // after it, the workspaces hold its exchange, and they too equal the reference.
  for (int p = 0; p < c.P; ++p) upload_routing(c, a, p, graphed[p]);
  MOE_CUDA_CHECK(cudaStreamBeginCapture(world.stream, cudaStreamCaptureModeRelaxed));
  enqueue_dispatch(c, world.w, graphed);
  MOE_CUDA_CHECK(cudaStreamEndCapture(world.stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int p = 0; p < c.P; ++p) {
    upload_routing(c, b, p, graphed[p]);
    graphed[p].x_perm.fill_bytes(0x7f);  // the first replay's x_perm is the same: poison it
  }
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, world.stream));
  sync_world(world.w);
  std::vector<EpRankOut> fwd;
  download_dispatch(world.w, graphed, fwd);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (int p = 0; p < c.P; ++p) EXPECT_EQ(fwd[p].x_perm, want[p].x_perm) << "rank " << p << " dispatch graph x_perm";
  check_against_reference(c, b, fwd);
}

// Two micro-batches in flight on the same dispatchers (one state each): dispatch A, dispatch B,
// combine B, combine A (identity experts: Y = x_perm, merging the given probs) == each one alone.
TEST(ExpertParallel, MicroBatchesInFlightKeepTheirOwnState) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 in flight";
  c.P = 4;
  c.E_local = 2;
  c.k = 2;
  c.A = 16;
  c.C = 10;
  c.skew = 1.0;
  c.T = {20, 20, 9, 20};
  InProcessWorld world(c.P);
  const EpInputs a = make_ep_inputs(c, 41), b = make_ep_inputs(c, 42);
  const int S = c.slots();
  const int64_t row = c.H * elem_bytes(c.dt);

  // Dispatch then combine of one micro-batch on its own ranks; y per rank.
  auto combine = [&](std::vector<EpRank>& ranks, std::vector<SavedState>& states,
                     std::vector<DevBuf<uint8_t>>& x_perm, std::vector<DevBuf<uint8_t>>& y) {
    run_ranks(world.w, [&](int p) {
      EpRank& r = ranks[p];
      const TensorView probs(r.probs.get(), DType::kFP32, {r.T, S});
      r.ep->combine(states[p], rows_view(c, x_perm[p], r.ep->rows()), rows_view(c, y[p], r.T), MergeProbs::kGiven,
                    world.stream, &probs);
    });
  };
  auto dispatch = [&](std::vector<EpRank>& ranks, std::vector<SavedState>& states,
                      std::vector<DevBuf<uint8_t>>& x_perm) {
    run_ranks(world.w, [&](int p) {
      EpRank& r = ranks[p];
      r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), states[p],
                              rows_view(c, x_perm[p], r.ep->rows()), world.stream);
    });
  };
  auto buffers = [&](std::vector<EpRank>& ranks, bool per_token) {
    std::vector<DevBuf<uint8_t>> v;
    for (auto& r : ranks) v.emplace_back((per_token ? r.T : r.ep->rows()) * row);
    return v;
  };
  auto alone = [&](const EpInputs& in, std::vector<Bytes>& xp_out, std::vector<Bytes>& y_out) {
    std::vector<EpRank> ranks = make_ranks(c, world.w, in);
    std::vector<SavedState> states;
    for (auto& r : ranks) states.push_back(r.state);
    auto xp = buffers(ranks, false), y = buffers(ranks, true);
    dispatch(ranks, states, xp);
    combine(ranks, states, xp, y);
    sync_world(world.w);
    for (int p = 0; p < c.P; ++p) {
      xp_out.push_back(xp[p].download());
      y_out.push_back(y[p].download());
    }
  };
  std::vector<Bytes> xa, ya, xb, yb;
  alone(a, xa, ya);
  alone(b, xb, yb);

  // Both in flight on the same dispatchers: B's routing and x in buffers of its own.
  std::vector<EpRank> ranks = make_ranks(c, world.w, a);
  std::vector<EpRank> rb = make_ranks(c, world.w, b);  // only B's routing and x buffers are used
  std::vector<SavedState> sa, sb;
  for (int p = 0; p < c.P; ++p) {
    sa.push_back(ranks[p].state);
    sb.push_back(ranks[p].ep->new_state());  // B's state on A's dispatcher
  }
  auto xpa = buffers(ranks, false), ypa = buffers(ranks, true), xpb = buffers(ranks, false), ypb = buffers(ranks, true);
  run_ranks(world.w, [&](int p) {
    ranks[p].ep->plan_and_dispatch(routing_view(c, ranks[p]), rows_view(c, ranks[p].x, ranks[p].T),
                                   ranks[p].err->device_ptr(), sa[p], rows_view(c, xpa[p], ranks[p].ep->rows()),
                                   world.stream);
  });
  run_ranks(world.w, [&](int p) {  // B through A's dispatchers, its own state
    ranks[p].ep->plan_and_dispatch(routing_view(c, rb[p]), rows_view(c, rb[p].x, rb[p].T), ranks[p].err->device_ptr(),
                                   sb[p], rows_view(c, xpb[p], ranks[p].ep->rows()), world.stream);
  });
  run_ranks(world.w, [&](int p) {
    const TensorView probs(rb[p].probs.get(), DType::kFP32, {rb[p].T, S});
    ranks[p].ep->combine(sb[p], rows_view(c, xpb[p], ranks[p].ep->rows()), rows_view(c, ypb[p], rb[p].T),
                         MergeProbs::kGiven, world.stream, &probs);
  });
  run_ranks(world.w, [&](int p) {
    const TensorView probs(ranks[p].probs.get(), DType::kFP32, {ranks[p].T, S});
    ranks[p].ep->combine(sa[p], rows_view(c, xpa[p], ranks[p].ep->rows()), rows_view(c, ypa[p], ranks[p].T),
                         MergeProbs::kGiven, world.stream, &probs);
  });
  sync_world(world.w);
  for (int p = 0; p < c.P; ++p) {
    EXPECT_EQ(xpa[p].download(), xa[p]) << "rank " << p << " x_perm of A";
    EXPECT_EQ(xpb[p].download(), xb[p]) << "rank " << p << " x_perm of B";
    EXPECT_EQ(ypa[p].download(), ya[p]) << "rank " << p << " y of A";
    EXPECT_EQ(ypb[p].download(), yb[p]) << "rank " << p << " y of B";
  }
}

TEST(ExpertParallel, HostCheckedArguments) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.P = 2;
  c.T = {4, 4};
  InProcessGroup group(2);
  EpDispatcher ep(c.config(), group.endpoint(0));
  SavedState state = ep.new_state();
  ErrorWord err;
  DevBuf<float> probs(4 * 2);
  DevBuf<int32_t> idx(4 * 2);
  DevBuf<uint8_t> x(4 * c.H * 2), xp(ep.rows() * c.H * 2);
  RoutingView rv;
  rv.probs = TensorView(probs.get(), DType::kFP32, {4, 2});
  rv.indices = TensorView(idx.get(), DType::kInt32, {4, 2});
  const TensorView xv(x.get(), DType::kBF16, {4, c.H}), xpv(xp.get(), DType::kBF16, {ep.rows(), c.H});
  expect_error_naming([&] { ep.plan_and_dispatch(rv, xv, nullptr, state, xpv, nullptr); }, "error_word");
  expect_error_naming([&] { ep.plan_and_dispatch(rv, TensorView(x.get(), DType::kBF16, {3, c.H}), err.device_ptr(),
                                                  state, xpv, nullptr); }, "'x'");
  expect_error_naming([&] { ep.plan_and_dispatch(rv, xv, err.device_ptr(), state,
                                                  TensorView(xp.get(), DType::kBF16, {1, c.H}), nullptr); },
                      "x_perm");
  RoutingView bad = rv;
  bad.probs = TensorView(probs.get(), DType::kFP32, {8, 1});
  expect_error_naming([&] { ep.plan_and_dispatch(bad, xv, err.device_ptr(), state, xpv, nullptr); },
                      "routing.probs");
  // Never filled: the combine refuses the state.
  expect_error_naming([&] { ep.combine(state, xpv, xv, MergeProbs::kNone, nullptr); }, "state");
}

}  // namespace
}  // namespace moe
