// Expert parallelism over NCCL (moe::NcclTransport): one process drives every GPU (ncclCommInitAll,
// one host thread per rank), P = 2 and 4 ranks, one rank per GPU. Every output of every rank --
// send and receive buffers, x_perm, probs_perm, groups, drops, error bits, combine, both
// backwards -- must equal bit for bit the run of the same inputs over P ranks simulated on one GPU
// (InProcessGroup), which tests/gpu/test_expert_parallel.cu checks against the CPU reference.
// The overlapped pipeline (chunks > 1, a communication stream per rank beside its compute stream)
// with the row-local stand-in experts must equal the in-process overlapped run bit for bit, which
// tests/gpu/test_expert_parallel_overlap.cpp checks against the unchunked step, and its token-side
// outputs the unchunked step directly. The dropless eager mode (variable-size ncclSend / ncclRecv
// per peer) likewise against its in-process run, which tests/gpu/test_expert_parallel_dropless.cu
// checks against the reference.
// SKIPPED without NCCL in the build or with fewer GPUs than ranks. NVLink multicast (NVLS) is
// switched off before NCCL starts: it must never be used here.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/expert_parallel.h"
#include "support/ep_harness.h"
#include "support/ep_overlap_harness.h"
#include "support/gpu.h"

#if MOE_HAVE_NCCL
#include <nccl.h>
#endif

namespace moe {
namespace {

using namespace ::moe::testing;

using Runner = std::function<std::vector<EpRankOut>(const EpWorld&)>;

std::vector<EpRankOut> run_in_process(const EpCase& c, const EpInputs& in, uint64_t seed) {
  InProcessWorld world(c.P);
  return run_ep_case(c, world.w, in, seed);
}

#if MOE_HAVE_NCCL
// `run` on a world of c.P NCCL ranks, one per GPU, each with a compute and a communication stream.
std::vector<EpRankOut> run_nccl(const EpCase& c, const Runner& run) {
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // before NCCL initialises: no NVLink multicast
  std::vector<ncclComm_t> comms(c.P);
  std::vector<int> devices(c.P);
  for (int p = 0; p < c.P; ++p) devices[p] = p;
  const ncclResult_t st = ncclCommInitAll(comms.data(), c.P, devices.data());
  if (st != ncclSuccess) ADD_FAILURE() << "ncclCommInitAll: " << ncclGetErrorString(st);
  if (st != ncclSuccess) return {};
  EpWorld w;
  w.P = c.P;
  w.device = devices;
  std::vector<std::unique_ptr<NcclTransport>> transports;
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(p));
    cudaStream_t s = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    w.stream.push_back(s);
    cudaStream_t k = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&k, cudaStreamNonBlocking));
    w.comm.push_back(k);
    transports.push_back(std::make_unique<NcclTransport>(comms[p]));
    EXPECT_EQ(transports[p]->rank(), p);
    w.transport.push_back(transports[p].get());
  }
  std::vector<EpRankOut> out = run(w);
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(p));
    cudaStreamDestroy(w.stream[p]);
    cudaStreamDestroy(w.comm[p]);
    ncclCommDestroy(comms[p]);
  }
  MOE_CUDA_CHECK(cudaSetDevice(0));
  return out;
}
#endif

// Why P NCCL ranks cannot run here (no NCCL in the build, fewer GPUs than ranks); empty if they can.
std::string nccl_unavailable(int P) {
#if !MOE_HAVE_NCCL
  (void)P;
  return "built without NCCL: NcclTransport not tested";
#else
  int n = 0;
  MOE_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n >= P ? "" : std::to_string(P) + " ranks need " + std::to_string(P) + " GPUs, found " + std::to_string(n);
#endif
}

// concentrate: every entry on rank 0's experts (tests/support/ep_harness.h).
void run_both(const EpCase& c, bool concentrate = false) {
  MOE_REQUIRE_GPU();
  const std::string why = nccl_unavailable(c.P);
  if (!why.empty()) GTEST_SKIP() << why;
#if MOE_HAVE_NCCL
  EpInputs in = make_ep_inputs(c, c.seed);
  if (concentrate) concentrate_routing(c, in);
  const std::vector<EpRankOut> want = run_in_process(c, in, c.seed + 100);
  const std::vector<EpRankOut> got = run_nccl(c, [&](const EpWorld& w) { return run_ep_case(c, w, in, c.seed + 100); });
  ASSERT_EQ(got.size(), want.size());
  expect_same_outputs(got, want, c.name + " NCCL vs in-process");
#endif
}

// The overlapped step over NCCL against the in-process overlapped step (every output) and the
// in-process unchunked step (token-side outputs).
void run_overlapped(EpCase c) {
  MOE_REQUIRE_GPU();
  const std::string why = nccl_unavailable(c.P);
  if (!why.empty()) GTEST_SKIP() << why;
#if MOE_HAVE_NCCL
  const EpInputs in = make_ep_inputs(c, c.seed);
  std::vector<EpRankOut> want, base;
  {
    InProcessWorld world(c.P, /*own_compute_streams=*/true);
    want = run_layer_step(c, world.w, in, c.seed, EpPath::kOverlapped);
  }
  {
    EpCase one = c;
    one.chunks = 1;
    InProcessWorld world(c.P);
    base = run_layer_step(one, world.w, in, c.seed, EpPath::kStages);
  }
  const std::vector<EpRankOut> got =
      run_nccl(c, [&](const EpWorld& w) { return run_layer_step(c, w, in, c.seed, EpPath::kOverlapped); });
  ASSERT_EQ(got.size(), want.size());
  expect_same_outputs(got, want, c.name + " NCCL overlapped vs in-process overlapped");
  expect_same_token_outputs(got, base, c.name + " NCCL overlapped vs in-process unchunked");
#endif
}

