// The dropless eager mode of moe::EpDispatcher (EpMode::kDroplessEager, docs/expert_parallel.md),
// P in {2, 4, 8} ranks simulated on one GPU (InProcessGroup), against the CPU reference with no
// capacity (capacity = -1: nothing dropped, send and receive buffers packed back to back) and the
// single-GPU moe::Dispatcher of all ranks' tokens, bitwise (tests/support/ep_checks.h). Routing that
// sends every token to one expert (no capacity short of all the tokens would hold it), ranks with
// no tokens, the map form; the refusal of every method inside a CUDA graph capture; the
// dropless_max_rows error on every rank, after which the dispatchers still work; two micro-batches
// in flight, each with its own host counts in its state.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moe/device_errors.h"
#include "moe/expert_parallel.h"
#include "support/ep_checks.h"
#include "support/ep_harness.h"
#include "support/expect_error.h"
#include "support/gpu.h"

namespace moe {
namespace {

using namespace ::moe::testing;

EpCase dropless_case(const std::string& name, int P, std::vector<int64_t> T) {
  EpCase c;
  c.name = name;
  c.mode = EpMode::kDroplessEager;
  c.P = P;
  c.E_local = 4;
  c.k = 3;
  c.A = 16;
  c.C = 0;  // unused in dropless mode
  c.T = std::move(T);
  c.seed = 30 + P;
  return c;
}

// The run, both checks, and what dropless promises on top: no drops, no overflow bit, every entry
// of every source received somewhere (the received rows sum to the valid entries sent).
void run_dropless(const EpCase& c, bool concentrate) {
  SCOPED_TRACE(c.name);
  InProcessWorld world(c.P);
  EpInputs in = make_ep_inputs(c, c.seed);
  if (concentrate) concentrate_routing(c, in);
  const std::vector<EpRankOut> out = run_ep_case(c, world.w, in, c.seed + 100);
  check_against_reference(c, in, out);
  check_against_single_gpu(c, in, out, c.seed + 100);
  const ref::EpPlan plan = ref::plan_ep_dispatch(in.routing, c.ref_config());
  EXPECT_EQ(plan.total_dropped(), 0);
  int64_t sent = 0, received = 0;
  for (int p = 0; p < c.P; ++p) {
    for (int64_t d : out[p].dropped) EXPECT_EQ(d, 0) << "rank " << p;
    EXPECT_EQ(out[p].error_bits & kErrRowOverflow, 0u) << "rank " << p;
    for (int32_t r : out[p].slot_rows) sent += r >= 0;
    received += static_cast<int64_t>(out[p].recv_probs.size());
  }
  EXPECT_EQ(received, sent);
}

TEST(ExpertParallelDropless, RandomRoutingMatchesReferenceAndSingleGpu) {
  MOE_REQUIRE_GPU();
  run_dropless(dropless_case("P2 skewed", 2, {40, 33}), false);
  EpCase c = dropless_case("P4 skewed, T=0 on rank 2", 4, {37, 20, 0, 51});
  c.skew = 2.0;
  run_dropless(c, false);
  c = dropless_case("P8 A128, T=0 on ranks 0 and 5", 8, {0, 9, 30, 14, 22, 0, 17, 25});
  c.A = 128;
  c.E_local = 2;
  c.k = 2;
  c.skew = 1.0;
  run_dropless(c, false);
}

// Every token of every rank on rank 0's experts, expert 0 in each: rank 0 receives every entry.
TEST(ExpertParallelDropless, EverythingToOneExpertIsNeverDropped) {
  MOE_REQUIRE_GPU();
  run_dropless(dropless_case("P2 all to expert 0", 2, {64, 48}), true);
  run_dropless(dropless_case("P4 all to expert 0, T=0 on rank 1", 4, {50, 0, 31, 64}), true);
  EpCase c = dropless_case("P8 all to expert 0, T=0 on ranks 3 and 6", 8, {20, 17, 3, 0, 25, 9, 0, 11});
  c.A = 0;
  c.H = 128;
  run_dropless(c, true);
}

TEST(ExpertParallelDropless, MapForm) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P4 map", 4, {30, 25, 0, 17});
  c.form = RoutingForm::kMap;
  c.E_local = 2;
  c.k = 3;
  run_dropless(c, false);
  c.name = "P4 map, expert 0 in every token";
  run_dropless(c, true);
}

TEST(ExpertParallelDropless, Fp32RowsAndEveryAlignment) {
  MOE_REQUIRE_GPU();
  for (int A : {0, 16, 128}) {
    EpCase c = dropless_case("P2 fp32 A" + std::to_string(A), 2, {21, 14});
    c.A = A;
    c.H = 32;
    c.dt = DType::kFP32;
    c.seed = 40 + A;
    run_dropless(c, A == 16);
  }
}

// A caller-given bound that holds this routing: the receive buffer and x_perm sized for it.
TEST(ExpertParallelDropless, GivenMaxRowsThatHolds) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P4 dropless_max_rows = 200", 4, {50, 0, 31, 64});
  c.dropless_max_rows = (50 + 31 + 64) * c.k;  // exactly rank 0's rows when everything goes there
  run_dropless(c, true);
}

