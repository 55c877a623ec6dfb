// Checks of an expert-parallel run (tests/support/ep_harness.h) shared by the GPU tests of both
// dispatcher modes:
//   - check_against_reference: the CPU reference (src/reference/ep_dispatch_ref.h), bitwise: the
//     send and receive buffers (capacity layout, or packed back to back in dropless mode), x_perm,
//     probs_perm, group offsets, local counts, the send row of every slot, per-pair drop counts and
//     every rank's error bits;
//   - check_against_single_gpu: the single-GPU moe::Dispatcher on all ranks' tokens concatenated in
//     rank order (with the entries the capacity dropped emptied), bitwise: the expert groups of
//     x_perm, the combine y, the combine backward's dY and dprobs, the dispatch backward's dx and
//     dprobs. Both sides run the same fp32 kernels on the same rows in the same slot order, so the
//     sums are equal to the bit; the single-GPU Dispatcher itself is tested against the fp64
//     reference in tests/gpu/test_dispatch.cu.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "moe/dispatch.h"
#include "moe/expert_parallel.h"
#include "reference/ep_dispatch_ref.h"
#include "support/ep_harness.h"
#include "support/gpu.h"

namespace moe::testing {

template <typename T>
inline std::vector<T> widen(const std::vector<int32_t>& v) {
  return std::vector<T>(v.begin(), v.end());
}

// Exact equality of value lists; reports the first difference.
inline void expect_same(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i] || (std::isnan(got[i]) && std::isnan(want[i])))) {
      ADD_FAILURE() << what << ": first difference at " << i << ": got " << got[i] << ", want " << want[i];
      return;
    }
}

inline void expect_same_bytes(const void* got, const void* want, size_t n, const std::string& what) {
  const auto* a = static_cast<const uint8_t*>(got);
  const auto* b = static_cast<const uint8_t*>(want);
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) {
      ADD_FAILURE() << what << ": first differing byte at " << i << " of " << n;
      return;
    }
}

// ---- the reference side ----

// `workspaces`: out holds the dispatcher's send / receive buffers and received probs as the dispatch
// left them (downloaded before any later op of the dispatcher: combine and both backwards reuse those
// workspaces for their own exchanges); false skips them.
inline void check_against_reference(const EpCase& c, const EpInputs& in, const std::vector<EpRankOut>& out,
                             bool workspaces = true) {
  const ref::EpPlan plan = ref::plan_ep_dispatch(in.routing, c.ref_config());
  ref::RankBuffers x_perm, probs_perm, send, send_probs, recv, recv_probs;
  ref::ep_dispatch(plan, in.x, c.H, x_perm, probs_perm);
  ref::ep_pack(plan, in.x, c.H, send, send_probs);
  ref::ep_exchange(plan, send, c.H, recv);
  ref::ep_exchange(plan, send_probs, 1, recv_probs);
  for (int p = 0; p < c.P; ++p) {
    const std::string at = c.name + " rank " + std::to_string(p);
    const EpRankOut& o = out[p];
    EXPECT_EQ(o.error_bits, plan.error_bits[p]) << at << ": " << describe_error_bits(o.error_bits) << " vs "
                                                << describe_error_bits(plan.error_bits[p]);
    expect_same(to_double(o.send_probs), send_probs[p], at + " send probs");
    if (workspaces) {
      expect_same(decode(o.send, c.dt), send[p], at + " send buffer");
      expect_same(decode(o.recv, c.dt), recv[p], at + " receive buffer");
      expect_same(to_double(o.recv_probs), recv_probs[p], at + " received probs");
    }
    expect_same(decode(o.x_perm, c.dt), x_perm[p], at + " x_perm");
    expect_same(to_double(o.probs_perm), probs_perm[p], at + " probs_perm");
    const ref::DispatchPlan& l = plan.local[p];
    std::vector<int32_t> g(c.E_local + 1, 0);
    for (int e = 0; e < c.E_local; ++e) g[e + 1] = static_cast<int32_t>(std::min(l.offset[e] + l.padded[e], l.R));
    EXPECT_EQ(o.group_offsets, g) << at << " group offsets";
    EXPECT_EQ(widen<int64_t>(o.counts), l.count) << at << " local counts";
    EXPECT_EQ(widen<int64_t>(o.slot_rows), plan.send[p].slot_row) << at << " send row of each slot";
    const std::vector<int64_t> drops(plan.dropped.begin() + p * c.P, plan.dropped.begin() + (p + 1) * c.P);
    EXPECT_EQ(o.dropped, drops) << at << " drop counts per destination";
  }
}

// ---- the single-GPU side ----

// All ranks' routing in rank order, with the entries the capacity dropped emptied.
inline ref::Routing concatenated_routing(const EpCase& c, const EpInputs& in) {
  const ref::EpPlan plan = ref::plan_ep_dispatch(in.routing, c.ref_config());
  std::vector<ref::Routing> kept = in.routing;
  for (int p = 0; p < c.P; ++p) {
    ref::Routing& r = kept[p];
    for (size_t i = 0; i < r.probs.size(); ++i)
      if (plan.slot_expert[p][i] >= 0 && plan.send[p].slot_row[i] < 0) {  // dropped at the capacity
        if (c.form == RoutingForm::kTopK)
          r.indices[i] = -1;
        else
          r.map[i] = 0;
      }
  }
  return concatenate_routing(c, kept);
}

