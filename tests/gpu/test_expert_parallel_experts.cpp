// End to end: an expert-parallel MoE layer (EpDispatcher + GroupedExperts on each of P simulated
// ranks, rank r holding experts [r * E_local, (r + 1) * E_local) of the same weights) against
// moe::GroupedMlp holding all E experts on all ranks' tokens concatenated in rank order, forward
// and backward, with no capacity drops.
//
// Bounds, and why:
//   - y, dx, dprobs: bitwise. Each expert group of x_perm holds the same rows in the same order
//     with the same zero pad rows on both sides (docs/expert_parallel.md, equivalence with one
//     GPU), fc1 / activation / fc2 and their dgrads are per-row computations of the same kernels
//     (each output element a K-loop over H or F in the same order whatever the tile shape), and
//     both combines sum a token's rows in slot order in fp32.
//   - weight and bias gradients: a reduction over the rows of a group. The rows and their order are
//     the same, but the GEMM configuration is picked from the whole problem (E groups vs E_local
//     groups, all rows vs this rank's), so the bound asserted is the layer tests' tolerance against
//     each other (relative L2 <= 1e-2, max error <= 5e-2 * max|ref|: tests/support/layer_data.h);
//     whether they are also bitwise is printed.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "moe/expert_parallel.h"
#include "moe/grouped_experts.h"
#include "moe/grouped_mlp.h"
#include "support/ep_harness.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using namespace ::moe::testing;
using namespace ::moe::testing::layer_data;
template <typename T>
using DevBuf = ::moe::testing::DeviceBuffer<T>;