// fn(p) on every rank; how many ranks threw a moe::Error naming `needle`.
int count_errors(const EpWorld& w, const std::function<void(int)>& fn, const std::string& needle) {
  std::atomic<int> n{0};
  run_ranks(w, [&](int p) {
    try {
      fn(p);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      ++n;
    }
  });
  return n.load();
}

// More rows for rank 0 than dropless_max_rows: every rank throws (they all see the whole count
// matrix, so none waits in a collective), no row has moved and the states are left empty; the
// dispatchers then dispatch a routing that fits, equal to the reference.
TEST(ExpertParallelDropless, MaxRowsErrorOnEveryRankThenUsable) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P4 bound 40", 4, {16, 16, 0, 16});
  c.E_local = 2;
  c.k = 2;
  c.dropless_max_rows = 40;
  InProcessWorld world(c.P);
  EpInputs all_to_0 = make_ep_inputs(c, 3);
  concentrate_routing(c, all_to_0);  // rank 0 would receive 3 * 16 * 2 = 96 rows
  std::vector<EpRank> ranks = make_ranks(c, world.w, all_to_0);
  EXPECT_EQ(ranks[0].ep->dropless_max_rows(), 40);
  EXPECT_EQ(ranks[0].ep->rows(), 40 + 2 * 15);
  const int failures = count_errors(world.w, [&](int p) {
    EpRank& r = ranks[p];
    r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state,
                            rows_view(c, r.x_perm, r.ep->rows()), world.stream);
  }, "dropless_max_rows");
  EXPECT_EQ(failures, c.P);
  EXPECT_FALSE(world.group->aborted());
  for (int p = 0; p < c.P; ++p) {
    EXPECT_EQ(ranks[p].state.status(), StateStatus::kEmpty) << "rank " << p;
    expect_error_naming([&] { ranks[p].ep->tokens(ranks[p].state); }, "state");
  }
  sync_world(world.w);

  // Token t of each rank sends both entries to rank t % 4: rank d receives 2 * 2 * (tokens t = d
  // mod 4 of 3 ranks) = 4 * 3 * 2 = 24 rows <= 40.
  EpInputs fits = make_ep_inputs(c, 4);
  for (int p = 0; p < c.P; ++p)
    for (int64_t t = 0; t < c.T[p]; ++t)
      for (int s = 0; s < c.k; ++s) fits.routing[p].indices[t * c.k + s] = static_cast<int32_t>(2 * (t % 4) + s);
  for (int p = 0; p < c.P; ++p) upload_routing(c, fits, p, ranks[p]);
  for (auto& r : ranks) r.x_perm.fill_bytes(0x7f);
  enqueue_dispatch(c, world.w, ranks);
  sync_world(world.w);
  std::vector<EpRankOut> out;
  download_dispatch(world.w, ranks, out);
  // Only the dispatch's outputs are filled: compare those (combine and backwards below).
  const ref::EpPlan plan = ref::plan_ep_dispatch(fits.routing, c.ref_config());
  ref::RankBuffers x_perm, probs_perm;
  ref::ep_dispatch(plan, fits.x, c.H, x_perm, probs_perm);
  for (int p = 0; p < c.P; ++p) {
    EXPECT_EQ(out[p].error_bits, 0u) << "rank " << p;
    expect_same(decode(out[p].x_perm, c.dt), x_perm[p], "rank " + std::to_string(p) + " x_perm");
    expect_same(to_double(out[p].probs_perm), probs_perm[p], "rank " + std::to_string(p) + " probs_perm");
  }
  // And the whole run of the fitting routing on fresh dispatchers of the same configuration.
  const std::vector<EpRankOut> whole = run_ep_case(c, world.w, fits, 77);
  check_against_reference(c, fits, whole);
  check_against_single_gpu(c, fits, whole, 77);
}

