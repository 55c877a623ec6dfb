// The chunked, overlapped expert-parallel pipeline (EpDispatcherConfig::chunks,
// EpDispatcher::forward_overlapped / backward_overlapped; docs/expert_parallel.md, Overlapped
// pipeline), P ranks simulated on one GPU:
//   - the chunk layout and each chunk's local stage against the CPU reference, bitwise: the send
//     and receive buffers are the reference's capacity buffers with every row moved to its place in
//     the chunk layout, and block j of x_perm (with its probs, group offsets and counts) is the
//     single-GPU reference dispatch of chunk j's received rows; drops and error bits as unchunked;
//   - a whole layer step with row-local stand-in experts (support/ep_fake_experts.h): chunked
//     stage by stage, and chunked overlapped (each rank computing on its own stream, the copies on
//     the shared one), give y, dx and both dprobs bit for bit equal to the unchunked step, the same
//     drop counts and error bits (skewed routing overflows the capacity), and the two chunked paths
//     the same x_perm, dY and per-chunk views;
//   - the same with moe::GroupedExperts (each output row and its activation gradients are a K-loop
//     over H or F of that row alone, with a tile configuration chosen from (N, K) only: no row's
//     result depends on the other rows of its group); weight gradients sum over a chunk's rows, so
//     they are within the layer tests' tolerance, and whether they are bitwise is printed;
//   - graph capture of the overlapped step on every rank (compute streams forked from one origin
//     stream), replayed with new routing, equal to an eager run bitwise;
//   - argument errors naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ep/chunk_layout.h"
#include "moe/device_errors.h"
#include "moe/expert_parallel.h"
#include "moe/grouped_experts.h"
#include "moe/grouped_mlp_config.h"
#include "reference/dispatch_ref.h"
#include "reference/ep_dispatch_ref.h"
#include "support/ep_harness.h"
#include "support/ep_overlap_harness.h"
#include "support/expect_error.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using namespace ::moe::testing;

// P ranks, E_local = 3, top-k 4, A = 16, skewed routing (some pairs overflow C), rank 1 without
// tokens.
EpCase overlap_case(int P, int chunks, int64_t C, uint64_t seed, RoutingForm form = RoutingForm::kTopK,
                    DType dt = DType::kBF16) {
  EpCase c;
  c.name = "P" + std::to_string(P) + " n" + std::to_string(chunks) + " C" + std::to_string(C) +
           (form == RoutingForm::kTopK ? " top-k" : " map") + " " + dtype_name(dt);
  c.form = form;
  c.P = P;
  c.E_local = 3;
  c.k = form == RoutingForm::kTopK ? 4 : 3;
  c.A = 16;
  c.C = C;
  c.H = 64;
  c.dt = dt;
  c.skew = 1.5;
  c.seed = seed;
  c.chunks = chunks;
  for (int p = 0; p < P; ++p) c.T.push_back(p == 1 ? 0 : 50 + 11 * p);
  return c;
}

int64_t total_drops(const std::vector<EpRankOut>& out) {
  int64_t n = 0;
  for (const EpRankOut& o : out)
    for (int64_t d : o.dropped) n += d;
  return n;
}

// ---- the chunk layout and each chunk's local stage against the reference ----

std::vector<double> slice(const std::vector<double>& v, int64_t first, int64_t count) {
  return std::vector<double>(v.begin() + first, v.begin() + first + count);
}

void expect_same_values(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << ": first difference at " << i << ": got " << got[i] << ", want " << want[i];
      return;
    }
}

