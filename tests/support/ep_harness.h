// Expert-parallel test harness shared by the GPU tests: one case (P ranks, routing per rank), its
// host inputs, and a run of every EpDispatcher op on every rank -- over any transport, each rank a
// host thread on its own device and stream (the in-process group: all on one device, one stream).
// Outputs come back as bytes, so two runs can be compared bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "moe/error_word.h"
#include "moe/expert_parallel.h"
#include "reference/ep_dispatch_ref.h"
#include "reference/routing_gen.h"
#include "support/gpu.h"
#include "support/row_codec.h"

namespace moe::testing {

struct EpCase {
  std::string name;
  RoutingForm form = RoutingForm::kTopK;
  int P = 2;
  int E_local = 2;
  int k = 2;  // top-k, or the most experts per token in map form
  int A = 0;
  int64_t C = 16;
  std::vector<int64_t> T;  // per rank
  int64_t H = 64;
  DType dt = DType::kBF16;
  double skew = 0.0;
  uint64_t seed = 1;
  int64_t row_bound = -1;
  int chunks = 1;
  EpMode mode = EpMode::kCapacity;
  int64_t dropless_max_rows = -1;

  bool dropless() const { return mode == EpMode::kDroplessEager; }
  int E() const { return P * E_local; }
  int slots() const { return form == RoutingForm::kTopK ? k : E(); }
  int64_t T_max() const {
    int64_t m = 0;
    for (int64_t t : T) m = std::max(m, t);
    return m;
  }
  EpDispatcherConfig config() const {
    EpDispatcherConfig c;
    c.ranks = P;
    c.local_experts = E_local;
    c.hidden = H;
    c.row_dtype = dt;
    c.form = form;
    c.topk = k;
    c.align = A;
    c.capacity = C;
    c.max_tokens = T_max();
    c.row_bound = row_bound;
    c.chunks = chunks;
    c.mode = mode;
    c.dropless_max_rows = dropless_max_rows;
    return c;
  }
  // Dropless mode: the receive bound and R_d the dispatcher documents (EpDispatcherConfig), worked
  // out here independently; the reference's x_perm gets the same R_d, so a dispatcher that sized
  // its x_perm otherwise fails the comparison.
  int64_t dropless_rows() const {
    return dropless_max_rows >= 0 ? dropless_max_rows : P * T_max() * std::min<int64_t>(slots(), E_local);
  }
  ref::EpConfig ref_config() const {
    ref::EpConfig c;
    c.P = P;
    c.E_local = E_local;
    c.align = A;
    c.capacity = dropless() ? -1 : C;
    c.row_bound = row_bound;
    if (dropless() && row_bound < 0) c.row_bound = dropless_rows() + (A > 0 ? int64_t{E_local} * (A - 1) : 0);
    return c;
  }
};

// ---- values ----

inline std::vector<double> to_double(const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); }

// A value in [-1, 1) representable in dt, a pure function of its key (the same rows whatever the
// layout they sit in).
inline double keyed_value(uint64_t seed, uint64_t a, uint64_t b, uint64_t c, DType dt) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + a * 0xBF58476D1CE4E5B9ull + b * 0x94D049BB133111EBull + c;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return round_to(static_cast<double>(z >> 11) * std::ldexp(1.0, -52) - 1.0, dt);
}

inline std::vector<double> random_rows(int64_t rows, int64_t H, DType dt, uint64_t seed) {
  std::vector<double> v(static_cast<size_t>(rows * H));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) v[r * H + h] = keyed_value(seed, 7, r, h, dt);
  return v;
}

// ---- host inputs ----

struct EpInputs {
  std::vector<ref::Routing> routing;  // [P], global expert ids
  ref::RankBuffers x;                 // [P][T_p * H]
};

inline EpInputs make_ep_inputs(const EpCase& c, uint64_t seed) {
  EpInputs in;
  for (int p = 0; p < c.P; ++p) {
    const uint64_t s = seed * 1000 + p;
    in.routing.push_back(c.form == RoutingForm::kTopK ? ref::make_topk_routing(c.T[p], c.E(), c.k, s, c.skew)
                                                      : ref::make_map_routing(c.T[p], c.E(), c.k, s));
    in.x.push_back(random_rows(c.T[p], c.H, c.dt, s + 17));
  }
  return in;
}

