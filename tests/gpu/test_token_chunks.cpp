// The pieces of token chunks (docs/state.md): the dispatcher's windows of a plan's rows per chunk of
// tokens, the chunk combine and permute backward, and the grouped GEMM reading windows of rows
// (GemmProblem::a_row_begin).
//   - windows: exactly what the plan's row maps give (computed on the host from the downloaded plan);
//   - combine / permute backward of every chunk, from the chunk's packed rows: bitwise the whole
//     batch's (the same rows summed in the same order);
//   - fprop / dgrad on windows: every row bitwise the whole product's row; a window past the rows
//     is clamped (never read out of bounds) and raises kErrBadGroupOffsets.
// The layer's token chunks end to end are in test_grouped_mlp.cpp (TokenChunks*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "moe/device_errors.h"
#include "moe/dispatch.h"
#include "moe/error_word.h"
#include "moe/float_convert.h"
#include "moe/grouped_gemm.h"
#include "moe/saved_state.h"
#include "reference/dispatch_ref.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/gpu.h"

namespace moe {
namespace {

using testing::DeviceBuffer;

std::vector<uint16_t> random_bf16(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& e : v) e = float_to_bf16_bits(d(rng));
  return v;
}

template <typename T>
std::vector<T> download(const TensorView& v) {
  std::vector<T> h(v.numel());
  if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(h.data(), v.data, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

struct PlanCase {
  int64_t T;
  int E, k, align, chunks;
  double skew;
};

class TokenChunks : public testing::StreamTest {};

// Windows against the plan's row maps, then the chunk combine and permute backward against the
// whole batch's, for chunk counts that divide T and that do not, more chunks than tokens, skewed
// routing and padding.
TEST_F(TokenChunks, WindowsFollowThePlanAndChunkSumsAreBitwiseTheWholeBatch) {
  for (const PlanCase pc : {PlanCase{61, 6, 2, 0, 3, 0.0}, PlanCase{64, 8, 3, 16, 4, 2.0}, PlanCase{5, 4, 2, 0, 7, 0.0},
                            PlanCase{100, 5, 5, 128, 6, 1.0}, PlanCase{0, 4, 2, 0, 2, 0.0}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << pc.T << " E=" << pc.E << " k=" << pc.k << " A=" << pc.align
                                      << " chunks=" << pc.chunks);
    const int64_t H = 64, Tmax = 100;
    DispatcherConfig dc;
    dc.max_tokens = Tmax;
    dc.num_experts = pc.E;
    dc.topk = pc.k;
    dc.hidden = H;
    dc.options.align = pc.align;
    Dispatcher d(dc);
    const int64_t R = d.rows();
    const ref::Routing rt = ref::make_topk_routing(pc.T, pc.E, pc.k, 7, pc.skew);
    DeviceBuffer<int32_t> idx(rt.indices);
    DeviceBuffer<float> probs(std::vector<float>(rt.probs.begin(), rt.probs.end()));
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {pc.T, pc.k});
    rv.probs = TensorView(probs.get(), DType::kFP32, {pc.T, pc.k});
    ErrorWord ew;
    const SavedState plan = d.new_plan();
    d.plan(rv, ew.device_ptr(), plan, stream);
    const int n = pc.chunks;
    DeviceBuffer<int32_t> win(d.chunk_windows_size(n));
    const TensorView wv(win.get(), DType::kInt32, {d.chunk_windows_size(n)});
    d.chunk_windows(plan, n, wv, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    ew.check(stream);

    // The windows against the CPU reference's (the reference plan is the device plan's, tested in
    // test_dispatch.cu), every entry; the slots' packed rows too.
    DispatchOptions o;
    o.align = pc.align;
    o.row_bound = R;  // the device plan's bound (from T_max)
    const ref::DispatchPlan rp = ref::plan_dispatch(rt, o);
    const ref::ChunkWindows want = ref::chunk_windows(rp, n);
    const int64_t Tc = Dispatcher::chunk_tokens(pc.T, n);
    ASSERT_EQ(Tc, want.Tc);
    auto as64 = [](const std::vector<int32_t>& v) { return std::vector<int64_t>(v.begin(), v.end()); };
    for (int c = 0; c < n; ++c) {
      EXPECT_EQ(as64(download<int32_t>(d.chunk_row_begin(wv, n, c))), want.row_begin[c]) << "chunk " << c;
      EXPECT_EQ(as64(download<int32_t>(d.chunk_offsets(wv, n, c))), want.offsets[c]) << "chunk " << c;
    }
    EXPECT_EQ(as64(download<int32_t>(d.chunk_slot_rows(wv, n, pc.T))), want.local_row);

    // The combine and the permute backward piece by piece, each piece's rows packed from Y.
    std::mt19937_64 rng(5);
    const auto Yh = random_bf16(R * H, rng);
    std::vector<float> dpp(R);
    for (auto& v : dpp) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    DeviceBuffer<uint16_t> Y(Yh), y_all(pc.T * H), y_chunks(pc.T * H), dx_all(pc.T * H), dx_chunks(pc.T * H);
    DeviceBuffer<float> dppd(dpp), dprobs_all(pc.T * pc.k), dprobs_chunks(pc.T * pc.k);
    const TensorView Yv(Y.get(), DType::kBF16, {R, H}), dppv(dppd.get(), DType::kFP32, {R});
    auto rows_of = [&](const DeviceBuffer<uint16_t>& b) { return TensorView(b.get(), DType::kBF16, {pc.T, H}); };
    const TensorView dpa(dprobs_all.get(), DType::kFP32, {pc.T, pc.k}),
        dpc(dprobs_chunks.get(), DType::kFP32, {pc.T, pc.k});
    d.unpermute(plan, Yv, rows_of(y_all), MergeProbs::kNone, stream);
    d.permute_backward(plan, Yv, rows_of(dx_all), stream, &dppv, &dpa);
    for (auto* b : {&y_chunks, &dx_chunks}) b->fill_bytes(0xFF);
    dprobs_chunks.fill_bytes(0xFF);
    for (int c = 0; c < n; ++c) {
      const auto begin = download<int32_t>(d.chunk_row_begin(wv, n, c));
      const auto offs = download<int32_t>(d.chunk_offsets(wv, n, c));
      // The bound of any piece's packed rows (NaN past what this piece packs: never read).
      const int64_t rows = std::max<int64_t>(std::min(R, Tc * pc.k), 1);
      ASSERT_LE(offs[pc.E], rows);
      std::vector<uint16_t> packed(rows * H, 0xFFFF);
      for (int e = 0; e < pc.E; ++e)
        std::copy(Yh.begin() + int64_t(begin[e]) * H, Yh.begin() + int64_t(begin[e] + offs[e + 1] - offs[e]) * H,
                  packed.begin() + int64_t(offs[e]) * H);
      DeviceBuffer<uint16_t> Yc(packed);
      const TensorView Ycv(Yc.get(), DType::kBF16, {int64_t(packed.size()) / H, H});
      d.unpermute_chunk(plan, wv, n, c, Ycv, rows_of(y_chunks), stream);
      d.permute_backward_chunk(plan, wv, n, c, Ycv, rows_of(dx_chunks), stream, &dppv, &dpc);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    EXPECT_EQ(y_chunks.download(), y_all.download());
    EXPECT_EQ(dx_chunks.download(), dx_all.download());
    EXPECT_EQ(dprobs_chunks.download(), dprobs_all.download());
  }
}

// fprop and dgrad on windows of each group's rows: row for row the whole product's bits.
TEST_F(TokenChunks, GemmWindowsAreRowsOfTheWholeProduct) {
  const int E = 3;
  const int64_t K = 128, N = 256, R = 300;
  const std::vector<int32_t> groups = {0, 90, 90, 300};  // expert 1 empty
  // Windows: rows [10, 50) of expert 0, none of expert 1, rows [150, 300) of expert 2.
  const std::vector<int32_t> begin = {10, 90, 150}, packed = {0, 40, 40, 190};
  std::mt19937_64 rng(9);
  DeviceBuffer<uint16_t> x(random_bf16(R * K, rng)), w(random_bf16(E * N * K, rng)), dy(random_bf16(R * N, rng));
  DeviceBuffer<uint16_t> y_all(R * N), y_win(190 * N), dx_all(R * K), dx_win(190 * K);
  DeviceBuffer<int32_t> g(groups), b(begin), p(packed);
  DeviceBuffer<uint8_t> ws;
  GroupedGemm gemm(E, R);
  ws = DeviceBuffer<uint8_t>(gemm.workspace_bytes());
  const TensorView wsv(ws.get(), DType::kUInt8, {int64_t(ws.size())});
  const ExpertMatrices W = ExpertMatrices::grouped(TensorView(w.get(), DType::kBF16, {E, N, K}));
  const TensorView gv(g.get(), DType::kInt32, {E + 1}), pv(p.get(), DType::kInt32, {E + 1});
  gemm.fprop(TensorView(x.get(), DType::kBF16, {R, K}), W, gv, TensorView(y_all.get(), DType::kBF16, {R, N}), wsv,
             stream);
  gemm.dgrad(TensorView(dy.get(), DType::kBF16, {R, N}), W, gv, TensorView(dx_all.get(), DType::kBF16, {R, K}), wsv,
             stream);
  ErrorWord ew;
  GemmProblem f;
  f.op = GemmOp::kFprop;
  f.a = TensorView(x.get(), DType::kBF16, {R, K});
  f.w = W;
  f.d = TensorView(y_win.get(), DType::kBF16, {190, N});
  f.group_offsets = pv;
  f.a_row_begin = TensorView(b.get(), DType::kInt32, {E});
  f.error_word = ew.device_ptr();
  gemm.run(f, wsv, stream);
  GemmProblem dg = f;
  dg.op = GemmOp::kDgrad;
  dg.a = TensorView(dy.get(), DType::kBF16, {R, N});
  dg.d = TensorView(dx_win.get(), DType::kBF16, {190, K});
  gemm.run(dg, wsv, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(ew.fetch_and_clear(stream), 0u);
  const auto ya = y_all.download(), yw = y_win.download(), da = dx_all.download(), dw = dx_win.download();
  auto same_rows = [&](const std::vector<uint16_t>& all, const std::vector<uint16_t>& win, int64_t cols) {
    for (int e = 0; e < E; ++e)
      for (int32_t i = 0; i < packed[e + 1] - packed[e]; ++i)
        ASSERT_TRUE(std::equal(all.begin() + (begin[e] + i) * cols, all.begin() + (begin[e] + i + 1) * cols,
                               win.begin() + (packed[e] + i) * cols))
            << "expert " << e << " window row " << i;
  };
  same_rows(ya, yw, N);
  same_rows(da, dw, K);

  // A window past the rows of `a`: clamped, flagged.
  b.upload({10, 90, 200});  // 150 rows from row 200 run past R = 300
  gemm.run(f, wsv, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_NE(ew.fetch_and_clear(stream) & kErrBadGroupOffsets, 0u);
}

}  // namespace
}  // namespace moe