void check_chunks_against_reference(const EpCase& c, const EpInputs& in, const std::vector<EpRankOut>& out,
                                    int64_t Rc) {
  const ref::EpPlan plan = ref::plan_ep_dispatch(in.routing, c.ref_config());
  ref::RankBuffers send, send_probs, recv, recv_probs;
  ref::ep_pack(plan, in.x, c.H, send, send_probs);
  ref::ep_exchange(plan, send, c.H, recv);
  ref::ep_exchange(plan, send_probs, 1, recv_probs);
  const ep::ChunkLayout L{c.P, c.C, c.chunks};
  const int64_t H = c.H, PC = c.P * c.C;
  for (int p = 0; p < c.P; ++p) {
    const std::string at = c.name + " rank " + std::to_string(p);
    const EpRankOut& o = out[p];
    // The reference's capacity buffers (peer d's row q at d * C + q), each row moved to the chunk layout.
    std::vector<double> want_send(PC * H), want_recv(PC * H), want_send_probs(PC), want_recv_probs(PC);
    for (int d = 0; d < c.P; ++d)
      for (int64_t q = 0; q < c.C; ++q) {
        const int64_t from = d * c.C + q, to = L.row(d, q);
        for (int64_t h = 0; h < H; ++h) {
          want_send[to * H + h] = send[p][from * H + h];
          want_recv[to * H + h] = recv[p][from * H + h];
        }
        want_send_probs[to] = send_probs[p][from];
        want_recv_probs[to] = recv_probs[p][from];
      }
    expect_same_values(decode(o.send, c.dt), want_send, at + " send buffer");
    expect_same_values(decode(o.recv, c.dt), want_recv, at + " receive buffer");
    expect_same_values(to_double(o.send_probs), want_send_probs, at + " send probs");
    expect_same_values(to_double(o.recv_probs), want_recv_probs, at + " received probs");
    std::vector<int64_t> want_slot_rows;
    for (int64_t v : plan.send[p].slot_row) want_slot_rows.push_back(v < 0 ? -1 : L.row(v / c.C, v % c.C));
    EXPECT_EQ(std::vector<int64_t>(o.slot_rows.begin(), o.slot_rows.end()), want_slot_rows) << at << " slot rows";
    const std::vector<int64_t> drops(plan.dropped.begin() + p * c.P, plan.dropped.begin() + (p + 1) * c.P);
    EXPECT_EQ(o.dropped, drops) << at << " drop counts";
    EXPECT_EQ(o.error_bits, plan.error_bits[p]) << at << " error bits";

    // Chunk j: its received rows (source s, row q of s's block, in that order) as a top-k routing
    // with k = 1 over the local experts, dispatched by the single-GPU reference into R_c rows.
    const std::vector<double> x_perm = decode(o.x_perm, c.dt);
    ASSERT_EQ(static_cast<int64_t>(x_perm.size()), c.chunks * Rc * H) << at;
    for (int j = 0; j < c.chunks; ++j) {
      const std::string atj = at + " chunk " + std::to_string(j);
      const int64_t size = L.size(j), rows = c.P * size;
      ref::Routing rt;
      rt.form = RoutingForm::kTopK;
      rt.T = rows;
      rt.E = c.E_local;
      rt.k = 1;
      std::vector<double> x_rows(rows * H);
      for (int s = 0; s < c.P; ++s)
        for (int64_t i = 0; i < size; ++i) {
          const int64_t r = s * c.C + L.begin(j) + i, t = s * size + i;
          const int32_t src = plan.recv_rank[p][r];
          const int64_t slot = plan.recv_slot[p][r];
          rt.indices.push_back(src < 0 ? -1 : plan.slot_expert[src][slot] - p * c.E_local);
          rt.probs.push_back(recv_probs[p][r]);
          for (int64_t h = 0; h < H; ++h) x_rows[t * H + h] = recv[p][r * H + h];
        }
      DispatchOptions opts;
      opts.align = c.A;
      opts.row_bound = Rc;
      const ref::DispatchPlan lp = ref::plan_dispatch(rt, opts);
      std::vector<double> want_x(Rc * H), want_pp(Rc);
      ref::permute(lp, x_rows.data(), H, want_x.data(), want_pp.data());
      expect_same_values(slice(x_perm, j * Rc * H, Rc * H), want_x, atj + " x_perm block");
      expect_same_values(slice(to_double(o.probs_perm), j * Rc, Rc), want_pp, atj + " probs_perm");
      std::vector<int32_t> g(c.E_local + 1, 0);
      for (int e = 0; e < c.E_local; ++e) g[e + 1] = static_cast<int32_t>(std::min(lp.offset[e] + lp.padded[e], lp.R));
      const int64_t gb = j * (c.E_local + 1), cb = j * c.E_local;
      EXPECT_EQ(std::vector<int32_t>(o.group_offsets.begin() + gb, o.group_offsets.begin() + gb + c.E_local + 1), g)
          << atj << " group offsets";
      EXPECT_EQ(std::vector<int64_t>(o.counts.begin() + cb, o.counts.begin() + cb + c.E_local), lp.count)
          << atj << " local counts";
      EXPECT_EQ(lp.error_bits, 0u) << atj << ": the default R_c never overflows";
    }
  }
}