TEST(ExpertParallelExperts, MatchesGroupedMlpOnConcatenatedTokens) {
  MOE_REQUIRE_GPU();
  EpCase c;
  c.name = "P4 experts";
  c.P = 4;
  c.E_local = 2;
  c.k = 2;
  c.A = 16;
  c.H = 128;
  c.T = {48, 0, 37, 64};
  c.C = 200;  // >= every pair's entries: nothing is dropped
  c.seed = 31;
  const int E = c.E(), El = c.E_local, S = c.slots();
  const int64_t H = c.H, F = 64;
  const EpInputs in = make_ep_inputs(c, c.seed);
  int64_t T_all = 0;
  for (int64_t t : c.T) T_all += t;

  GroupedMlpConfig mc;
  mc.hidden = H;
  mc.ffn = F;
  mc.experts = E;
  mc.topk = c.k;
  mc.max_tokens = T_all;
  mc.dispatch.align = c.A;
  mc.bias = true;
  mc.probs = ProbsPlacement::kInActivation;
  const int64_t F1 = mc.fc1_out();

  std::mt19937_64 rng(77);
  const auto w1 = random_bf16_values(size_t(E) * F1 * H, 1.0 / std::sqrt(double(H)), rng);
  const auto w2 = random_bf16_values(size_t(E) * H * F, 1.0 / std::sqrt(double(F)), rng);
  const auto b1 = random_bf16_values(size_t(E) * F1, 0.1, rng);
  const auto b2 = random_bf16_values(size_t(E) * H, 0.1, rng);
  const std::vector<double> dy_all = random_bf16_values(size_t(T_all) * H, 1.0, rng);
  const DType bf = DType::kBF16;
  const WeightLayout L = WeightLayout::kSingleGrouped;
  auto W1 = make_param(w1, E, {F1, H}, bf, L), W2 = make_param(w2, E, {H, F}, bf, L);
  auto B1 = make_param(b1, E, {F1}, bf, L), B2 = make_param(b2, E, {H}, bf, L);
  auto zeros = [](size_t n) { return std::vector<double>(n, 0.0); };

  // ---- one GPU, all experts ----
  std::vector<double> y_one, dx_one, dw1_one, dw2_one, db1_one, db2_one;
  std::vector<float> dprobs_one;
  {
    GroupedMlp layer(mc);
    auto G1 = make_param(zeros(w1.size()), E, {F1, H}, bf, L), G2 = make_param(zeros(w2.size()), E, {H, F}, bf, L);
    auto GB1 = make_param(zeros(b1.size()), E, {F1}, bf, L), GB2 = make_param(zeros(b2.size()), E, {H}, bf, L);
    layer.set_weights({W1.views, B1.views, W2.views, B2.views});
    layer.set_grads({G1.views, GB1.views, G2.views, GB2.views});
    const ref::Routing all = concatenate_routing(c, in.routing);
    DevBuf<uint16_t> x(to_bf16(concatenate_rows(in.x))), y(T_all * H), dy(to_bf16(dy_all)), dx(T_all * H);
    DevBuf<float> probs(std::vector<float>(all.probs.begin(), all.probs.end())), dprobs(T_all * S);
    DevBuf<int32_t> idx(all.indices);
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {T_all, S});
    rv.probs = TensorView(probs.get(), DType::kFP32, {T_all, S});
    cudaStream_t s = nullptr;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const SavedState st = layer.new_state();
    layer.forward(TensorView(x.get(), bf, {T_all, H}), rv, TensorView(y.get(), bf, {T_all, H}), st, s);
    layer.backward(TensorView(dy.get(), bf, {T_all, H}), TensorView(dx.get(), bf, {T_all, H}),
                   TensorView(dprobs.get(), DType::kFP32, {T_all, S}), st, s);
    layer.check_errors(s);
    cudaStreamDestroy(s);
    y_one = from_bf16(y.download());
    dx_one = from_bf16(dx.download());
    dprobs_one = dprobs.download();
    dw1_one = download_param(G1, bf);
    dw2_one = download_param(G2, bf);
    db1_one = download_param(GB1, bf);
    db2_one = download_param(GB2, bf);
  }

  // ---- P simulated ranks, E_local experts each ----
  InProcessWorld world(c.P);
  const EpWorld& w = world.w;
  const cudaStream_t s = world.stream;
  std::vector<EpRank> ranks = make_ranks(c, w, in);
  struct RankExperts {
    std::unique_ptr<GroupedExperts> ex;
    SavedState state;
    DeviceParam G1, G2, GB1, GB2;
    DevBuf<float> d_probs_perm;
  };
  std::vector<RankExperts> rx(c.P);
  int64_t first = 0;
  for (int p = 0; p < c.P; ++p) {
    ExpertsConfig ec = mc.experts_config();
    ec.experts = El;
    ec.max_rows = ranks[p].ep->rows();
    RankExperts& r = rx[p];
    r.ex = std::make_unique<GroupedExperts>(ec);
    r.state = r.ex->new_state();
    r.G1 = make_param(zeros(size_t(El) * F1 * H), El, {F1, H}, bf, L);
    r.G2 = make_param(zeros(size_t(El) * H * F), El, {H, F}, bf, L);
    r.GB1 = make_param(zeros(size_t(El) * F1), El, {F1}, bf, L);
    r.GB2 = make_param(zeros(size_t(El) * H), El, {H}, bf, L);
    const int64_t e0 = int64_t{p} * El;
    r.ex->set_weights({{layer_data::expert_slice(W1, e0, {El, F1, H}, bf)},
                       {layer_data::expert_slice(B1, e0, {El, F1}, bf)},
                       {layer_data::expert_slice(W2, e0, {El, H, F}, bf)},
                       {layer_data::expert_slice(B2, e0, {El, H}, bf)}});
    r.ex->set_grads({r.G1.views, r.GB1.views, r.G2.views, r.GB2.views});
    r.d_probs_perm = DevBuf<float>(ranks[p].ep->rows());
    ranks[p].dy.upload(
        encode(std::vector<double>(dy_all.begin() + first * H, dy_all.begin() + (first + c.T[p]) * H), bf));
    first += c.T[p];
  }
  run_ranks(w, [&](int p) {
    EpRank& r = ranks[p];
    RankExperts& e = rx[p];
    const int64_t R = r.ep->rows();
    const TensorView xp = rows_view(c, r.x_perm, R), Y = rows_view(c, r.Y, R), dY = rows_view(c, r.dY, R);
    const TensorView dxp = rows_view(c, r.d_x_perm, R);
    const TensorView dpp(e.d_probs_perm.get(), DType::kFP32, {R});
    r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state, xp, s);
    e.ex->forward(xp, r.ep->group_offsets(r.state), r.ep->probs_perm(r.state), Y, e.state, s);
    r.ep->combine(r.state, Y, rows_view(c, r.y, r.T), MergeProbs::kNone, s);  // probs applied in the experts
    r.ep->combine_backward(r.state, rows_view(c, r.dy, r.T), dY, MergeProbs::kNone, s);
    e.ex->backward(dY, dxp, dpp, e.state, s);
    const TensorView dprobs(r.dprobs_dispatch.get(), DType::kFP32, {r.T, S});
    r.ep->dispatch_backward(r.state, dxp, rows_view(c, r.dx, r.T), s, &dpp, &dprobs);
  });
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));

  std::vector<double> dw1, dw2, db1, db2;
  first = 0;
  for (int p = 0; p < c.P; ++p) {
    EXPECT_EQ(ranks[p].err->fetch_and_clear(s), 0u) << "rank " << p;
    const int64_t Tp = c.T[p];
    const std::vector<double> y = decode(ranks[p].y.download(), bf), dx = decode(ranks[p].dx.download(), bf);
    const std::vector<float> dprobs = ranks[p].dprobs_dispatch.download();
    EXPECT_EQ(y, std::vector<double>(y_one.begin() + first * H, y_one.begin() + (first + Tp) * H)) << "y rank " << p;
    EXPECT_EQ(dx, std::vector<double>(dx_one.begin() + first * H, dx_one.begin() + (first + Tp) * H))
        << "dx rank " << p;
    EXPECT_TRUE(Tp == 0 || std::memcmp(dprobs.data(), dprobs_one.data() + first * S, Tp * S * 4) == 0)
        << "dprobs rank " << p;
    auto append = [](std::vector<double>& to, const std::vector<double>& from) {
      to.insert(to.end(), from.begin(), from.end());
    };
    append(dw1, download_param(rx[p].G1, bf));
    append(dw2, download_param(rx[p].G2, bf));
    append(db1, download_param(rx[p].GB1, bf));
    append(db2, download_param(rx[p].GB2, bf));
    first += Tp;
  }
  expect_close(dw1, dw1_one, "fc1.weight grad");
  expect_close(dw2, dw2_one, "fc2.weight grad");
  expect_close(db1, db1_one, "fc1.bias grad");
  expect_close(db2, db2_one, "fc2.bias grad");
  const bool bitwise = dw1 == dw1_one && dw2 == dw2_one && db1 == db1_one && db2 == db2_one;
  std::cout << "[ info ] expert-parallel weight and bias gradients bitwise equal to one GPU's: "
            << (bitwise ? "yes" : "no") << "\n";
}

}  // namespace
}  // namespace moe
