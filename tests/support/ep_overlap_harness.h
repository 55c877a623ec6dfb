// The overlapped expert-parallel pipeline in tests: a whole layer step (dispatch, experts, combine,
// combine backward, experts backward, dispatch backward) on every rank with the stand-in experts of
// ep_fake_experts.h, either stage by stage on each rank's one stream (the dispatcher's per-op
// methods, the experts called per chunk) or through forward_overlapped / backward_overlapped (the
// all-to-alls on the world's communication streams). Outputs come back as bytes (ep_harness.h).
#pragma once

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "support/ep_fake_experts.h"
#include "support/ep_harness.h"

namespace moe::testing {

enum class EpPath { kStages, kOverlapped };

// One chunk's views for the stage-by-stage path, as the overlapped pipeline hands them over.
inline EpChunk stage_chunk(const EpCase& c, EpRank& r, int j, const DeviceBuffer<uint8_t>& in,
                           const DeviceBuffer<uint8_t>& out, const DeviceBuffer<float>* d_probs_perm) {
  const int64_t Rc = r.ep->chunk_rows(), row = c.H * elem_bytes(c.dt);
  EpChunk ch;
  ch.index = j;
  ch.in = TensorView(in.get() + j * Rc * row, c.dt, {Rc, c.H});
  ch.out = TensorView(out.get() + j * Rc * row, c.dt, {Rc, c.H});
  ch.group_offsets = r.ep->group_offsets(r.state, j);
  ch.probs_perm = r.ep->probs_perm(r.state, j);
  if (d_probs_perm) ch.d_probs_perm = TensorView(d_probs_perm->get() + j * Rc, DType::kFP32, {Rc});
  return ch;
}

// dy of every rank, keyed by global token (the same values whatever the run).
inline void upload_keyed_dy(const EpCase& c, const EpWorld& w, std::vector<EpRank>& ranks, uint64_t seed) {
  int64_t first = 0;
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    std::vector<double> dy(static_cast<size_t>(ranks[p].T * c.H));
    for (int64_t t = 0; t < ranks[p].T; ++t)
      for (int64_t h = 0; h < c.H; ++h) dy[t * c.H + h] = keyed_value(seed + 3, first + t, h, 0, c.dt);
    ranks[p].dy.upload(encode(dy, c.dt));
    first += ranks[p].T;
  }
}

// The whole step on rank p, enqueued on its streams (merge kPlanned, every gradient output). The
// experts' functions are parameters so that real experts can stand in for the fake ones.
struct EpExperts {
  EpChunkFn forward = fake_experts_forward;
  EpChunkFn backward = fake_experts_backward;
};

inline void enqueue_layer_step(const EpCase& c, const EpWorld& w, EpRank& r, int p, EpPath path,
                               const EpExperts& experts) {
  const int64_t R = r.ep->rows(), S = c.slots();
  const cudaStream_t s = w.stream[p];
  const TensorView x = rows_view(c, r.x, r.T), x_perm = rows_view(c, r.x_perm, R), Y = rows_view(c, r.Y, R);
  const TensorView y = rows_view(c, r.y, r.T), dy = rows_view(c, r.dy, r.T), dx = rows_view(c, r.dx, r.T);
  const TensorView dY = rows_view(c, r.dY, R), dxp = rows_view(c, r.d_x_perm, R);
  const TensorView dpp(r.d_probs_perm.get(), DType::kFP32, {R});
  const TensorView dpc(r.dprobs_combine.get(), DType::kFP32, {r.T, S});
  const TensorView dpd(r.dprobs_dispatch.get(), DType::kFP32, {r.T, S});
  if (path == EpPath::kStages) {
    r.ep->plan_and_dispatch(routing_view(c, r), x, r.err->device_ptr(), r.state, x_perm, s);
    for (int j = 0; j < r.ep->chunks(); ++j) experts.forward(stage_chunk(c, r, j, r.x_perm, r.Y, nullptr), s);
    r.ep->combine(r.state, Y, y, MergeProbs::kPlanned, s);
    r.ep->combine_backward(r.state, dy, dY, MergeProbs::kPlanned, s, nullptr, &Y, &dpc);
    for (int j = 0; j < r.ep->chunks(); ++j)
      experts.backward(stage_chunk(c, r, j, r.dY, r.d_x_perm, &r.d_probs_perm), s);
    r.ep->dispatch_backward(r.state, dxp, dx, s, &dpp, &dpd);
  } else {
    r.ep->forward_overlapped(routing_view(c, r), x, r.err->device_ptr(), r.state, x_perm, Y, y, MergeProbs::kPlanned,
                             experts.forward, s, w.comm[p]);
    EpBackwardOptions opt;
    opt.Y = &Y;
    opt.dprobs_combine = &dpc;
    opt.d_probs_perm = &dpp;
    opt.dprobs = &dpd;
    r.ep->backward_overlapped(r.state, dy, dY, dxp, dx, MergeProbs::kPlanned, experts.backward, s, w.comm[p], opt);
  }
}

// What a layer step produced on every rank (after synchronisation): the dispatch's views and
// x_perm, the token-side outputs, dY, and the error bits. The exchange workspaces are not
// downloaded (the backward reuses them).
inline std::vector<EpRankOut> download_layer_step(const EpWorld& w, std::vector<EpRank>& ranks) {
  std::vector<EpRankOut> out;
  download_dispatch(w, ranks, out);
  download_backward(w, ranks, out);
  for (EpRankOut& o : out) {
    o.send.clear();
    o.recv.clear();
    o.recv_probs.clear();
  }
  return out;
}

// The whole step on every rank of the world, from fresh ranks; returns every rank's outputs.
// experts: per rank (empty: the fake experts on every rank).
inline std::vector<EpRankOut> run_layer_step(const EpCase& c, const EpWorld& w, const EpInputs& in, uint64_t seed,
                                             EpPath path, const std::vector<EpExperts>& experts = {}) {
  std::vector<EpRank> ranks = make_ranks(c, w, in);
  upload_keyed_dy(c, w, ranks, seed);
  run_ranks(w, [&](int p) {
    enqueue_layer_step(c, w, ranks[p], p, path, experts.empty() ? EpExperts{} : experts[p]);
  });
  sync_world(w);
  return download_layer_step(w, ranks);
}

// The token-side results of two runs (any chunk counts) are the same bits: y, dx, both dprobs,
// the drop counts and the error bits.
inline void expect_same_token_outputs(const std::vector<EpRankOut>& got, const std::vector<EpRankOut>& want,
                                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t p = 0; p < want.size(); ++p) {
    const std::string at = what + " rank " + std::to_string(p);
    const EpRankOut &a = got[p], &b = want[p];
    EXPECT_EQ(a.y, b.y) << at << " y";
    EXPECT_EQ(a.dx, b.dx) << at << " dx";
    EXPECT_EQ(a.dropped, b.dropped) << at << " drop counts";
    EXPECT_EQ(a.error_bits, b.error_bits) << at << " error bits";
    for (const auto& [x, y, name] : {std::tuple{&a.dprobs_combine, &b.dprobs_combine, "dprobs (combine)"},
                                     std::tuple{&a.dprobs_dispatch, &b.dprobs_dispatch, "dprobs (dispatch)"}}) {
      ASSERT_EQ(x->size(), y->size()) << at << " " << name;
      EXPECT_TRUE(x->empty() || std::memcmp(x->data(), y->data(), x->size() * sizeof(float)) == 0) << at << " " << name;
    }
  }
}

}  // namespace moe::testing