// Inside a capture (the shared stream, relaxed mode) every method refuses, naming the stream,
// before any work or collective; the capture ends empty. Outside it, the same calls work.
TEST(ExpertParallelDropless, GraphCaptureIsRefused) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P2 capture", 2, {12, 9});
  InProcessWorld world(c.P);
  const EpInputs in = make_ep_inputs(c, 5);
  std::vector<EpRank> ranks = make_ranks(c, world.w, in);
  auto capture_refuses = [&](const std::function<void(int)>& call, const char* what) {
    MOE_CUDA_CHECK(cudaStreamBeginCapture(world.stream, cudaStreamCaptureModeRelaxed));
    const int failures = count_errors(world.w, call, "'stream'");
    cudaGraph_t graph = nullptr;
    MOE_CUDA_CHECK(cudaStreamEndCapture(world.stream, &graph));
    size_t nodes = 0;
    MOE_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    cudaGraphDestroy(graph);
    EXPECT_EQ(failures, c.P) << what;
    EXPECT_EQ(nodes, 0u) << what << ": work was captured before the refusal";
  };
  capture_refuses([&](int p) {
    EpRank& r = ranks[p];
    r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state,
                            rows_view(c, r.x_perm, r.ep->rows()), world.stream);
  }, "plan_and_dispatch");
  enqueue_dispatch(c, world.w, ranks);  // eager: fine
  sync_world(world.w);
  const int64_t S = c.slots();
  capture_refuses([&](int p) {
    EpRank& r = ranks[p];
    r.ep->combine(r.state, rows_view(c, r.Y, r.ep->rows()), rows_view(c, r.y, r.T), MergeProbs::kPlanned,
                  world.stream);
  }, "combine");
  capture_refuses([&](int p) {
    EpRank& r = ranks[p];
    r.ep->combine_backward(r.state, rows_view(c, r.dy, r.T), rows_view(c, r.dY, r.ep->rows()), MergeProbs::kNone,
                           world.stream);
  }, "combine_backward");
  capture_refuses([&](int p) {
    EpRank& r = ranks[p];
    const TensorView dpd(r.dprobs_dispatch.get(), DType::kFP32, {r.T, S});
    r.ep->dispatch_backward(r.state, rows_view(c, r.d_x_perm, r.ep->rows()), rows_view(c, r.dx, r.T), world.stream,
                            nullptr, &dpd);
  }, "dispatch_backward");
  std::vector<EpRankOut> out;
  download_dispatch(world.w, ranks, out);
  upload_backward_inputs(c, world.w, ranks, out, 105);
  enqueue_combine_and_backward(c, world.w, ranks);  // eager: fine, and right
  sync_world(world.w);
  download_backward(world.w, ranks, out);
  check_against_reference(c, in, out);
  check_against_single_gpu(c, in, out, 105);
}