EpCase nccl_case(int P, RoutingForm form) {
  EpCase c;
  c.name = "P" + std::to_string(P) + (form == RoutingForm::kTopK ? " top-k" : " map");
  c.form = form;
  c.P = P;
  c.E_local = 4;
  c.k = form == RoutingForm::kTopK ? 4 : 3;
  c.A = 16;
  c.C = 48;
  c.H = 256;
  c.skew = 1.5;  // some pairs overflow the capacity: drops and error bits are compared too
  c.seed = 20 + P;
  for (int p = 0; p < P; ++p) c.T.push_back(p == 1 ? 0 : 40 + 13 * p);  // rank 1 has no tokens
  return c;
}

TEST(ExpertParallelNccl, TwoRanksTopKMatchesInProcess) { run_both(nccl_case(2, RoutingForm::kTopK)); }
TEST(ExpertParallelNccl, TwoRanksMapMatchesInProcess) { run_both(nccl_case(2, RoutingForm::kMap)); }
TEST(ExpertParallelNccl, FourRanksTopKMatchesInProcess) { run_both(nccl_case(4, RoutingForm::kTopK)); }
TEST(ExpertParallelNccl, FourRanksMapMatchesInProcess) { run_both(nccl_case(4, RoutingForm::kMap)); }

EpCase dropless_case(int P, RoutingForm form) {
  EpCase c = nccl_case(P, form);
  c.mode = EpMode::kDroplessEager;
  c.name += " dropless";
  return c;
}

// Skewed routing (past the capacity-mode cases' C = 48 on some pairs: here nothing drops), then
// every entry on rank 0 (its receive is the largest possible), rank 1 without tokens in both.
TEST(ExpertParallelNccl, TwoRanksDroplessMatchesInProcess) {
  run_both(dropless_case(2, RoutingForm::kTopK));
  run_both(dropless_case(2, RoutingForm::kTopK), /*concentrate=*/true);
  run_both(dropless_case(2, RoutingForm::kMap));
}
TEST(ExpertParallelNccl, FourRanksDroplessMatchesInProcess) {
  run_both(dropless_case(4, RoutingForm::kTopK));
  run_both(dropless_case(4, RoutingForm::kMap), /*concentrate=*/true);
}

// Too many rows for rank 0: every NCCL rank throws (none is left in a collective), then a routing
// that fits runs over the same communicators, equal to the in-process run.
TEST(ExpertParallelNccl, TwoRanksDroplessMaxRowsErrorThenUsable) {
  EpCase c = dropless_case(2, RoutingForm::kTopK);
  MOE_REQUIRE_GPU();
  const std::string why = nccl_unavailable(c.P);
  if (!why.empty()) GTEST_SKIP() << why;
#if MOE_HAVE_NCCL
  c.T = {40, 24};
  c.dropless_max_rows = 100;  // rank 0 would receive (40 + 24) * 4 = 256 rows concentrated
  EpInputs too_many = make_ep_inputs(c, 9);
  concentrate_routing(c, too_many);
  EpInputs fits = make_ep_inputs(c, 10);
  // Token t of each rank: two entries on rank t % 2 (experts 4 (t % 2) + s), its other slots
  // empty: (20 + 12) * 2 = 64 rows per destination.
  for (int p = 0; p < c.P; ++p)
    for (int64_t t = 0; t < c.T[p]; ++t)
      for (int s = 0; s < c.k; ++s)
        fits.routing[p].indices[t * c.k + s] = s < 2 ? static_cast<int32_t>(4 * (t % 2) + s) : -1;
  const std::vector<EpRankOut> want = run_in_process(c, fits, 111);
  const std::vector<EpRankOut> got = run_nccl(c, [&](const EpWorld& w) {
    std::vector<EpRank> ranks = make_ranks(c, w, too_many);
    std::atomic<int> failures{0};
    run_ranks(w, [&](int p) {
      try {
        EpRank& r = ranks[p];
        r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state,
                                rows_view(c, r.x_perm, r.ep->rows()), w.stream[p]);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("dropless_max_rows"), std::string::npos) << e.what();
        ++failures;
      }
    });
    EXPECT_EQ(failures.load(), c.P);
    sync_world(w);
    return run_ep_case(c, w, fits, 111);
  });
  ASSERT_EQ(got.size(), want.size());
  expect_same_outputs(got, want, c.name + " after the max-rows error, NCCL vs in-process");
#endif
}

EpCase overlap_case(int P, int chunks, RoutingForm form) {
  EpCase c = nccl_case(P, form);
  c.chunks = chunks;  // C = 48: 3 chunks of 16 rows per pair, or 5 of 9 or 10
  c.name += " " + std::to_string(chunks) + " chunks overlapped";
  return c;
}

TEST(ExpertParallelNccl, TwoRanksOverlappedMatchesInProcess) {
  run_overlapped(overlap_case(2, 3, RoutingForm::kTopK));
  run_overlapped(overlap_case(2, 5, RoutingForm::kMap));
}
TEST(ExpertParallelNccl, FourRanksOverlappedMatchesInProcess) {
  run_overlapped(overlap_case(4, 3, RoutingForm::kTopK));
}

}  // namespace
}  // namespace moe