TEST(ExpertParallelOverlap, ChunkLayoutAndLocalStagesMatchReference) {
  MOE_REQUIRE_GPU();
  std::vector<EpCase> cases;
  for (int P : {2, 4})
    for (int n : {1, 2, 4}) cases.push_back(overlap_case(P, n, P == 2 ? 96 : 48, 10 + P * 10 + n));
  cases.push_back(overlap_case(4, 4, 45, 71));  // uneven chunks: 11, 11, 11, 12 rows per pair
  cases.push_back(overlap_case(2, 3, 40, 72, RoutingForm::kMap));
  cases.push_back(overlap_case(2, 2, 64, 73, RoutingForm::kTopK, DType::kFP32));
  for (const EpCase& c : cases) {
    SCOPED_TRACE(c.name);
    const EpInputs in = make_ep_inputs(c, c.seed);
    InProcessWorld world(c.P);
    std::vector<EpRank> ranks = make_ranks(c, world.w, in);
    const ep::ChunkLayout L{c.P, c.C, c.chunks};
    const int64_t Rc = ranks[0].ep->chunk_rows();
    EXPECT_EQ(Rc, c.P * L.max_size() + c.E_local * (c.A - 1));
    EXPECT_EQ(ranks[0].ep->rows(), c.chunks * Rc);
    EXPECT_EQ(ranks[0].ep->state_headers(), 1 + c.chunks);
    enqueue_dispatch(c, world.w, ranks);
    sync_world(world.w);
    std::vector<EpRankOut> out;
    download_dispatch(world.w, ranks, out);
    check_chunks_against_reference(c, in, out, Rc);
    if (c.form == RoutingForm::kTopK) EXPECT_GT(total_drops(out), 0) << "the case should overflow the capacity";
  }
}

// ---- a layer step with row-local experts: chunked == unchunked ----

TEST(ExpertParallelOverlap, ChunkedAndOverlappedStepsMatchUnchunked) {
  MOE_REQUIRE_GPU();
  std::vector<EpCase> cases;
  for (int P : {2, 4})
    for (int n : {1, 2, 4}) cases.push_back(overlap_case(P, n, P == 2 ? 96 : 48, 30 + P * 10 + n));
  cases.push_back(overlap_case(4, 4, 45, 81));
  cases.push_back(overlap_case(2, 3, 40, 82, RoutingForm::kMap));
  cases.push_back(overlap_case(2, 4, 64, 83, RoutingForm::kTopK, DType::kFP32));
  for (const EpCase& c : cases) {
    SCOPED_TRACE(c.name);
    const EpInputs in = make_ep_inputs(c, c.seed);
    EpCase one = c;
    one.chunks = 1;
    std::vector<EpRankOut> base, staged, overlapped;
    {
      InProcessWorld world(c.P);
      base = run_layer_step(one, world.w, in, c.seed, EpPath::kStages);
    }
    {
      InProcessWorld world(c.P);
      staged = run_layer_step(c, world.w, in, c.seed, EpPath::kStages);
    }
    {
      InProcessWorld world(c.P, /*own_compute_streams=*/true);
      overlapped = run_layer_step(c, world.w, in, c.seed, EpPath::kOverlapped);
    }
    expect_same_token_outputs(staged, base, c.name + " chunked stages vs unchunked");
    expect_same_token_outputs(overlapped, base, c.name + " overlapped vs unchunked");
    expect_same_outputs(overlapped, staged, c.name + " overlapped vs chunked stages");
    if (c.form == RoutingForm::kTopK) EXPECT_GT(total_drops(base), 0) << "the case should overflow the capacity";
  }
}