// Two micro-batches in flight on the same dispatchers, each state with its own counts: dispatch A,
// dispatch B, then B's combine and backwards, then A's == each run alone.
TEST(ExpertParallelDropless, MicroBatchesInFlightKeepTheirOwnCounts) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P4 in flight", 4, {20, 20, 9, 20});
  c.skew = 1.5;
  InProcessWorld world(c.P);
  EpInputs a = make_ep_inputs(c, 41);
  const EpInputs b = make_ep_inputs(c, 42);
  concentrate_routing(c, a);  // very different counts per pair from b's
  const std::vector<EpRankOut> want_a = run_ep_case(c, world.w, a, 141);
  const std::vector<EpRankOut> want_b = run_ep_case(c, world.w, b, 142);

  // B's buffers and inputs; B runs through A's dispatchers with a state of its own.
  std::vector<EpRank> ra = make_ranks(c, world.w, a), rb = make_ranks(c, world.w, b);
  for (int p = 0; p < c.P; ++p) rb[p].state = ra[p].ep->new_state();
  auto dispatch = [&](std::vector<EpRank>& rs, std::vector<EpRank>& owner) {
    run_ranks(world.w, [&](int p) {
      EpRank& r = rs[p];
      owner[p].ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state,
                                     rows_view(c, r.x_perm, owner[p].ep->rows()), world.stream);
    });
  };
  dispatch(ra, ra);
  dispatch(rb, ra);
  sync_world(world.w);
  std::vector<EpRankOut> got_a(c.P), got_b(c.P);
  for (int p = 0; p < c.P; ++p) {
    got_a[p].x_perm = ra[p].x_perm.download();
    got_b[p].x_perm = rb[p].x_perm.download();
    for (auto [r, o] : {std::pair{&ra[p], &got_a[p]}, std::pair{&rb[p], &got_b[p]}}) {
      o->group_offsets = download_view<int32_t>(ra[p].ep->group_offsets(r->state));
      o->counts = download_view<int32_t>(ra[p].ep->local_counts(r->state));
    }
  }
  upload_backward_inputs(c, world.w, ra, got_a, 141);
  upload_backward_inputs(c, world.w, rb, got_b, 142);
  auto backward = [&](std::vector<EpRank>& rs) {
    run_ranks(world.w, [&](int p) {
      EpRank& r = rs[p];
      EpDispatcher& ep = *ra[p].ep;
      const int64_t R = ep.rows(), S = c.slots();
      const TensorView Y = rows_view(c, r.Y, R);
      ep.combine(r.state, Y, rows_view(c, r.y, r.T), MergeProbs::kPlanned, world.stream);
      const TensorView dpc(r.dprobs_combine.get(), DType::kFP32, {r.T, S});
      ep.combine_backward(r.state, rows_view(c, r.dy, r.T), rows_view(c, r.dY, R), MergeProbs::kPlanned, world.stream,
                          nullptr, &Y, &dpc);
      const TensorView dpp(r.d_probs_perm.get(), DType::kFP32, {R});
      const TensorView dpd(r.dprobs_dispatch.get(), DType::kFP32, {r.T, S});
      ep.dispatch_backward(r.state, rows_view(c, r.d_x_perm, R), rows_view(c, r.dx, r.T), world.stream, &dpp, &dpd);
    });
  };
  backward(rb);
  backward(ra);
  sync_world(world.w);
  for (int p = 0; p < c.P; ++p) {
    const std::string at = "rank " + std::to_string(p);
    for (auto [r, want, name] : {std::tuple{&ra[p], &want_a[p], "A"}, std::tuple{&rb[p], &want_b[p], "B"}}) {
      EXPECT_EQ(r->x_perm.download(), want->x_perm) << at << " x_perm of " << name;
      EXPECT_EQ(r->y.download(), want->y) << at << " y of " << name;
      EXPECT_EQ(r->dY.download(), want->dY) << at << " dY of " << name;
      EXPECT_EQ(r->dx.download(), want->dx) << at << " dx of " << name;
      EXPECT_EQ(r->dprobs_combine.download(), want->dprobs_combine) << at << " combine dprobs of " << name;
      EXPECT_EQ(r->dprobs_dispatch.download(), want->dprobs_dispatch) << at << " dispatch dprobs of " << name;
    }
  }
}

TEST(ExpertParallelDropless, ViewsAndRefusedOverlappedPipeline) {
  MOE_REQUIRE_GPU();
  EpCase c = dropless_case("P2 views", 2, {10, 7});
  c.E_local = 2;
  c.k = 2;
  InProcessWorld world(c.P);
  EpInputs in = make_ep_inputs(c, 8);
  concentrate_routing(c, in);  // rank 0 receives every entry: 34 rows
  std::vector<EpRank> ranks = make_ranks(c, world.w, in);
  const EpDispatcher& ep = *ranks[0].ep;
  EXPECT_EQ(ep.mode(), EpMode::kDroplessEager);
  EXPECT_EQ(ep.dropless_max_rows(), 2 * 10 * 2);  // P * T_max * min(k, E_local)
  EXPECT_EQ(ep.exchange_rows(), 40);               // max(T_max * k, dropless_max_rows)
  EXPECT_EQ(ep.rows(), 40 + 2 * 15);
  EXPECT_EQ(ep.state_headers(), 3);                // 2 + ceil(P / 4)
  enqueue_dispatch(c, world.w, ranks);
  sync_world(world.w);
  EXPECT_EQ(ranks[0].ep->sent_rows(ranks[0].state), (std::vector<int64_t>{20, 0}));
  EXPECT_EQ(ranks[0].ep->received_rows(ranks[0].state), (std::vector<int64_t>{20, 14}));
  EXPECT_EQ(ranks[1].ep->sent_rows(ranks[1].state), (std::vector<int64_t>{14, 0}));
  EXPECT_EQ(ranks[1].ep->received_rows(ranks[1].state), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(ranks[1].ep->send_probs(ranks[1].state).numel(), 14);
  EpRank& r = ranks[0];
  const TensorView xp = rows_view(c, r.x_perm, r.ep->rows());
  const EpChunkFn none = [](const EpChunk&, cudaStream_t) {};
  expect_error_naming([&] {
    r.ep->forward_overlapped(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state, xp, xp,
                             rows_view(c, r.y, r.T), MergeProbs::kNone, none, world.stream, world.stream);
  }, "'mode'");
  expect_error_naming([&] {
    r.ep->backward_overlapped(r.state, rows_view(c, r.dy, r.T), xp, xp, rows_view(c, r.dx, r.T), MergeProbs::kNone,
                              none, world.stream, world.stream);
  }, "'mode'");
}

}  // namespace
}  // namespace moe