// Every valid entry of every rank on rank 0's experts, expert 0 in every token (top-k: token t's
// slot s holds expert (s + t) % k, so expert 0 moves through the slots; needs k <= E_local; map
// form: expert 0 added to every token): no capacity short of all the tokens holds expert 0's rows.
inline void concentrate_routing(const EpCase& c, EpInputs& in) {
  for (int p = 0; p < c.P; ++p) {
    ref::Routing& r = in.routing[p];
    for (int64_t t = 0; t < r.T; ++t) {
      if (c.form == RoutingForm::kTopK)
        for (int s = 0; s < c.k; ++s) r.indices[t * c.k + s] = static_cast<int32_t>((s + t) % c.k);
      else if (!r.map[t * c.E()]) {
        r.map[t * c.E()] = 1;
        r.probs[t * c.E()] = (1 + t % 7) / 8.0;  // exact in fp32
      }
    }
  }
}

// All ranks as one batch: their routings (global expert ids) and their rows in rank order.
inline ref::Routing concatenate_routing(const EpCase& c, const std::vector<ref::Routing>& routing) {
  ref::Routing all;
  all.form = c.form;
  all.E = c.E();
  all.k = c.k;
  for (const ref::Routing& r : routing) {
    all.T += r.T;
    all.indices.insert(all.indices.end(), r.indices.begin(), r.indices.end());
    all.map.insert(all.map.end(), r.map.begin(), r.map.end());
    all.probs.insert(all.probs.end(), r.probs.begin(), r.probs.end());
  }
  return all;
}

inline std::vector<double> concatenate_rows(const ref::RankBuffers& rows) {
  std::vector<double> all;
  for (const auto& r : rows) all.insert(all.end(), r.begin(), r.end());
  return all;
}

// ---- a world of ranks ----

struct EpWorld {
  int P = 0;
  std::vector<int> device;             // [P]
  std::vector<cudaStream_t> stream;    // [P] each rank's (compute) stream
  std::vector<cudaStream_t> comm;      // [P] each rank's communication stream of the overlapped pipeline
  std::vector<EpTransport*> transport;  // [P]
  std::function<void()> abort;         // wakes ranks blocked in a collective after a failure
};

// P simulated ranks on device 0 (InProcessGroup), sharing one stream: the transport's, every
// rank's communication stream. With own_compute_streams each rank computes on a stream of its own
// (the overlapped pipeline then really runs the ranks' compute concurrently with the shared
// stream's copies; the stage-by-stage methods, which exchange on the compute stream, need the
// shared one).
struct InProcessWorld {
  std::unique_ptr<InProcessGroup> group;
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> own;  // [P] with own_compute_streams
  EpWorld w;

  explicit InProcessWorld(int P, bool own_compute_streams = false) : group(std::make_unique<InProcessGroup>(P)) {
    MOE_CUDA_CHECK(cudaSetDevice(0));
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    w.P = P;
    w.device.assign(P, 0);
    w.stream.assign(P, stream);
    w.comm.assign(P, stream);
    if (own_compute_streams) {
      own.resize(P);
      for (int p = 0; p < P; ++p) MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&own[p], cudaStreamNonBlocking));
      w.stream = own;
    }
    for (int p = 0; p < P; ++p) w.transport.push_back(&group->endpoint(p));
    w.abort = [g = group.get()] { g->abort(); };
  }
  ~InProcessWorld() {
    for (cudaStream_t s : own) cudaStreamDestroy(s);
    cudaStreamDestroy(stream);
  }
  InProcessWorld(const InProcessWorld&) = delete;
  InProcessWorld& operator=(const InProcessWorld&) = delete;
};