// ---- with moe::GroupedExperts ----

// Rank p's experts (its slice of the same weights) with fp32 main_grad accumulation (a chunked
// backward calls the experts' backward once per chunk), and one saved state per chunk.
struct RankExperts {
  std::unique_ptr<GroupedExperts> ex;
  std::vector<SavedState> states;
  layer_data::DeviceParam G1, G2, GB1, GB2;
};

TEST(ExpertParallelOverlap, GroupedExpertsChunkedMatchesUnchunked) {
  MOE_REQUIRE_GPU();
  using namespace ::moe::testing::layer_data;
  const int El = 2;
  const int64_t H = 128, F = 64;
  const DType bf = DType::kBF16;
  const WeightLayout L = WeightLayout::kSingleGrouped;
  for (int P : {2, 4}) {
    const int E = P * El;
    ExpertsConfig ec;
    ec.hidden = H;
    ec.ffn = F;
    ec.experts = El;
    ec.bias = true;
    ec.probs = ProbsPlacement::kInActivation;
    ec.wgrad = WgradMode::kAccumulate;
    const int64_t F1 = ec.fc1_out();
    std::mt19937_64 rng(91 + P);
    const auto w1 = random_bf16_values(size_t(E) * F1 * H, 1.0 / std::sqrt(double(H)), rng);
    const auto w2 = random_bf16_values(size_t(E) * H * F, 1.0 / std::sqrt(double(F)), rng);
    const auto b1 = random_bf16_values(size_t(E) * F1, 0.1, rng);
    const auto b2 = random_bf16_values(size_t(E) * H, 0.1, rng);
    auto W1 = make_param(w1, E, {F1, H}, bf, L), W2 = make_param(w2, E, {H, F}, bf, L);
    auto B1 = make_param(b1, E, {F1}, bf, L), B2 = make_param(b2, E, {H}, bf, L);
    auto zeros = [](size_t n) { return std::vector<double>(n, 0.0); };

    // One run: y, dx, dprobs and every rank's weight gradients (concatenated in rank order).
    struct Run {
      std::vector<EpRankOut> out;
      std::vector<double> dw1, dw2, db1, db2;
    };
    auto run = [&](const EpCase& c, EpPath path) {
      InProcessWorld world(c.P, path == EpPath::kOverlapped);
      std::vector<RankExperts> rx(c.P);
      std::vector<EpExperts> fns(c.P);
      EpDispatcher probe(c.config(), world.group->endpoint(0));  // R_c of this configuration
      for (int p = 0; p < c.P; ++p) {
        RankExperts& r = rx[p];
        ExpertsConfig e = ec;
        e.max_rows = probe.chunk_rows();
        r.ex = std::make_unique<GroupedExperts>(e);
        for (int j = 0; j < c.chunks; ++j) r.states.push_back(r.ex->new_state());
        r.G1 = make_param(zeros(size_t(El) * F1 * H), El, {F1, H}, DType::kFP32, L);
        r.G2 = make_param(zeros(size_t(El) * H * F), El, {H, F}, DType::kFP32, L);
        r.GB1 = make_param(zeros(size_t(El) * F1), El, {F1}, DType::kFP32, L);
        r.GB2 = make_param(zeros(size_t(El) * H), El, {H}, DType::kFP32, L);
        const int64_t e0 = int64_t{p} * El;
        r.ex->set_weights({{layer_data::expert_slice(W1, e0, {El, F1, H}, bf)},
                           {layer_data::expert_slice(B1, e0, {El, F1}, bf)},
                           {layer_data::expert_slice(W2, e0, {El, H, F}, bf)},
                           {layer_data::expert_slice(B2, e0, {El, H}, bf)}});
        r.ex->set_grads({r.G1.views, r.GB1.views, r.G2.views, r.GB2.views});
        GroupedExperts* ex = r.ex.get();
        std::vector<SavedState>* st = &r.states;
        fns[p].forward = [ex, st](const EpChunk& ch, cudaStream_t s) {
          ex->forward(ch.in, ch.group_offsets, ch.probs_perm, ch.out, (*st)[ch.index], s);
        };
        fns[p].backward = [ex, st](const EpChunk& ch, cudaStream_t s) {
          ex->backward(ch.in, ch.out, ch.d_probs_perm, (*st)[ch.index], s);
        };
      }
      Run result;
      result.out = run_layer_step(c, world.w, make_ep_inputs(c, c.seed), c.seed, path, fns);
      for (int p = 0; p < c.P; ++p) {
        auto append = [](std::vector<double>& to, const std::vector<double>& from) {
          to.insert(to.end(), from.begin(), from.end());
        };
        append(result.dw1, download_param(rx[p].G1, DType::kFP32));
        append(result.dw2, download_param(rx[p].G2, DType::kFP32));
        append(result.db1, download_param(rx[p].GB1, DType::kFP32));
        append(result.db2, download_param(rx[p].GB2, DType::kFP32));
      }
      return result;
    };

    EpCase c;
    c.P = P;
    c.E_local = El;
    c.k = 2;
    c.A = 16;
    c.H = H;
    c.C = 64;
    c.skew = 1.0;
    c.seed = 101 + P;
    for (int p = 0; p < P; ++p) c.T.push_back(p == 1 ? 0 : 40 + 9 * p);
    c.chunks = 1;
    c.name = "P" + std::to_string(P) + " experts unchunked";
    const Run base = run(c, EpPath::kStages);
    for (const EpRankOut& o : base.out) EXPECT_EQ(o.error_bits & ~uint32_t{kErrRowOverflow}, 0u);
    for (int n : {2, 4}) {
      c.chunks = n;
      c.name = "P" + std::to_string(P) + " experts n" + std::to_string(n);
      SCOPED_TRACE(c.name);
      const Run got = run(c, EpPath::kOverlapped);
      expect_same_token_outputs(got.out, base.out, c.name + " overlapped vs unchunked");
      expect_close(got.dw1, base.dw1, "fc1.weight grad");
      expect_close(got.dw2, base.dw2, "fc2.weight grad");
      expect_close(got.db1, base.db1, "fc1.bias grad");
      expect_close(got.db2, base.db2, "fc2.bias grad");
      const bool bitwise = got.dw1 == base.dw1 && got.dw2 == base.dw2 && got.db1 == base.db1 && got.db2 == base.db2;
      std::cout << "[ info ] " << c.name << ": weight and bias gradients bitwise equal to unchunked: "
                << (bitwise ? "yes" : "no") << "\n";
    }
  }
}

