#include "reference/ep_dispatch_ref.h"

#include <algorithm>
#include <numeric>

#include "moe/device_errors.h"
#include "moe/error.h"
#include "reference/dispatch_ref.h"

namespace moe::ref {

namespace {

void check_config(const std::vector<Routing>& routing, const EpConfig& c) {
  MOE_CHECK(c.P > 0, "argument 'config.P': expected > 0, got ", c.P);
  MOE_CHECK(c.E_local > 0, "argument 'config.E_local': expected > 0, got ", c.E_local);
  MOE_CHECK(is_valid_alignment(c.align), "argument 'config.align': expected one of 0, 16, 32, 64, 128, 256, got ",
            c.align);
  MOE_CHECK(c.capacity >= -1, "argument 'config.capacity': expected >= 0, or -1 for dropless, got ", c.capacity);
  MOE_CHECK(c.row_bound >= -1, "argument 'config.row_bound': expected >= 0, or -1 for the default, got ",
            c.row_bound);
  MOE_CHECK(routing.size() == static_cast<size_t>(c.P), "argument 'routing': expected one routing per rank (",
            c.P, "), got ", routing.size());
  const int64_t E = static_cast<int64_t>(c.P) * c.E_local;
  for (size_t p = 0; p < routing.size(); ++p) {
    MOE_CHECK(routing[p].E == E, "argument 'routing[", p, "].E': expected P * E_local = ", E, ", got ",
              routing[p].E);
    MOE_CHECK(routing[p].form == routing[0].form && routing[p].k == routing[0].k, "argument 'routing[", p,
              "]': expected the same form and k on every rank");
  }
}

void check_ranks(const RankBuffers& b, const EpPlan& plan, const char* name) {
  MOE_CHECK(b.size() == static_cast<size_t>(plan.P), "argument '", name, "': expected ", plan.P,
            " per-rank buffers, got ", b.size());
}

void check_size(const std::vector<double>& v, int64_t n, const char* name, int rank) {
  MOE_CHECK(v.size() == static_cast<size_t>(n), "argument '", name, "[", rank, "]': expected ", n,
            " values, got ", v.size());
}

// The pack stage of source rank p: "experts" = destination ranks, several slots of one token may go
// to the same rank (different experts there), so this is not plan_dispatch, whose duplicate check
// would skip them. Order inside a destination's block: token, then slot.
DispatchPlan plan_pack(const Routing& r, const std::vector<int32_t>& expert, int P, int E_local, int64_t C,
                       std::vector<int64_t>& dropped, uint32_t& bits) {
  DispatchPlan s;
  s.T = r.T;
  s.E = P;
  s.slots = r.slots();
  const size_t n = static_cast<size_t>(s.T) * s.slots;
  s.slot_expert.assign(n, -1);
  s.count.assign(P, 0);
  for (size_t i = 0; i < n; ++i)
    if (expert[i] >= 0) {
      s.slot_expert[i] = expert[i] / E_local;
      ++s.count[s.slot_expert[i]];
    }
  s.padded.assign(P, 0);
  s.offset.assign(P, 0);
  int64_t total = 0;
  for (int d = 0; d < P; ++d) {
    s.padded[d] = C >= 0 ? C : s.count[d];
    s.offset[d] = total;
    total += s.padded[d];
  }
  s.R = total;
  s.slot_row.assign(n, -1);
  s.slot_prob.assign(n, 0.0);
  s.row_token.assign(static_cast<size_t>(s.R), -1);
  s.row_slot.assign(static_cast<size_t>(s.R), -1);
  std::vector<int64_t> next(P, 0);  // rows taken so far in each destination's block
  for (int64_t t = 0; t < s.T; ++t)
    for (int k = 0; k < s.slots; ++k) {
      const size_t i = static_cast<size_t>(t) * s.slots + k;
      const int d = s.slot_expert[i];
      if (d < 0) continue;
      s.slot_prob[i] = r.probs[i];
      if (C >= 0 && next[d] >= C) {  // past the capacity: counted, flagged, never written
        ++dropped[d];
        bits |= kErrRowOverflow;
        continue;
      }
      const int64_t row = s.offset[d] + next[d]++;
      s.slot_row[i] = row;
      s.row_token[row] = t;
      s.row_slot[row] = static_cast<int64_t>(i);
    }
  return s;
}

}  // namespace

int64_t EpPlan::total_dropped() const { return std::accumulate(dropped.begin(), dropped.end(), int64_t{0}); }

EpPlan plan_ep_dispatch(const std::vector<Routing>& routing, const EpConfig& config) {
  check_config(routing, config);
  const int P = config.P;
  const int64_t C = config.capacity;
  EpPlan plan;
  plan.P = P;
  plan.E_local = config.E_local;
  plan.slots = routing[0].slots();
  plan.capacity = C;
  plan.sent.assign(static_cast<size_t>(P) * P, 0);
  plan.dropped.assign(static_cast<size_t>(P) * P, 0);
  plan.error_bits.assign(P, 0);

  // 1. Pack: validate each rank's routing exactly as the single-GPU plan does (no alignment, a
  //    bound every valid slot fits in), then group its entries by destination rank.
  for (int p = 0; p < P; ++p) {
    const Routing& r = routing[p];
    DispatchOptions validate;
    validate.row_bound = r.T * r.slots();
    const DispatchPlan v = plan_dispatch(r, validate);
    plan.error_bits[p] |= v.error_bits;
    plan.slot_expert.push_back(v.slot_expert);
    std::vector<int64_t> dropped(P, 0);
    plan.send.push_back(plan_pack(r, v.slot_expert, P, config.E_local, C, dropped, plan.error_bits[p]));
    for (int d = 0; d < P; ++d) {
      plan.dropped[static_cast<size_t>(p) * P + d] = dropped[d];
      plan.sent[static_cast<size_t>(p) * P + d] = plan.send[p].count[d] - dropped[d];
    }
  }

  // 2. Exchange: d's receive buffer holds the rows from s = 0, 1, ... (block s * C in capacity
  //    mode, packed when dropless), each block in the order s packed it.
  for (int d = 0; d < P; ++d) {
    std::vector<int64_t> off(P, 0);
    int64_t rows = 0;
    for (int s = 0; s < P; ++s) {
      off[s] = rows;
      rows += C >= 0 ? C : plan.sent[static_cast<size_t>(s) * P + d];
    }
    std::vector<int32_t> rank(static_cast<size_t>(rows), -1);
    std::vector<int64_t> slot(static_cast<size_t>(rows), -1);
    for (int s = 0; s < P; ++s) {
      const DispatchPlan& src = plan.send[s];
      for (int64_t i = 0; i < plan.sent[static_cast<size_t>(s) * P + d]; ++i) {
        rank[off[s] + i] = s;
        slot[off[s] + i] = src.row_slot[src.offset[d] + i];
      }
    }
    plan.recv_offset.push_back(std::move(off));
    plan.recv_rank.push_back(std::move(rank));
    plan.recv_slot.push_back(std::move(slot));
  }

  // 3. Local: the single-GPU plan of each receive buffer, one slot per row, over the local experts.
  //    Expert-major, then receive order (source rank, then source token: one expert appears at most
  //    once per token).
  for (int d = 0; d < P; ++d) {
    Routing local;
    local.form = RoutingForm::kTopK;
    local.T = static_cast<int64_t>(plan.recv_rank[d].size());
    local.E = config.E_local;
    local.k = 1;
    local.indices.assign(static_cast<size_t>(local.T), -1);
    local.probs.assign(static_cast<size_t>(local.T), 0.0);
    for (int64_t j = 0; j < local.T; ++j) {
      const int s = plan.recv_rank[d][j];
      if (s < 0) continue;
      const int64_t i = plan.recv_slot[d][j];
      local.indices[j] = plan.slot_expert[s][i] - d * config.E_local;
      local.probs[j] = routing[s].probs[i];
    }
    DispatchOptions opts;
    opts.align = config.align;
    opts.row_bound = config.row_bound;
    plan.local.push_back(plan_dispatch(local, opts));
    plan.error_bits[d] |= plan.local[d].error_bits;
  }
  return plan;
}

void ep_pack(const EpPlan& plan, const RankBuffers& x, int64_t H, RankBuffers& send, RankBuffers& send_probs) {
  check_ranks(x, plan, "x");
  send.assign(plan.P, {});
  send_probs.assign(plan.P, {});
  for (int p = 0; p < plan.P; ++p) {
    const DispatchPlan& s = plan.send[p];
    check_size(x[p], s.T * H, "x", p);
    send[p].resize(static_cast<size_t>(s.R * H));
    send_probs[p].resize(static_cast<size_t>(s.R));
    permute(s, x[p].data(), H, send[p].data(), send_probs[p].data());
  }
}

void ep_exchange(const EpPlan& plan, const RankBuffers& send, int64_t W, RankBuffers& recv) {
  check_ranks(send, plan, "send");
  for (int s = 0; s < plan.P; ++s) check_size(send[s], plan.send_rows(s) * W, "send", s);
  recv.assign(plan.P, {});
  for (int d = 0; d < plan.P; ++d) {
    recv[d].assign(static_cast<size_t>(plan.recv_rows(d) * W), 0.0);
    for (int s = 0; s < plan.P; ++s) {
      const int64_t n = plan.sent[static_cast<size_t>(s) * plan.P + d];
      const double* from = send[s].data() + plan.send[s].offset[d] * W;
      std::copy(from, from + n * W, recv[d].data() + plan.recv_offset[d][s] * W);
    }
  }
}

void ep_exchange_back(const EpPlan& plan, const RankBuffers& recv, int64_t W, RankBuffers& send) {
  check_ranks(recv, plan, "recv");
  for (int d = 0; d < plan.P; ++d) check_size(recv[d], plan.recv_rows(d) * W, "recv", d);
  send.assign(plan.P, {});
  for (int s = 0; s < plan.P; ++s) {
    send[s].assign(static_cast<size_t>(plan.send_rows(s) * W), 0.0);
    for (int d = 0; d < plan.P; ++d) {
      const int64_t n = plan.sent[static_cast<size_t>(s) * plan.P + d];
      const double* from = recv[d].data() + plan.recv_offset[d][s] * W;
      std::copy(from, from + n * W, send[s].data() + plan.send[s].offset[d] * W);
    }
  }
}

void ep_dispatch(const EpPlan& plan, const RankBuffers& x, int64_t H, RankBuffers& x_perm, RankBuffers& probs_perm) {
  RankBuffers send, send_probs, recv, recv_probs;
  ep_pack(plan, x, H, send, send_probs);
  ep_exchange(plan, send, H, recv);
  ep_exchange(plan, send_probs, 1, recv_probs);  // the probs travel with the rows
  x_perm.assign(plan.P, {});
  probs_perm.assign(plan.P, {});
  for (int d = 0; d < plan.P; ++d) {
    const DispatchPlan& l = plan.local[d];
    x_perm[d].resize(static_cast<size_t>(l.R * H));
    probs_perm[d].resize(static_cast<size_t>(l.R));
    permute(l, recv[d].data(), H, x_perm[d].data(), nullptr);
    permute(l, recv_probs[d].data(), 1, probs_perm[d].data(), nullptr);  // pad rows zero
  }
}

void ep_dispatch_backward(const EpPlan& plan, const RankBuffers& d_x_perm, const RankBuffers& d_probs_perm,
                          int64_t H, RankBuffers& dx, RankBuffers& dprobs) {
  check_ranks(d_x_perm, plan, "d_x_perm");
  const bool with_probs = !d_probs_perm.empty();
  if (with_probs) check_ranks(d_probs_perm, plan, "d_probs_perm");
  // Local stage backward: each receive row has one slot, so its gradient is its x_perm row's.
  RankBuffers d_recv(plan.P), d_recv_probs(plan.P);
  for (int d = 0; d < plan.P; ++d) {
    const DispatchPlan& l = plan.local[d];
    check_size(d_x_perm[d], l.R * H, "d_x_perm", d);
    if (with_probs) check_size(d_probs_perm[d], l.R, "d_probs_perm", d);
    d_recv[d].resize(static_cast<size_t>(l.T * H));
    d_recv_probs[d].resize(static_cast<size_t>(l.T));
    permute_backward(l, d_x_perm[d].data(), with_probs ? d_probs_perm[d].data() : nullptr, H, d_recv[d].data(),
                     d_recv_probs[d].data());
  }
  RankBuffers d_send, d_send_probs;
  ep_exchange_back(plan, d_recv, H, d_send);
  ep_exchange_back(plan, d_recv_probs, 1, d_send_probs);
  dx.assign(plan.P, {});
  dprobs.assign(plan.P, {});
  for (int p = 0; p < plan.P; ++p) {
    const DispatchPlan& s = plan.send[p];
    dx[p].resize(static_cast<size_t>(s.T * H));
    dprobs[p].resize(static_cast<size_t>(s.T * s.slots));
    permute_backward(s, d_send[p].data(), with_probs ? d_send_probs[p].data() : nullptr, H, dx[p].data(),
                     dprobs[p].data());
  }
}

namespace {

// Each destination's Y rows back in receive order (a row that got no x_perm row returns zero), then
// the reverse exchange: the rows in each source's send layout.
RankBuffers rows_back_to_sources(const EpPlan& plan, const RankBuffers& Y, int64_t H) {
  check_ranks(Y, plan, "Y");
  RankBuffers back(plan.P);
  for (int d = 0; d < plan.P; ++d) {
    const DispatchPlan& l = plan.local[d];
    check_size(Y[d], l.R * H, "Y", d);
    back[d].resize(static_cast<size_t>(l.T * H));
    unpermute(l, Y[d].data(), H, /*merge_probs=*/false, back[d].data());  // one slot per row: a gather
  }
  RankBuffers at_source;
  ep_exchange_back(plan, back, H, at_source);
  return at_source;
}

}  // namespace

void ep_combine(const EpPlan& plan, const RankBuffers& Y, int64_t H, bool merge_probs, RankBuffers& y) {
  const RankBuffers rows = rows_back_to_sources(plan, Y, H);
  y.assign(plan.P, {});
  for (int p = 0; p < plan.P; ++p) {
    const DispatchPlan& s = plan.send[p];
    y[p].resize(static_cast<size_t>(s.T * H));
    unpermute(s, rows[p].data(), H, merge_probs, y[p].data());  // slot order, fp64, as single-GPU
  }
}

void ep_combine_backward(const EpPlan& plan, const RankBuffers& Y, const RankBuffers& dy, int64_t H,
                         bool merge_probs, RankBuffers& dY, RankBuffers& dprobs) {
  check_ranks(dy, plan, "dy");
  // The source needs the Y rows only for the prob gradients.
  RankBuffers rows = merge_probs ? rows_back_to_sources(plan, Y, H) : RankBuffers(plan.P);
  RankBuffers d_send(plan.P);
  dprobs.assign(plan.P, {});
  for (int p = 0; p < plan.P; ++p) {
    const DispatchPlan& s = plan.send[p];
    check_size(dy[p], s.T * H, "dy", p);
    d_send[p].resize(static_cast<size_t>(s.R * H));
    dprobs[p].resize(static_cast<size_t>(s.T * s.slots));
    unpermute_backward(s, merge_probs ? rows[p].data() : nullptr, dy[p].data(), H, merge_probs, d_send[p].data(),
                       dprobs[p].data());
  }
  RankBuffers d_recv;
  ep_exchange(plan, d_send, H, d_recv);
  dY.assign(plan.P, {});
  for (int d = 0; d < plan.P; ++d) {
    const DispatchPlan& l = plan.local[d];
    dY[d].resize(static_cast<size_t>(l.R * H));
    // The adjoint of the gather above: each receive row's gradient lands on its x_perm row.
    unpermute_backward(l, nullptr, d_recv[d].data(), H, /*merge_probs=*/false, dY[d].data(), nullptr);
  }
}

}  // namespace moe::ref