// fn(p) on P threads, each on its rank's device; rethrows the first failure after all joined.
inline void run_ranks(const EpWorld& w, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(w.P);
  std::vector<std::thread> threads;
  for (int p = 0; p < w.P; ++p)
    threads.emplace_back([&, p] {
      try {
        MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
        fn(p);
      } catch (...) {
        errors[p] = std::current_exception();
        if (w.abort) w.abort();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

inline void sync_world(const EpWorld& w) {
  for (int p = 0; p < w.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    MOE_CUDA_CHECK(cudaStreamSynchronize(w.stream[p]));
    if (p < static_cast<int>(w.comm.size())) MOE_CUDA_CHECK(cudaStreamSynchronize(w.comm[p]));
  }
}

// Device resources of one rank.
struct EpRank {
  std::unique_ptr<EpDispatcher> ep;
  SavedState state;
  std::unique_ptr<ErrorWord> err;
  DeviceBuffer<int32_t> indices;
  DeviceBuffer<uint8_t> map;
  DeviceBuffer<float> probs;
  DeviceBuffer<uint8_t> x, x_perm, Y, y, dy, dY, d_x_perm, dx;
  DeviceBuffer<float> d_probs_perm, dprobs_combine, dprobs_dispatch;
  int64_t T = 0;
};

// What one rank's run produced, as raw bytes / integers.
struct EpRankOut {
  Bytes x_perm, send, recv, y, dY, dx;
  std::vector<float> probs_perm, send_probs, recv_probs, dprobs_combine, dprobs_dispatch;
  std::vector<int32_t> group_offsets, counts, slot_rows;
  std::vector<int64_t> dropped;
  uint32_t error_bits = 0;
};

inline RoutingView routing_view(const EpCase& c, EpRank& r) {
  RoutingView v;
  v.form = c.form;
  v.probs = TensorView(r.probs.get(), DType::kFP32, {r.T, c.slots()});
  if (c.form == RoutingForm::kTopK)
    v.indices = TensorView(r.indices.get(), DType::kInt32, {r.T, c.k});
  else
    v.map = TensorView(r.map.get(), DType::kUInt8, {r.T, c.E()});
  return v;
}

inline TensorView rows_view(const EpCase& c, const DeviceBuffer<uint8_t>& b, int64_t rows) {
  return TensorView(b.get(), c.dt, {rows, c.H});
}

// Routing and x of rank p into its (already sized) buffers.
inline void upload_routing(const EpCase& c, const EpInputs& in, int p, EpRank& r) {
  const ref::Routing& rt = in.routing[p];
  std::vector<float> probs(rt.probs.begin(), rt.probs.end());
  r.probs.upload(probs);
  if (c.form == RoutingForm::kTopK)
    r.indices.upload(rt.indices);
  else
    r.map.upload(rt.map);
  r.x.upload(encode(in.x[p], c.dt));
}

// Makes every rank's dispatcher, state and buffers (on the rank's device) and uploads the inputs.
inline std::vector<EpRank> make_ranks(const EpCase& c, const EpWorld& w, const EpInputs& in) {
  std::vector<EpRank> ranks(c.P);
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    EpRank& r = ranks[p];
    r.T = c.T[p];
    r.ep = std::make_unique<EpDispatcher>(c.config(), *w.transport[p]);
    r.state = r.ep->new_state();
    r.err = std::make_unique<ErrorWord>();
    const int64_t R = r.ep->rows(), row = c.H * elem_bytes(c.dt), S = c.slots();
    r.probs = DeviceBuffer<float>(r.T * S);
    if (c.form == RoutingForm::kTopK)
      r.indices = DeviceBuffer<int32_t>(r.T * S);
    else
      r.map = DeviceBuffer<uint8_t>(r.T * S);
    r.x = DeviceBuffer<uint8_t>(r.T * row);
    r.y = DeviceBuffer<uint8_t>(r.T * row);
    r.dy = DeviceBuffer<uint8_t>(r.T * row);
    r.dx = DeviceBuffer<uint8_t>(r.T * row);
    r.x_perm = DeviceBuffer<uint8_t>(R * row);
    r.Y = DeviceBuffer<uint8_t>(R * row);
    r.dY = DeviceBuffer<uint8_t>(R * row);
    r.d_x_perm = DeviceBuffer<uint8_t>(R * row);
    r.d_probs_perm = DeviceBuffer<float>(R);
    r.dprobs_combine = DeviceBuffer<float>(r.T * S);
    r.dprobs_dispatch = DeviceBuffer<float>(r.T * S);
    upload_routing(c, in, p, r);
    // Poison the outputs: a row the ops fail to write shows up.
    for (auto* b : {&r.x_perm, &r.y, &r.dY, &r.dx}) b->fill_bytes(0x7f);
    r.dprobs_combine.fill_bytes(0x7f);
    r.dprobs_dispatch.fill_bytes(0x7f);
  }
  return ranks;
}

// The forward dispatch on every rank (enqueued only).
inline void enqueue_dispatch(const EpCase& c, const EpWorld& w, std::vector<EpRank>& ranks) {
  run_ranks(w, [&](int p) {
    EpRank& r = ranks[p];
    r.ep->plan_and_dispatch(routing_view(c, r), rows_view(c, r.x, r.T), r.err->device_ptr(), r.state,
                            rows_view(c, r.x_perm, r.ep->rows()), w.stream[p]);
  });
}

// Combine, combine backward and dispatch backward on every rank (enqueued only); merge: kPlanned.
inline void enqueue_combine_and_backward(const EpCase& c, const EpWorld& w, std::vector<EpRank>& ranks) {
  run_ranks(w, [&](int p) {
    EpRank& r = ranks[p];
    const int64_t R = r.ep->rows(), S = c.slots();
    const TensorView Y = rows_view(c, r.Y, R);
    r.ep->combine(r.state, Y, rows_view(c, r.y, r.T), MergeProbs::kPlanned, w.stream[p]);
    const TensorView dpc(r.dprobs_combine.get(), DType::kFP32, {r.T, S});
    r.ep->combine_backward(r.state, rows_view(c, r.dy, r.T), rows_view(c, r.dY, R), MergeProbs::kPlanned,
                           w.stream[p], nullptr, &Y, &dpc);
    const TensorView dpp(r.d_probs_perm.get(), DType::kFP32, {R});
    const TensorView dpd(r.dprobs_dispatch.get(), DType::kFP32, {r.T, S});
    r.ep->dispatch_backward(r.state, rows_view(c, r.d_x_perm, R), rows_view(c, r.dx, r.T), w.stream[p], &dpp, &dpd);
  });
}

template <typename T>
std::vector<T> download_view(const TensorView& v) {
  std::vector<T> h(static_cast<size_t>(v.numel()));
  if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(h.data(), v.data, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}
inline Bytes download_bytes(const TensorView& v) {
  Bytes h(static_cast<size_t>(v.nbytes()));
  if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(h.data(), v.data, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

// After a (synchronised) dispatch: everything the forward produced, the workspaces included; the
// per-chunk views (probs_perm, group offsets, local counts) of every chunk, concatenated in chunk
// order.
inline void download_dispatch(const EpWorld& w, std::vector<EpRank>& ranks, std::vector<EpRankOut>& out) {
  out.resize(ranks.size());
  for (size_t p = 0; p < ranks.size(); ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    EpRank& r = ranks[p];
    EpRankOut& o = out[p];
    o.x_perm = r.x_perm.download();
    o.send = download_bytes(r.ep->send_buffer());
    o.recv = download_bytes(r.ep->recv_buffer());
    o.recv_probs = download_view<float>(r.ep->recv_probs());
    if (r.ep->mode() == EpMode::kDroplessEager) {  // the dispatch's rows are the first sent / received ones
      int64_t sent = 0, received = 0;
      for (int64_t n : r.ep->sent_rows(r.state)) sent += n;
      for (int64_t n : r.ep->received_rows(r.state)) received += n;
      const size_t row = o.send.size() / static_cast<size_t>(r.ep->exchange_rows());
      o.send.resize(static_cast<size_t>(sent) * row);
      o.recv.resize(static_cast<size_t>(received) * row);
      o.recv_probs.resize(static_cast<size_t>(received));
    }
    o.send_probs = download_view<float>(r.ep->send_probs(r.state));
    o.probs_perm.clear();
    o.group_offsets.clear();
    o.counts.clear();
    for (int j = 0; j < r.ep->chunks(); ++j) {
      const std::vector<float> pp = download_view<float>(r.ep->probs_perm(r.state, j));
      const std::vector<int32_t> g = download_view<int32_t>(r.ep->group_offsets(r.state, j));
      const std::vector<int32_t> n = download_view<int32_t>(r.ep->local_counts(r.state, DType::kInt32, j));
      o.probs_perm.insert(o.probs_perm.end(), pp.begin(), pp.end());
      o.group_offsets.insert(o.group_offsets.end(), g.begin(), g.end());
      o.counts.insert(o.counts.end(), n.begin(), n.end());
    }
    o.slot_rows = download_view<int32_t>(r.ep->slot_rows(r.state));
    o.dropped = download_view<int64_t>(r.ep->dropped(r.state));
    o.error_bits = r.err->fetch_and_clear(w.stream[p]);
  }
}

inline void download_backward(const EpWorld& w, std::vector<EpRank>& ranks, std::vector<EpRankOut>& out) {
  for (size_t p = 0; p < ranks.size(); ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    EpRank& r = ranks[p];
    out[p].y = r.y.download();
    out[p].dY = r.dY.download();
    out[p].dx = r.dx.download();
    out[p].dprobs_combine = r.dprobs_combine.download();
    out[p].dprobs_dispatch = r.dprobs_dispatch.download();
  }
}

// Expert-group rows of one rank's x_perm layout: fn(global expert, row within group) -> the row's
// values (H doubles); pad rows and rows past the groups get `pad`.
inline std::vector<double> group_rows(const EpCase& c, int rank, const std::vector<int32_t>& g,
                                      const std::vector<int32_t>& counts, int64_t R, double pad,
                                      const std::function<double(int, int64_t, int64_t)>& fn) {
  std::vector<double> v(static_cast<size_t>(R * c.H), pad);
  for (int e = 0; e < c.E_local; ++e) {
    const int64_t rows = std::min<int64_t>(counts[e], g[e + 1] - g[e]);
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t h = 0; h < c.H; ++h) v[(g[e] + j) * c.H + h] = fn(rank * c.E_local + e, j, h);
  }
  return v;
}

// The backward inputs of one rank, keyed so that any layout of the same rows gets the same values:
// Y and d_x_perm rows by (global expert, row in group), pad rows NaN (reading one shows);
// d_probs_perm keyed like the rows; dy by global token (the rank's tokens are first .. first + T).
// g, counts: the rank's group offsets and local counts; R its rows.
struct KeyedBackwardInputs {
  std::vector<double> Y, d_x_perm, dy;
  std::vector<float> d_probs_perm;
};

inline KeyedBackwardInputs keyed_backward_inputs(const EpCase& c, int rank, const std::vector<int32_t>& g,
                                                 const std::vector<int32_t>& counts, int64_t R, int64_t first,
                                                 int64_t T, uint64_t seed) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  KeyedBackwardInputs b;
  b.Y = group_rows(c, rank, g, counts, R, nan,
                   [&](int e, int64_t j, int64_t h) { return keyed_value(seed, e, j, h, c.dt); });
  b.d_x_perm = group_rows(c, rank, g, counts, R, nan,
                          [&](int e, int64_t j, int64_t h) { return keyed_value(seed + 1, e, j, h, c.dt); });
  b.d_probs_perm.assign(static_cast<size_t>(R), std::numeric_limits<float>::quiet_NaN());
  for (int e = 0; e < c.E_local; ++e) {
    const int64_t rows = std::min<int64_t>(counts[e], g[e + 1] - g[e]);
    for (int64_t j = 0; j < rows; ++j)
      b.d_probs_perm[g[e] + j] =
          static_cast<float>(keyed_value(seed + 2, rank * c.E_local + e, j, 0, DType::kFP32));
  }
  b.dy.resize(static_cast<size_t>(T * c.H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < c.H; ++h) b.dy[t * c.H + h] = keyed_value(seed + 3, first + t, h, 0, c.dt);
  return b;
}

// Every rank's keyed backward inputs, from the dispatch's layout (out: group offsets and counts).
inline void upload_backward_inputs(const EpCase& c, const EpWorld& w, std::vector<EpRank>& ranks,
                                   const std::vector<EpRankOut>& out, uint64_t seed) {
  int64_t first = 0;
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    EpRank& r = ranks[p];
    const KeyedBackwardInputs b =
        keyed_backward_inputs(c, p, out[p].group_offsets, out[p].counts, r.ep->rows(), first, r.T, seed);
    r.Y.upload(encode(b.Y, c.dt));
    r.d_x_perm.upload(encode(b.d_x_perm, c.dt));
    r.d_probs_perm.upload(b.d_probs_perm);
    r.dy.upload(encode(b.dy, c.dt));
    first += r.T;
  }
}

// The whole run on one world: dispatch, then the backward inputs from its layout, then combine and
// both backwards. Returns every rank's outputs.
inline std::vector<EpRankOut> run_ep_case(const EpCase& c, const EpWorld& w, const EpInputs& in, uint64_t seed) {
  std::vector<EpRank> ranks = make_ranks(c, w, in);
  enqueue_dispatch(c, w, ranks);
  sync_world(w);
  std::vector<EpRankOut> out;
  download_dispatch(w, ranks, out);
  upload_backward_inputs(c, w, ranks, out, seed);
  enqueue_combine_and_backward(c, w, ranks);
  sync_world(w);
  download_backward(w, ranks, out);
  for (int p = 0; p < c.P; ++p) {
    MOE_CUDA_CHECK(cudaSetDevice(w.device[p]));
    out[p].error_bits |= ranks[p].err->fetch_and_clear(w.stream[p]);
  }
  return out;
}

// Two runs of the same case (e.g. two transports) produced the same bits on every rank.
inline void expect_same_outputs(const std::vector<EpRankOut>& got, const std::vector<EpRankOut>& want,
                                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t p = 0; p < want.size(); ++p) {
    const std::string at = what + " rank " + std::to_string(p);
    const EpRankOut &a = got[p], &b = want[p];
    EXPECT_EQ(a.x_perm, b.x_perm) << at << " x_perm";
    EXPECT_EQ(a.send, b.send) << at << " send buffer";
    EXPECT_EQ(a.recv, b.recv) << at << " receive buffer";
    EXPECT_EQ(a.group_offsets, b.group_offsets) << at << " group offsets";
    EXPECT_EQ(a.counts, b.counts) << at << " local counts";
    EXPECT_EQ(a.slot_rows, b.slot_rows) << at << " slot rows";
    EXPECT_EQ(a.dropped, b.dropped) << at << " drop counts";
    EXPECT_EQ(a.error_bits, b.error_bits) << at << " error bits";
    EXPECT_EQ(a.y, b.y) << at << " y";
    EXPECT_EQ(a.dY, b.dY) << at << " dY";
    EXPECT_EQ(a.dx, b.dx) << at << " dx";
    const std::vector<std::pair<const std::vector<float>*, const std::vector<float>*>> floats = {
        {&a.probs_perm, &b.probs_perm}, {&a.send_probs, &b.send_probs}, {&a.recv_probs, &b.recv_probs},
        {&a.dprobs_combine, &b.dprobs_combine}, {&a.dprobs_dispatch, &b.dprobs_dispatch}};
    for (const auto& [x, y] : floats) {
      ASSERT_EQ(x->size(), y->size()) << at;
      EXPECT_TRUE(x->empty() || std::memcmp(x->data(), y->data(), x->size() * sizeof(float)) == 0)
          << at << " fp32 outputs (probs_perm, send/recv probs, dprobs) differ";
    }
  }
}

}  // namespace moe::testing