// ---- graph capture ----

TEST(ExpertParallelOverlap, GraphReplayWithNewRoutingMatchesEager) {
  MOE_REQUIRE_GPU();
  const EpCase c = overlap_case(4, 4, 48, 61);
  const EpInputs a = make_ep_inputs(c, c.seed), b = make_ep_inputs(c, c.seed + 1);
  std::vector<EpRankOut> want;
  {
    InProcessWorld world(c.P, true);
    want = run_layer_step(c, world.w, b, c.seed, EpPath::kOverlapped);
  }
  InProcessWorld world(c.P, true);
  std::vector<EpRank> ranks = make_ranks(c, world.w, a);
  upload_keyed_dy(c, world.w, ranks, c.seed);
  cudaStream_t origin = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&origin, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> events(c.P + 2);
  for (cudaEvent_t& e : events) MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  // Relaxed: the ranks' threads launch into the captured streams.
  MOE_CUDA_CHECK(cudaStreamBeginCapture(origin, cudaStreamCaptureModeRelaxed));
  MOE_CUDA_CHECK(cudaEventRecord(events[0], origin));
  for (int p = 0; p < c.P; ++p) MOE_CUDA_CHECK(cudaStreamWaitEvent(world.w.stream[p], events[0], 0));
  run_ranks(world.w, [&](int p) { enqueue_layer_step(c, world.w, ranks[p], p, EpPath::kOverlapped, {}); });
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaEventRecord(events[1 + p], world.w.stream[p]));
    MOE_CUDA_CHECK(cudaStreamWaitEvent(origin, events[1 + p], 0));
  }
  // The shared communication stream is joined into every rank's stream by the pipeline already;
  // joined here too, so that the capture ends with every stream that took part joined.
  MOE_CUDA_CHECK(cudaEventRecord(events[c.P + 1], world.stream));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(origin, events[c.P + 1], 0));
  MOE_CUDA_CHECK(cudaStreamEndCapture(origin, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int p = 0; p < c.P; ++p) {
    upload_routing(c, b, p, ranks[p]);
    for (auto* buf : {&ranks[p].x_perm, &ranks[p].y, &ranks[p].dY, &ranks[p].dx}) buf->fill_bytes(0x7f);
    ranks[p].dprobs_combine.fill_bytes(0x7f);
    ranks[p].dprobs_dispatch.fill_bytes(0x7f);
  }
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, origin));
  MOE_CUDA_CHECK(cudaStreamSynchronize(origin));
  const std::vector<EpRankOut> got = download_layer_step(world.w, ranks);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (cudaEvent_t e : events) cudaEventDestroy(e);
  cudaStreamDestroy(origin);
  expect_same_outputs(got, want, c.name + " graph replay with new routing vs eager");
  EXPECT_GT(total_drops(got), 0) << "the case should overflow the capacity";
}