inline void check_against_single_gpu(const EpCase& c, const EpInputs& in, const std::vector<EpRankOut>& out,
                              uint64_t seed) {
  const ref::Routing all = concatenated_routing(c, in);
  const int E = c.E(), S = c.slots();
  const int64_t T = all.T, row = c.H * elem_bytes(c.dt);
  DispatcherConfig dc;
  dc.max_tokens = T;
  dc.num_experts = E;
  dc.topk = c.k;
  dc.hidden = c.H;
  dc.form = c.form;
  dc.row_dtype = c.dt;
  dc.options.align = c.A;
  if (c.form == RoutingForm::kMap) dc.options.row_bound = T * E + int64_t{E} * c.A;
  Dispatcher d(dc);
  SavedState plan = d.new_plan();
  const int64_t R = d.rows();
  ErrorWord err;
  DeviceBuffer<float> probs(std::vector<float>(all.probs.begin(), all.probs.end()));
  DeviceBuffer<int32_t> indices;
  DeviceBuffer<uint8_t> map;
  RoutingView rv;
  rv.form = c.form;
  rv.probs = TensorView(probs.get(), DType::kFP32, {T, S});
  if (c.form == RoutingForm::kTopK) {
    indices = DeviceBuffer<int32_t>(all.indices);
    rv.indices = TensorView(indices.get(), DType::kInt32, {T, S});
  } else {
    map = DeviceBuffer<uint8_t>(all.map);
    rv.map = TensorView(map.get(), DType::kUInt8, {T, S});
  }
  DeviceBuffer<uint8_t> x(encode(concatenate_rows(in.x), c.dt)), x_perm(R * row), y(T * row), dY(R * row), dx(T * row);
  DeviceBuffer<float> dprobs_c(T * S), dprobs_d(T * S);
  cudaStream_t s = nullptr;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  d.plan(rv, err.device_ptr(), plan, s);
  d.permute(plan, rows_view(c, x, T), rows_view(c, x_perm, R), s);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<int32_t> g = download_view<int32_t>(d.group_offsets(plan));
  const std::vector<int32_t> n = download_view<int32_t>(d.counts(plan));

  // The same keyed rows as upload_backward_inputs, in the single-GPU layout (one rank, all E experts).
  EpCase one = c;
  one.E_local = E;
  const KeyedBackwardInputs keyed = keyed_backward_inputs(one, 0, g, n, R, 0, T, seed);
  DeviceBuffer<uint8_t> Y(encode(keyed.Y, c.dt)), d_x_perm(encode(keyed.d_x_perm, c.dt)), dy(encode(keyed.dy, c.dt));
  DeviceBuffer<float> d_probs_perm(keyed.d_probs_perm);

  const TensorView Yv = rows_view(c, Y, R);
  d.unpermute(plan, Yv, rows_view(c, y, T), MergeProbs::kPlanned, s);
  const TensorView dpc(dprobs_c.get(), DType::kFP32, {T, S});
  d.unpermute_backward(plan, rows_view(c, dy, T), rows_view(c, dY, R), MergeProbs::kPlanned, s, nullptr, &Yv, &dpc);
  const TensorView dppv(d_probs_perm.get(), DType::kFP32, {R});
  const TensorView dpd(dprobs_d.get(), DType::kFP32, {T, S});
  d.permute_backward(plan, rows_view(c, d_x_perm, R), rows_view(c, dx, T), s, &dppv, &dpd);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaStreamDestroy(s);
  const Bytes xp = x_perm.download(), yb = y.download(), dYb = dY.download(), dxb = dx.download();
  const std::vector<float> dpcb = dprobs_c.download(), dpdb = dprobs_d.download();

  int64_t first = 0;
  for (int p = 0; p < c.P; ++p) {
    const std::string at = c.name + " rank " + std::to_string(p);
    const EpRankOut& o = out[p];
    const int64_t Tp = c.T[p];
    // Expert groups of x_perm (and of dY, pad rows included) equal the single-GPU ones.
    for (int e = 0; e < c.E_local; ++e) {
      const int ge = p * c.E_local + e;
      const int64_t rows = o.group_offsets[e + 1] - o.group_offsets[e];
      ASSERT_EQ(rows, g[ge + 1] - g[ge]) << at << " rows of expert " << ge;
      expect_same_bytes(o.x_perm.data() + o.group_offsets[e] * row, xp.data() + g[ge] * row, rows * row,
                        at + " x_perm group of expert " + std::to_string(ge));
      expect_same_bytes(o.dY.data() + o.group_offsets[e] * row, dYb.data() + g[ge] * row, rows * row,
                        at + " dY group of expert " + std::to_string(ge));
    }
    expect_same_bytes(o.y.data(), yb.data() + first * row, Tp * row, at + " y");
    expect_same_bytes(o.dx.data(), dxb.data() + first * row, Tp * row, at + " dx");
    expect_same_bytes(o.dprobs_combine.data(), dpcb.data() + first * S, Tp * S * 4, at + " combine dprobs");
    expect_same_bytes(o.dprobs_dispatch.data(), dpdb.data() + first * S, Tp * S * 4, at + " dispatch dprobs");
    // Rows of dY past the groups are zero.
    for (int64_t b = o.group_offsets[c.E_local] * row; b < static_cast<int64_t>(o.dY.size()); ++b)
      if (o.dY[b] != 0) {
        ADD_FAILURE() << at << " dY: nonzero byte past the groups at " << b;
        break;
      }
    first += Tp;
  }
}

}  // namespace moe::testing
