// CPU reference of expert-parallel dispatch and combine (docs/expert_parallel.md), tested against
// the single-GPU reference of all ranks' tokens concatenated in rank order (rank 0's tokens, then
// rank 1's, ...) with all P * E_local experts on one GPU: a hand-computed case; then, for P in
// {1, 2, 4, 8}, several T_p (0 on some ranks), E_local, k, A in {0, 16, 128}, balanced and skewed
// routing: (a) each expert group of each destination equals, bitwise, the single-GPU group of that
// expert (rows, probs, padding); (b) combine of an arbitrary function of the rows equals the
// single-GPU combine; (c) both backwards equal the single-GPU backwards; (d) capacity: dropped
// entries are counted, flagged, never written, and the rest equals the single-GPU result of the
// routing with the dropped entries removed; (e) P = 1 equals the single-GPU dispatch exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/error.h"
#include "reference/dispatch_ref.h"
#include "reference/ep_dispatch_ref.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/expect_error.h"

namespace moe::ref {
namespace {

using V = std::vector<double>;
using V64 = std::vector<int64_t>;
using ::moe::testing::expect_error_naming;

Routing topk(int64_t T, int E, int k, std::vector<int32_t> idx, std::vector<double> probs = {}) {
  return topk_routing(T, E, k, std::move(idx), std::move(probs));
}

EpConfig ep_config(int P, int E_local, int align = 0, int64_t capacity = -1) {
  EpConfig c;
  c.P = P;
  c.E_local = E_local;
  c.align = align;
  c.capacity = capacity;
  return c;
}

V random_vec(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  V v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// All ranks' routings as one routing over the same experts, tokens in rank order.
Routing concatenate(const std::vector<Routing>& ranks) {
  Routing all = ranks[0];
  all.T = 0;
  all.indices.clear();
  all.map.clear();
  all.probs.clear();
  for (const Routing& r : ranks) {
    all.T += r.T;
    all.indices.insert(all.indices.end(), r.indices.begin(), r.indices.end());
    all.map.insert(all.map.end(), r.map.begin(), r.map.end());
    all.probs.insert(all.probs.end(), r.probs.begin(), r.probs.end());
  }
  return all;
}

// Rank p's part [first[p], first[p] + n[p]) * W of a concatenated array, and the inverse.
RankBuffers split(const V& all, const std::vector<int64_t>& n, int64_t W) {
  RankBuffers out;
  int64_t first = 0;
  for (int64_t np : n) {
    out.emplace_back(all.begin() + first * W, all.begin() + (first + np) * W);
    first += np;
  }
  return out;
}

// Every expert's group rows (W values per row) of a destination buffer equal, bitwise, the group
// of the same global expert in the single-GPU buffer; rows of the destination buffer past its
// groups are zero when `tail_zero`.
void expect_groups_equal(const EpPlan& ep, const RankBuffers& got, const DispatchPlan& single, const V& want,
                         int64_t W, bool tail_zero, const std::string& what) {
  for (int d = 0; d < ep.P; ++d) {
    const DispatchPlan& l = ep.local[d];
    ASSERT_EQ(got[d].size(), static_cast<size_t>(l.R * W)) << what;
    int64_t end = 0;
    for (int el = 0; el < ep.E_local; ++el) {
      const int e = d * ep.E_local + el;
      ASSERT_EQ(l.count[el], single.count[e]) << what << " expert " << e;
      ASSERT_EQ(l.padded[el], single.padded[e]) << what << " expert " << e;
      for (int64_t i = 0; i < l.padded[el] * W; ++i)
        ASSERT_EQ(got[d][l.offset[el] * W + i], want[single.offset[e] * W + i])
            << what << " expert " << e << " group value " << i;
      end = l.offset[el] + l.padded[el];
    }
    if (!tail_zero) continue;
    for (int64_t i = end * W; i < l.R * W; ++i) ASSERT_EQ(got[d][i], 0.0) << what << " rank " << d << " value " << i;
  }
}

// Fills the rows of every expert group (W = H values) of a destination or single-GPU buffer from
// (global expert, position in the group, column); pad rows and rows past the groups get `pad`.
void fill_groups(const DispatchPlan& plan, int expert_base, int64_t H, double pad, V& buf,
                 double (*f)(int e, int64_t i, int64_t h)) {
  buf.assign(static_cast<size_t>(plan.R * H), pad);
  for (int el = 0; el < plan.E; ++el)
    for (int64_t i = 0; i < plan.count[el] && plan.offset[el] + i < plan.R; ++i)
      for (int64_t h = 0; h < H; ++h) buf[(plan.offset[el] + i) * H + h] = f(expert_base + el, i, h);
}

// An arbitrary function of the row identity (expert, rank in the group, column).
double row_fn(int e, int64_t i, int64_t h) {
  return std::sin(0.7 * e + 0.31 * static_cast<double>(i) + 1.3 * static_cast<double>(h)) * (1.0 + e);
}
double row_fn2(int e, int64_t i, int64_t h) {
  return std::cos(0.9 * e - 0.17 * static_cast<double>(i) + 0.4 * static_cast<double>(h)) - 0.25;
}

// Runs dispatch, combine and both backwards on `ranks` and compares each with the single-GPU
// reference of `single_ranks` concatenated (the same routing, or the routing with the entries the
// capacity dropped removed).
void expect_matches_single(const std::vector<Routing>& ranks, const std::vector<Routing>& single_ranks,
                           const EpConfig& cfg, int64_t H, uint64_t seed) {
  SCOPED_TRACE("P=" + std::to_string(cfg.P) + " E_local=" + std::to_string(cfg.E_local) +
               " A=" + std::to_string(cfg.align) + " C=" + std::to_string(cfg.capacity) +
               " seed=" + std::to_string(seed));
  const EpPlan ep = plan_ep_dispatch(ranks, cfg);
  const Routing all = concatenate(single_ranks);
  DispatchOptions opts;
  opts.align = cfg.align;
  if (all.form == RoutingForm::kMap)  // map form needs a bound: one that every row fits in
    opts.row_bound = all.T * all.slots() + static_cast<int64_t>(all.E) * cfg.align;
  const DispatchPlan single = plan_dispatch(all, opts);
  ASSERT_EQ(single.error_bits, 0u);
  std::vector<int64_t> T, slots_n;
  for (const Routing& r : ranks) {
    T.push_back(r.T);
    slots_n.push_back(r.T * r.slots());
  }
  const int slots = all.slots();

  // (a) dispatch: every expert group bitwise equal, rows and probs.
  const V x_all = random_vec(static_cast<size_t>(all.T * H), seed);
  V x_perm(single.R * H), probs_perm(single.R);
  permute(single, x_all.data(), H, x_perm.data(), probs_perm.data());
  RankBuffers ep_x_perm, ep_probs_perm;
  ep_dispatch(ep, split(x_all, T, H), H, ep_x_perm, ep_probs_perm);
  expect_groups_equal(ep, ep_x_perm, single, x_perm, H, true, "x_perm");
  expect_groups_equal(ep, ep_probs_perm, single, probs_perm, 1, true, "probs_perm");

  // (b) combine of an arbitrary function of the rows; pad and unused rows are NaN (never read).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  V Y;
  fill_groups(single, 0, H, nan, Y, row_fn);
  RankBuffers ep_Y(cfg.P);
  for (int d = 0; d < cfg.P; ++d) fill_groups(ep.local[d], d * cfg.E_local, H, nan, ep_Y[d], row_fn);
  for (bool merge : {false, true}) {
    V y(all.T * H);
    unpermute(single, Y.data(), H, merge, y.data());
    RankBuffers ep_y;
    ep_combine(ep, ep_Y, H, merge, ep_y);
    EXPECT_EQ(ep_y, split(y, T, H)) << "combine, merge_probs=" << merge;

    // (c) combine backward: dY group by group, pad rows zero; dprobs per slot.
    const V dy = random_vec(static_cast<size_t>(all.T * H), seed + 1);
    V dY(single.R * H), dprobs(all.T * slots);
    unpermute_backward(single, Y.data(), dy.data(), H, merge, dY.data(), dprobs.data());
    RankBuffers ep_dY, ep_dprobs;
    ep_combine_backward(ep, ep_Y, split(dy, T, H), H, merge, ep_dY, ep_dprobs);
    expect_groups_equal(ep, ep_dY, single, dY, H, true, "combine backward dY");
    EXPECT_EQ(ep_dprobs, split(dprobs, T, slots)) << "combine backward dprobs, merge_probs=" << merge;
  }

  // (c) dispatch backward: gradients defined per row identity (pad rows carry values too: they
  // must not reach dx).
  V d_x_perm, d_probs_perm;
  fill_groups(single, 0, H, 5.0, d_x_perm, row_fn2);
  fill_groups(single, 0, 1, 7.0, d_probs_perm, row_fn);
  RankBuffers ep_d_x_perm(cfg.P), ep_d_probs_perm(cfg.P);
  for (int d = 0; d < cfg.P; ++d) {
    fill_groups(ep.local[d], d * cfg.E_local, H, 5.0, ep_d_x_perm[d], row_fn2);
    fill_groups(ep.local[d], d * cfg.E_local, 1, 7.0, ep_d_probs_perm[d], row_fn);
  }
  V dx(all.T * H), dprobs(all.T * slots);
  permute_backward(single, d_x_perm.data(), d_probs_perm.data(), H, dx.data(), dprobs.data());
  RankBuffers ep_dx, ep_dprobs;
  ep_dispatch_backward(ep, ep_d_x_perm, ep_d_probs_perm, H, ep_dx, ep_dprobs);
  EXPECT_EQ(ep_dx, split(dx, T, H)) << "dispatch backward dx";
  EXPECT_EQ(ep_dprobs, split(dprobs, T, slots)) << "dispatch backward dprobs";
  // Without prob gradients: dprobs zero, dx unchanged.
  ep_dispatch_backward(ep, ep_d_x_perm, {}, H, ep_dx, ep_dprobs);
  EXPECT_EQ(ep_dx, split(dx, T, H));
  for (int p = 0; p < cfg.P; ++p) EXPECT_EQ(ep_dprobs[p], V(slots_n[p], 0.0));
}

// ---------------------------------------------------------------------------------------------
// Hand-computed: P = 2, E_local = 2 (rank 0 owns experts 0, 1; rank 1 owns 2, 3), k = 2, H = 1.
//   rank 0: t0 -> {0, 3}, t1 -> {2, 1}, t2 -> {3, 2}        x_0 = [10, 11, 12]
//   rank 1: t0 -> {1, 2}, t1 -> {0, empty}                  x_1 = [20, 21]
std::vector<Routing> hand_routing() { return {topk(3, 4, 2, {0, 3, 2, 1, 3, 2}), topk(2, 4, 2, {1, 2, 0, -1})}; }
const RankBuffers hand_x = {{10, 11, 12}, {20, 21}};

TEST(EpDispatch, HandComputedDropless) {
  const EpPlan ep = plan_ep_dispatch(hand_routing(), ep_config(2, 2));
  // Pack of rank 0, by destination then token then slot: for rank 0 t0s0 (e0), t1s1 (e1); for
  // rank 1 t0s1 (e3), t1s0 (e2), t2s0 (e3), t2s1 (e2).
  EXPECT_EQ(ep.send[0].slot_row, (V64{0, 2, 3, 1, 4, 5}));
  EXPECT_EQ(ep.send[0].count, (V64{2, 4}));
  EXPECT_EQ(ep.send[0].offset, (V64{0, 2}));
  EXPECT_EQ(ep.send[0].slot_expert, (std::vector<int32_t>{0, 1, 1, 0, 1, 1}));  // destination ranks
  // Rank 1: for rank 0 t0s0 (e1), t1s0 (e0); for rank 1 t0s1 (e2).
  EXPECT_EQ(ep.send[1].slot_row, (V64{0, 2, 1, -1}));
  EXPECT_EQ(ep.sent, (V64{2, 4, 2, 1}));
  EXPECT_EQ(ep.dropped, (V64{0, 0, 0, 0}));
  // Receive buffers, source-rank order.
  EXPECT_EQ(ep.recv_rank[0], (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(ep.recv_slot[0], (V64{0, 3, 0, 2}));
  EXPECT_EQ(ep.recv_rank[1], (std::vector<int32_t>{0, 0, 0, 0, 1}));
  EXPECT_EQ(ep.recv_slot[1], (V64{1, 2, 4, 5, 1}));
  EXPECT_EQ(ep.recv_offset[1], (V64{0, 4}));
  // Local stage, expert-major then receive order. Rank 0: e0 <- (r0 t0, r1 t1), e1 <- (r0 t1, r1 t0).
  EXPECT_EQ(ep.local[0].count, (V64{2, 2}));
  EXPECT_EQ(ep.local[0].slot_row, (V64{0, 2, 3, 1}));
  // Rank 1: e2 <- (r0 t1, r0 t2, r1 t0), e3 <- (r0 t0, r0 t2).
  EXPECT_EQ(ep.local[1].count, (V64{3, 2}));
  EXPECT_EQ(ep.local[1].slot_row, (V64{3, 0, 4, 1, 2}));
  EXPECT_EQ(ep.error_bits, (std::vector<uint32_t>{0, 0}));

  RankBuffers send, send_probs, x_perm, probs_perm;
  ep_pack(ep, hand_x, 1, send, send_probs);
  EXPECT_EQ(send, (RankBuffers{{10, 11, 10, 11, 12, 12}, {20, 21, 20}}));
  ep_dispatch(ep, hand_x, 1, x_perm, probs_perm);
  EXPECT_EQ(x_perm, (RankBuffers{{10, 21, 11, 20}, {11, 12, 20, 10, 12}}));
  // probs are 0.125 * (slot index + 1) on each rank.
  EXPECT_EQ(probs_perm, (RankBuffers{{0.125, 0.375, 0.5, 0.125}, {0.375, 0.75, 0.25, 0.25, 0.625}}));

  // Combine with Y = 2 * x_perm, no merged probs: every token gets 2 * x per routed slot.
  RankBuffers y;
  ep_combine(ep, {{20, 42, 22, 40}, {22, 24, 40, 20, 24}}, 1, false, y);
  EXPECT_EQ(y, (RankBuffers{{40, 44, 48}, {80, 42}}));

  // With A = 16 each local expert group is padded to 16 rows.
  const EpPlan a = plan_ep_dispatch(hand_routing(), ep_config(2, 2, 16));
  EXPECT_EQ(a.local[1].offset, (V64{0, 16}));
  EXPECT_EQ(a.local[1].R, 5 + 2 * 15);
  ep_dispatch(a, hand_x, 1, x_perm, probs_perm);
  EXPECT_EQ(x_perm[1][0], 11);
  EXPECT_EQ(x_perm[1][2], 20);
  EXPECT_EQ(x_perm[1][3], 0);  // pad
  EXPECT_EQ(x_perm[1][16], 10);
  EXPECT_EQ(x_perm[1][17], 12);
  EXPECT_EQ(x_perm[1][18], 0);
}

TEST(EpDispatch, HandComputedCapacity) {
  // C = 1: each (source, destination) pair sends its first entry in (token, slot) order only.
  const EpPlan ep = plan_ep_dispatch(hand_routing(), ep_config(2, 2, 0, 1));
  EXPECT_EQ(ep.sent, (V64{1, 1, 1, 1}));
  EXPECT_EQ(ep.dropped, (V64{1, 3, 1, 0}));
  EXPECT_EQ(ep.total_dropped(), 5);
  EXPECT_EQ(ep.error_bits, (std::vector<uint32_t>{kErrRowOverflow, kErrRowOverflow}));
  EXPECT_EQ(ep.send[0].slot_row, (V64{0, 1, -1, -1, -1, -1}));
  EXPECT_EQ(ep.send[0].slot_prob[3], 0.5);  // a dropped entry keeps its prob, as plan_dispatch does
  EXPECT_EQ(ep.send[1].slot_row, (V64{0, 1, -1, -1}));
  EXPECT_EQ(ep.send_rows(0), 2);
  EXPECT_EQ(ep.recv_rows(1), 2);
  RankBuffers x_perm, probs_perm;
  ep_dispatch(ep, hand_x, 1, x_perm, probs_perm);
  EXPECT_EQ(x_perm, (RankBuffers{{10, 20}, {20, 10}}));  // rank 1: e2 <- r1 t0, e3 <- r0 t0
  RankBuffers y;
  ep_combine(ep, {{1, 2}, {3, 4}}, 1, false, y);
  EXPECT_EQ(y, (RankBuffers{{1 + 4, 0, 0}, {2 + 3, 0}}));

  // Capacity 2: only rank 0 -> 1 overflows; rank 1's block for rank 1 has an unused row (zero).
  const EpPlan c2 = plan_ep_dispatch(hand_routing(), ep_config(2, 2, 0, 2));
  EXPECT_EQ(c2.dropped, (V64{0, 2, 0, 0}));
  EXPECT_EQ(c2.error_bits, (std::vector<uint32_t>{kErrRowOverflow, 0}));
  RankBuffers send, send_probs;
  ep_pack(c2, hand_x, 1, send, send_probs);
  EXPECT_EQ(send, (RankBuffers{{10, 11, 10, 11}, {20, 21, 20, 0}}));
  EXPECT_EQ(send_probs[1], (V{0.125, 0.375, 0.25, 0}));
  RankBuffers recv;
  ep_exchange(c2, send, 1, recv);
  EXPECT_EQ(recv, (RankBuffers{{10, 11, 20, 21}, {10, 11, 20, 0}}));
  EXPECT_EQ(c2.recv_rank[1], (std::vector<int32_t>{0, 0, 1, -1}));
}

// ---------------------------------------------------------------------------------------------
struct Case {
  int P, E_local, k;
  std::vector<int64_t> T;  // per rank
};

std::vector<Case> cases() {
  return {
      {1, 4, 2, {37}},          {1, 8, 1, {0}},
      {2, 2, 2, {23, 0}},       {2, 3, 3, {0, 19}},        {2, 1, 2, {31, 17}},
      {4, 2, 2, {13, 0, 29, 5}}, {4, 3, 4, {8, 8, 8, 8}},  {4, 1, 1, {0, 0, 0, 11}},
      {8, 1, 2, {9, 0, 3, 17, 0, 6, 12, 1}}, {8, 2, 4, {5, 7, 0, 0, 21, 2, 9, 4}},
  };
}

std::vector<Routing> make_ranks(const Case& c, uint64_t seed, double skew) {
  std::vector<Routing> ranks;
  for (size_t p = 0; p < c.T.size(); ++p)
    ranks.push_back(make_topk_routing(c.T[p], c.P * c.E_local, c.k, seed + 101 * p, skew));
  return ranks;
}

TEST(EpDispatch, DroplessEqualsSingleGpu) {
  uint64_t seed = 1;
  for (const Case& c : cases())
    for (int A : {0, 16, 128})
      for (double skew : {0.0, 2.0}) {
        const std::vector<Routing> ranks = make_ranks(c, seed, skew);
        expect_matches_single(ranks, ranks, ep_config(c.P, c.E_local, A), 3, seed++);
      }
}

TEST(EpDispatch, EmptySlotsAndBadEntriesAreSkippedAsSingleGpu) {
  // Empty slots, an out-of-range id and a duplicate on some ranks: each rank flags its own, the
  // rest equals the single-GPU result (which skips the same entries).
  std::vector<Routing> ranks = make_ranks({4, 2, 3, {6, 0, 9, 4}}, 77, 1.0);
  ranks[0].indices[1] = -1;
  ranks[0].indices[4] = 99;                     // out of range
  ranks[2].indices[5] = ranks[2].indices[4];    // duplicate of the token's earlier slot
  ranks[3].probs[2] = std::numeric_limits<double>::infinity();
  const EpPlan ep = plan_ep_dispatch(ranks, ep_config(4, 2, 16));
  EXPECT_EQ(ep.error_bits, (std::vector<uint32_t>{kErrExpertOutOfRange, 0, kErrDuplicateExpert, kErrNonFiniteProb}));
  std::vector<Routing> cleaned = ranks;  // the single-GPU reference of all ranks would flag them too
  cleaned[0].indices[4] = -1;
  cleaned[2].indices[5] = -1;
  cleaned[3].indices[2] = -1;
  expect_matches_single(ranks, cleaned, ep_config(4, 2, 16), 2, 78);
}

TEST(EpDispatch, MapFormEqualsSingleGpu) {
  std::vector<Routing> ranks;
  for (int64_t T : {7, 0, 12}) ranks.push_back(topk_to_map(make_topk_routing(T, 6, 2, 40 + T)));
  const EpPlan ep = plan_ep_dispatch(ranks, ep_config(3, 2, 16));
  EXPECT_EQ(ep.slots, 6);
  expect_matches_single(ranks, ranks, ep_config(3, 2, 16), 2, 41);
}

// The entries the capacity must drop, computed independently: per source rank, in (token, slot)
// order, the entries past the first C for each destination.
std::vector<Routing> without_dropped(const std::vector<Routing>& ranks, int P, int E_local, int64_t C,
                                     V64& dropped) {
  std::vector<Routing> out = ranks;
  dropped.assign(static_cast<size_t>(P) * P, 0);
  for (int s = 0; s < P; ++s) {
    V64 taken(P, 0);
    for (size_t i = 0; i < out[s].indices.size(); ++i) {
      const int32_t e = out[s].indices[i];
      if (e < 0) continue;
      const int d = e / E_local;
      if (taken[d] < C) {
        ++taken[d];
      } else {
        ++dropped[static_cast<size_t>(s) * P + d];
        out[s].indices[i] = -1;
      }
    }
  }
  return out;
}

TEST(EpDispatch, CapacityDropsAreCountedFlaggedAndNeverWritten) {
  uint64_t seed = 500;
  for (const Case& c : cases())
    for (int A : {0, 16, 128})
      for (double skew : {0.0, 3.0}) {
        const std::vector<Routing> ranks = make_ranks(c, seed, skew);
        // Capacities from "nothing fits" to "everything fits".
        int64_t max_pair = 0;
        const EpPlan full = plan_ep_dispatch(ranks, ep_config(c.P, c.E_local, A));
        for (int64_t n : full.sent) max_pair = std::max(max_pair, n);
        for (int64_t C : {int64_t{0}, int64_t{1}, max_pair / 2, max_pair}) {
          V64 want_dropped;
          const std::vector<Routing> kept = without_dropped(ranks, c.P, c.E_local, C, want_dropped);
          const EpPlan ep = plan_ep_dispatch(ranks, ep_config(c.P, c.E_local, A, C));
          EXPECT_EQ(ep.dropped, want_dropped) << "C=" << C;
          for (int s = 0; s < c.P; ++s) {
            int64_t from_s = 0;
            for (int d = 0; d < c.P; ++d) {
              from_s += want_dropped[static_cast<size_t>(s) * c.P + d];
              EXPECT_EQ(ep.sent[static_cast<size_t>(s) * c.P + d],
                        std::min(C, full.sent[static_cast<size_t>(s) * c.P + d]));
            }
            // Only the source's own word: a destination-local overflow cannot happen with the
            // default R_d = P * C + E_local * (A - 1).
            EXPECT_EQ(ep.error_bits[s], from_s > 0 ? static_cast<uint32_t>(kErrRowOverflow) : 0u) << "rank " << s;
            EXPECT_EQ(ep.send_rows(s), c.P * C);  // static: known on the host before any routing
            EXPECT_EQ(ep.recv_rows(s), c.P * C);
          }
          expect_matches_single(ranks, kept, ep_config(c.P, c.E_local, A, C), 3, seed);
        }
        ++seed;
      }
}

TEST(EpDispatch, DestinationRowBoundOverflowIsFlagged) {
  // R_d smaller than the received groups: rows past R_d are not written (as single-GPU dispatch),
  // flagged on the destination, and their tokens get nothing back in combine.
  const std::vector<Routing> ranks = hand_routing();
  EpConfig cfg = ep_config(2, 2);
  cfg.row_bound = 4;
  const EpPlan ep = plan_ep_dispatch(ranks, cfg);
  EXPECT_EQ(ep.error_bits, (std::vector<uint32_t>{0, kErrRowOverflow}));
  // Rank 1's rows: e2 <- (r0 t1, r0 t2, r1 t0) rows 0..2, e3 <- (r0 t0, r0 t2): only r0 t0 fits.
  EXPECT_EQ(ep.local[1].slot_row, (V64{3, 0, -1, 1, 2}));
  RankBuffers x_perm, probs_perm, y;
  ep_dispatch(ep, hand_x, 1, x_perm, probs_perm);
  EXPECT_EQ(x_perm[1], (V{11, 12, 20, 10}));
  ep_combine(ep, {{1, 2, 3, 4}, {5, 6, 7, 8}}, 1, false, y);
  // In slot order -- r0: t0 <- row 0 of rank 0, row 3 of rank 1; t1 <- row 0 of rank 1, row 2 of
  // rank 0; t2 <- (slot 0 not delivered), row 1 of rank 1. r1: t0 <- row 3 of rank 0, row 2 of
  // rank 1; t1 <- row 1 of rank 0.
  EXPECT_EQ(y, (RankBuffers{{1 + 8, 5 + 3, 6}, {4 + 7, 2}}));
  RankBuffers dx, dprobs;
  ep_dispatch_backward(ep, {{1, 2, 3, 4}, {5, 6, 7, 8}}, {{1, 2, 3, 4}, {5, 6, 7, 8}}, 1, dx, dprobs);
  EXPECT_EQ(dx, (RankBuffers{{1 + 8, 5 + 3, 6}, {4 + 7, 2}}));
  EXPECT_EQ(dprobs[0], (V{1, 8, 5, 3, 0, 6}));  // r0 t2 slot 0 (e3) was not delivered
}

TEST(EpDispatch, SingleRankEqualsSingleGpuExactly) {
  // (e) P = 1: the whole plan and buffers equal the single-GPU ones, not only the groups.
  for (int A : {0, 16, 128})
    for (int64_t T : {0, 1, 40}) {
      const Routing r = make_topk_routing(T, 5, 2, 9 + T, 1.0);
      DispatchOptions opts;
      opts.align = A;
      const DispatchPlan single = plan_dispatch(r, opts);
      for (int64_t C : {int64_t{-1}, T * 2}) {
        const EpPlan ep = plan_ep_dispatch({r}, ep_config(1, 5, A, C));
        const DispatchPlan& l = ep.local[0];
        EXPECT_EQ(l.R, single.R);
        EXPECT_EQ(l.count, single.count);
        EXPECT_EQ(l.padded, single.padded);
        EXPECT_EQ(l.offset, single.offset);
        const V x = random_vec(static_cast<size_t>(T * 4), 3);
        V x_perm(single.R * 4), probs_perm(single.R);
        permute(single, x.data(), 4, x_perm.data(), probs_perm.data());
        RankBuffers ep_x_perm, ep_probs_perm;
        ep_dispatch(ep, {x}, 4, ep_x_perm, ep_probs_perm);
        EXPECT_EQ(ep_x_perm[0], x_perm);
        EXPECT_EQ(ep_probs_perm[0], probs_perm);
        EXPECT_EQ(ep.error_bits[0], 0u);
      }
    }
}

TEST(EpDispatch, BadArgumentsNameTheArgument) {
  const std::vector<Routing> ranks = hand_routing();
  expect_error_naming([&] { plan_ep_dispatch(ranks, ep_config(3, 2)); }, "routing");
  expect_error_naming([&] { plan_ep_dispatch(ranks, ep_config(2, 3)); }, "routing[0].E");
  expect_error_naming([&] { plan_ep_dispatch(ranks, ep_config(2, 2, 8)); }, "config.align");
  expect_error_naming([&] { plan_ep_dispatch(ranks, ep_config(2, 2, 0, -2)); }, "config.capacity");
  expect_error_naming([&] { plan_ep_dispatch(ranks, ep_config(0, 2)); }, "config.P");
  std::vector<Routing> mixed = ranks;
  mixed[1] = topk(2, 4, 1, {1, 2});
  expect_error_naming([&] { plan_ep_dispatch(mixed, ep_config(2, 2)); }, "routing[1]");
  const EpPlan ep = plan_ep_dispatch(ranks, ep_config(2, 2));
  RankBuffers out, out2;
  expect_error_naming([&] { ep_dispatch(ep, {{10, 11, 12}}, 1, out, out2); }, "x");
  expect_error_naming([&] { ep_dispatch(ep, {{10, 11}, {20, 21}}, 1, out, out2); }, "x[0]");
  expect_error_naming([&] { ep_combine(ep, {{1}, {2}}, 1, false, out); }, "Y[0]");
}

}  // namespace
}  // namespace moe::ref