// ---- argument errors ----

TEST(ExpertParallelOverlap, ArgumentErrorsNameTheArgument) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.P = 1;
  c.E_local = 2;
  c.k = 2;
  c.C = 8;
  c.H = 64;
  c.T = {6};
  c.chunks = 2;
  const EpInputs in = make_ep_inputs(c, 5);
  InProcessWorld world(1);
  std::vector<EpRank> ranks = make_ranks(c, world.w, in);
  EpRank& r = ranks[0];
  const cudaStream_t s = world.stream;
  const int64_t R = r.ep->rows();
  const TensorView x = rows_view(c, r.x, r.T), x_perm = rows_view(c, r.x_perm, R), Y = rows_view(c, r.Y, R);
  const TensorView y = rows_view(c, r.y, r.T);
  auto forward = [&](const TensorView& Yv, const EpChunkFn& fn) {
    r.ep->forward_overlapped(routing_view(c, r), x, r.err->device_ptr(), r.state, x_perm, Yv, y, MergeProbs::kNone,
                             fn, s, s);
  };
  expect_error_naming([&] { forward(Y, EpChunkFn{}); }, "'experts'");
  expect_error_naming([&] { forward(rows_view(c, r.Y, R - 1), fake_experts_forward); }, "'Y'");
  forward(Y, fake_experts_forward);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  expect_error_naming([&] { r.ep->group_offsets(r.state, 2); }, "'chunk'");
  expect_error_naming([&] { r.ep->probs_perm(r.state, -1); }, "'chunk'");
  const TensorView dY = rows_view(c, r.dY, R), dxp = rows_view(c, r.d_x_perm, R), dx = rows_view(c, r.dx, r.T);
  expect_error_naming(
      [&] { r.ep->backward_overlapped(r.state, rows_view(c, r.dy, r.T), dY, dxp, dx, MergeProbs::kNone, {}, s, s); },
      "'experts_backward'");
  EpBackwardOptions opt;
  const TensorView dpc(r.dprobs_combine.get(), DType::kFP32, {r.T, c.slots()});
  opt.dprobs_combine = &dpc;
  expect_error_naming(
      [&] {
        r.ep->backward_overlapped(r.state, rows_view(c, r.dy, r.T), dY, dxp, dx, MergeProbs::kPlanned,
                                  fake_experts_backward, s, s, opt);
      },
      "'Y'");
}

}  // namespace
}  // namespace moe
