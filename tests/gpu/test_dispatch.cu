// GPU token dispatch (moe::Dispatcher) against the CPU reference (docs/semantics.md: dispatch, combine,
// state and graph safety, errors).
//   - plan outputs (counts, padded, offsets int32/int64, group offsets, row maps, probs_perm) and
//     the device error word: exact;
//   - permute, and the dY of the combine backward: bitwise;
//   - combine and the permute backward's dx (fp32 sums of several rows): a stated tolerance, bitwise
//     where a token has at most one row;
//   - bad input: skipped, flagged like the reference, never out of bounds (run under
//     compute-sanitizer memcheck);
//   - determinism (two eager runs, same bits) and CUDA-graph replay with new routing == eager.
// Pad rows of the inputs Y / d_x_perm / d_probs_perm hold NaN, so reading one fails the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/dispatch.h"
#include "moe/saved_state.h"
#include "moe/error.h"
#include "moe/error_word.h"
#include "moe/float_convert.h"
#include "moe/quantize.h"
#include "reference/dispatch_ref.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/gpu.h"
#include "support/expect_error.h"
#include "support/row_codec.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using testing::Bytes;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

using ::moe::testing::expect_error_naming;

// ---- host encoding of rows ----

using testing::elem_bytes;
using testing::encode;
using testing::round_to;

double decode_one(const Bytes& b, size_t i, DType dt) {
  if (dt == DType::kFP32) {
    float f;
    std::memcpy(&f, &b[4 * i], 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, &b[2 * i], 2);
  return dt == DType::kBF16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
}

// Unit roundoff of the row dtype (relative error of one rounding to it).
double unit_roundoff(DType dt) {
  return dt == DType::kBF16 ? std::ldexp(1.0, -8) : dt == DType::kFP16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -24);
}
// Absolute error of rounding a value in the subnormal range of the dtype (fp16: 2^-25; bf16 and
// fp32 share fp32's range, far below any value here).
double subnormal_error(DType dt) { return dt == DType::kFP16 ? std::ldexp(1.0, -25) : 0.0; }

// Uniform [-1, 1) values representable in dt; rows whose `poison[r]` is set hold NaN.
std::vector<double> random_rows(int64_t rows, int64_t H, DType dt, uint64_t seed,
                                const std::vector<bool>* poison = nullptr) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<double> v(static_cast<size_t>(rows * H));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h)
      v[r * H + h] = (poison && (*poison)[r]) ? kNaN : round_to(u(rng), dt);
  return v;
}

// ---- one test case: inputs, device run, reference checks ----

struct Case {
  std::string name;
  RoutingForm form = RoutingForm::kTopK;
  int64_t T = 0, H = 128;
  int E = 8, k = 2;  // k: top-k, or the most experts per token in map form
  int A = 0;
  bool pre_padded = false;
  int64_t R = -1;  // -1: default (top-k), T*E + E*(A-1) (map)
  DType dt = DType::kBF16;
  double skew = 0.0;
  uint64_t seed = 1;
  std::function<void(ref::Routing&)> edit;  // bad input etc.
};

ref::Routing make_routing(const Case& c) {
  ref::Routing r = c.form == RoutingForm::kTopK ? ref::make_topk_routing(c.T, c.E, c.k, c.seed, c.skew)
                                                : ref::make_map_routing(c.T, c.E, c.k, c.seed);
  if (c.edit) c.edit(r);
  return r;
}

DispatchOptions options_of(const Case& c) {
  DispatchOptions o;
  o.align = c.A;
  o.pre_padded = c.pre_padded;
  o.row_bound = c.R;
  if (c.form == RoutingForm::kMap && c.R < 0) o.row_bound = c.T * c.E + int64_t{c.E} * (c.A ? c.A - 1 : 0);
  return o;
}

DispatcherConfig config_of(const Case& c) {
  DispatcherConfig cfg;
  cfg.max_tokens = c.T;
  cfg.num_experts = c.E;
  cfg.topk = c.k;
  cfg.hidden = c.H;
  cfg.form = c.form;
  cfg.options = options_of(c);
  cfg.row_dtype = c.dt;
  return cfg;
}

// Host inputs of every op for one routing.
struct Inputs {
  ref::Routing routing;
  ref::DispatchPlan plan;
  std::vector<double> x, Y, dy, dxp, dpp;  // dpp: d_probs_perm
};

Inputs make_inputs(const Case& c, uint64_t seed) {
  Inputs in;
  in.routing = make_routing(c);
  in.plan = ref::plan_dispatch(in.routing, options_of(c));
  const int64_t R = in.plan.R;
  std::vector<bool> pad(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) pad[r] = in.plan.row_slot[r] < 0;
  in.x = random_rows(c.T, c.H, c.dt, seed + 1);
  in.Y = random_rows(R, c.H, c.dt, seed + 2, &pad);
  in.dy = random_rows(c.T, c.H, c.dt, seed + 3);
  in.dxp = random_rows(R, c.H, c.dt, seed + 4, &pad);
  in.dpp = random_rows(R, 1, DType::kFP32, seed + 5, &pad);
  return in;
}

// Device buffers of one dispatcher: inputs (rewritten per routing) and outputs (fixed addresses).
struct DeviceState {
  int64_t T, H, R;
  int slots;
  DType dt;
  DeviceBuffer<int32_t> indices;
  DeviceBuffer<uint8_t> map;
  DeviceBuffer<float> probs, dpp;
  DeviceBuffer<uint8_t> x, Y, dy, dxp;
  DeviceBuffer<uint8_t> x_perm, y0, y1, dY0, dY1, dx;
  DeviceBuffer<float> dprobs0, dprobs1, dprobs2;
  SavedState plan;  // the caller-owned plan of this micro-batch

  DeviceState(const Case& c, const Dispatcher& d)
      : T(c.T), H(c.H), R(d.rows()), slots(d.slots_per_token()), dt(c.dt), plan(d.new_plan()) {
    const size_t eb = elem_bytes(dt);
    const size_t TS = static_cast<size_t>(T * slots);
    indices = DeviceBuffer<int32_t>(c.form == RoutingForm::kTopK ? TS : 0);
    map = DeviceBuffer<uint8_t>(c.form == RoutingForm::kMap ? TS : 0);
    probs = DeviceBuffer<float>(TS);
    dpp = DeviceBuffer<float>(R);
    for (auto* b : {&x, &dy, &y0, &y1, &dx}) *b = DeviceBuffer<uint8_t>(T * H * eb);
    for (auto* b : {&Y, &dxp, &x_perm, &dY0, &dY1}) *b = DeviceBuffer<uint8_t>(R * H * eb);
    for (auto* b : {&dprobs0, &dprobs1, &dprobs2}) *b = DeviceBuffer<float>(TS);
  }

  void upload_inputs(const Inputs& in) {
    if (indices.size()) indices.upload(in.routing.indices);
    if (map.size()) map.upload(in.routing.map);
    probs.upload(std::vector<float>(in.routing.probs.begin(), in.routing.probs.end()));
    dpp.upload(std::vector<float>(in.dpp.begin(), in.dpp.end()));
    x.upload(encode(in.x, dt));
    Y.upload(encode(in.Y, dt));
    dy.upload(encode(in.dy, dt));
    dxp.upload(encode(in.dxp, dt));
  }

  // Poisons every output so an unwritten element cannot pass.
  void poison_outputs() {
    for (auto* b : {&x_perm, &y0, &y1, &dY0, &dY1, &dx}) b->fill_bytes(0xAB);
    for (auto* b : {&dprobs0, &dprobs1, &dprobs2}) b->fill_bytes(0xAB);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());  // cudaMemset is asynchronous: order it before other streams
  }

  TensorView rows(const DeviceBuffer<uint8_t>& b, int64_t n) const { return TensorView(b.get(), dt, {n, H}); }

  RoutingView routing(RoutingForm form) const {
    RoutingView r;
    r.form = form;
    r.indices = TensorView(indices.get(), DType::kInt32, {T, slots});
    r.map = TensorView(map.get(), DType::kUInt8, {T, slots});
    r.probs = TensorView(probs.get(), DType::kFP32, {T, slots});
    return r;
  }

  // Every op of a forward + backward, enqueued on `stream` (capturable).
  // y1 merges with the given routing probs, dY1 with the plan's: both must equal the reference.
  void enqueue_all(const Dispatcher& d, RoutingForm form, uint32_t* err, cudaStream_t s) const {
    enqueue_forward(d, form, err, s);
    enqueue_rest(d, form, s);
  }
  void enqueue_forward(const Dispatcher& d, RoutingForm form, uint32_t* err, cudaStream_t s) const {
    d.plan(routing(form), err, plan, s);
    d.permute(plan, rows(x, T), rows(x_perm, R), s);
  }
  void enqueue_rest(const Dispatcher& d, RoutingForm form, cudaStream_t s) const {
    d.unpermute(plan, rows(Y, R), rows(y0, T), MergeProbs::kNone, s);
    const TensorView pv = routing(form).probs;
    d.unpermute(plan, rows(Y, R), rows(y1, T), MergeProbs::kGiven, s, &pv);
    TensorView dp0(dprobs0.get(), DType::kFP32, {T, slots}), dp1(dprobs1.get(), DType::kFP32, {T, slots}),
        dp2(dprobs2.get(), DType::kFP32, {T, slots}), dppv(dpp.get(), DType::kFP32, {R});
    TensorView Yv = rows(Y, R);
    d.unpermute_backward(plan, rows(dy, T), rows(dY0, R), MergeProbs::kNone, s, nullptr, &Yv, &dp0);
    d.unpermute_backward(plan, rows(dy, T), rows(dY1, R), MergeProbs::kPlanned, s, nullptr, &Yv, &dp1);
    d.permute_backward(plan, rows(dxp, R), rows(dx, T), s, &dppv, &dp2);
  }
};

// Everything the device produced, on the host.
struct Outputs {
  std::vector<int32_t> count32, padded32, offset32, group_offsets, slot_row, row_slot;
  std::vector<int64_t> count64, padded64, offset64;
  std::vector<float> probs_perm, dprobs0, dprobs1, dprobs2;
  Bytes x_perm, y0, y1, dY0, dY1, dx;
  uint32_t error_bits = 0;

  bool operator==(const Outputs& o) const {
    return count32 == o.count32 && padded32 == o.padded32 && offset32 == o.offset32 &&
           group_offsets == o.group_offsets && slot_row == o.slot_row && row_slot == o.row_slot &&
           count64 == o.count64 && padded64 == o.padded64 && offset64 == o.offset64 &&
           std::memcmp(probs_perm.data(), o.probs_perm.data(), 4 * probs_perm.size()) == 0 &&
           std::memcmp(dprobs0.data(), o.dprobs0.data(), 4 * dprobs0.size()) == 0 &&
           std::memcmp(dprobs1.data(), o.dprobs1.data(), 4 * dprobs1.size()) == 0 &&
           std::memcmp(dprobs2.data(), o.dprobs2.data(), 4 * dprobs2.size()) == 0 && x_perm == o.x_perm &&
           y0 == o.y0 && y1 == o.y1 && dY0 == o.dY0 && dY1 == o.dY1 && dx == o.dx && error_bits == o.error_bits;
  }
};

template <typename T>
std::vector<T> download_view(const TensorView& v) {
  std::vector<T> h(static_cast<size_t>(v.numel()));
  if (!h.empty()) MOE_CUDA_CHECK(cudaMemcpy(h.data(), v.data, h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

Outputs download(const Dispatcher& d, const DeviceState& st, ErrorWord& ew) {
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  Outputs o;
  const SavedState& p = st.plan;
  o.count32 = download_view<int32_t>(d.counts(p));
  o.padded32 = download_view<int32_t>(d.padded_counts(p));
  o.offset32 = download_view<int32_t>(d.offsets(p));
  o.count64 = download_view<int64_t>(d.counts(p, DType::kInt64));
  o.padded64 = download_view<int64_t>(d.padded_counts(p, DType::kInt64));
  o.offset64 = download_view<int64_t>(d.offsets(p, DType::kInt64));
  o.group_offsets = download_view<int32_t>(d.group_offsets(p));
  o.slot_row = download_view<int32_t>(d.slot_rows(p));
  o.row_slot = download_view<int32_t>(d.row_slots(p));
  o.probs_perm = download_view<float>(d.probs_perm(p));
  o.x_perm = st.x_perm.download();
  o.y0 = st.y0.download();
  o.y1 = st.y1.download();
  o.dY0 = st.dY0.download();
  o.dY1 = st.dY1.download();
  o.dx = st.dx.download();
  o.dprobs0 = st.dprobs0.download();
  o.dprobs1 = st.dprobs1.download();
  o.dprobs2 = st.dprobs2.download();
  o.error_bits = ew.fetch_and_clear(nullptr);
  return o;
}

// Bitwise: got (device bytes) == ref rounded to fp32 then to dt.
void expect_bitwise(const Bytes& got, const std::vector<double>& ref, DType dt, const std::string& what) {
  const Bytes want = encode(ref, dt);
  ASSERT_EQ(got.size(), want.size()) << what;
  if (got == want) return;
  const size_t eb = elem_bytes(dt);
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::memcmp(&got[i * eb], &want[i * eb], eb) != 0) {
      ADD_FAILURE() << what << ": first mismatch at element " << i << ": got " << decode_one(got, i, dt)
                    << ", want " << round_to(ref[i], dt);
      return;
    }
}

// y[t] = sum_j w_j * Z[row_j] against the fp64 reference. The device accumulates in fp32 with
// fmaf in slot order and rounds once to dt: |err| <= n * 2^-24 * sum|w_j Z| (sequential fp32
// accumulation of n terms, gamma_n bound, +1 for slack) + 2 u_dt |ref| (the final rounding, u_dt
// the unit roundoff of dt) + the subnormal spacing error of fp16. With at most one row the result is round(fp32(w * Z)): bitwise.
void expect_combined(const Bytes& got, const std::vector<double>& ref, const ref::DispatchPlan& p,
                     const std::vector<double>& Z, int64_t H, bool merge, DType dt, const std::string& what) {
  int failures = 0;
  for (int64_t t = 0; t < p.T && failures < 5; ++t) {
    int n = 0;
    for (int s = 0; s < p.slots; ++s) n += p.slot_row[t * p.slots + s] >= 0;
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(t * H + h);
      const double g = decode_one(got, i, dt);
      if (n <= 1) {
        if (!(g == round_to(ref[i], dt))) {
          ADD_FAILURE() << what << " (one row, bitwise) t=" << t << " h=" << h << ": got " << g << ", want "
                        << round_to(ref[i], dt);
          ++failures;
        }
        continue;
      }
      double sumabs = 0;
      for (int s = 0; s < p.slots; ++s) {
        const int64_t row = p.slot_row[t * p.slots + s];
        if (row >= 0) sumabs += std::fabs((merge ? p.slot_prob[t * p.slots + s] : 1.0) * Z[row * H + h]);
      }
      const double tol = (n + 1) * std::ldexp(1.0, -24) * sumabs + 2 * unit_roundoff(dt) * std::fabs(ref[i]) +
                         subnormal_error(dt);
      if (!(std::fabs(g - ref[i]) <= tol)) {
        ADD_FAILURE() << what << " t=" << t << " h=" << h << ": got " << g << ", want " << ref[i] << " (tol " << tol
                      << ")";
        ++failures;
      }
    }
  }
}

void check_against_reference(const Case& c, const Inputs& in, const Outputs& o) {
  const ref::DispatchPlan& p = in.plan;
  const int64_t H = c.H, R = p.R, T = c.T;
  const int E = c.E;
  SCOPED_TRACE(c.name);
  EXPECT_EQ(o.error_bits, p.error_bits) << "got: " << describe_error_bits(o.error_bits)
                                        << " / want: " << describe_error_bits(p.error_bits);
  // Plan.
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(o.count32[e], p.count[e]) << "count e=" << e;
    EXPECT_EQ(o.count64[e], p.count[e]) << "count64 e=" << e;
    EXPECT_EQ(o.padded32[e], p.padded[e]) << "padded e=" << e;
    EXPECT_EQ(o.padded64[e], p.padded[e]) << "padded64 e=" << e;
    EXPECT_EQ(o.offset32[e], p.offset[e]) << "offset e=" << e;
    EXPECT_EQ(o.offset64[e], p.offset[e]) << "offset64 e=" << e;
    EXPECT_EQ(o.group_offsets[e + 1], std::min(p.offset[e] + p.padded[e], R)) << "group_offsets e=" << e;
    EXPECT_EQ(o.group_offsets[e + 1] - o.group_offsets[e], p.rows_in_bound(e)) << "group size e=" << e;
  }
  EXPECT_EQ(o.group_offsets[0], 0);
  std::vector<int32_t> want_slot_row(p.slot_row.begin(), p.slot_row.end());
  std::vector<int32_t> want_row_slot(p.row_slot.begin(), p.row_slot.end());
  EXPECT_TRUE(o.slot_row == want_slot_row) << "slot_row differs";
  EXPECT_TRUE(o.row_slot == want_row_slot) << "row_slot differs";
  std::vector<double> xp(R * H), pp(R);
  ref::permute(p, in.x.data(), H, xp.data(), pp.data());
  for (int64_t r = 0; r < R; ++r)
    if (!(static_cast<double>(o.probs_perm[r]) == pp[r])) {
      ADD_FAILURE() << "probs_perm row " << r << ": got " << o.probs_perm[r] << ", want " << pp[r];
      break;
    }
  // permute: bitwise, pad rows zero.
  expect_bitwise(o.x_perm, xp, c.dt, "x_perm");

  // combine, with and without merged probs.
  for (bool merge : {false, true}) {
    std::vector<double> y(T * H);
    ref::unpermute(p, in.Y.data(), H, merge, y.data());
    expect_combined(merge ? o.y1 : o.y0, y, p, in.Y, H, merge, c.dt, merge ? "y (merge)" : "y");
  }

  // combine backward: dY bitwise (w * dy is one fp32 product, exact in fp64); dprobs within the
  // fp32 dot-product bound: per lane a sequential sum of H/32 products, then 5 butterfly adds,
  // gamma_(H/32 + 5) * sum|Y dy|, +1 for slack.
  for (bool merge : {false, true}) {
    std::vector<double> dY(R * H), dprobs(T * p.slots);
    ref::unpermute_backward(p, in.Y.data(), in.dy.data(), H, merge, dY.data(), dprobs.data());
    expect_bitwise(merge ? o.dY1 : o.dY0, dY, c.dt, merge ? "dY (merge)" : "dY");
    const std::vector<float>& got = merge ? o.dprobs1 : o.dprobs0;
    int failures = 0;
    for (int64_t i = 0; i < T * p.slots && failures < 5; ++i) {
      const int64_t row = p.slot_row[i];
      double sumabs = 0;
      if (row >= 0 && merge)
        for (int64_t h = 0; h < H; ++h) sumabs += std::fabs(in.Y[row * H + h] * in.dy[(i / p.slots) * H + h]);
      const double tol = (H / 32.0 + 6) * std::ldexp(1.0, -24) * sumabs;
      if (!(std::fabs(got[i] - dprobs[i]) <= tol)) {
        ADD_FAILURE() << "dprobs of combine (merge " << merge << ") slot " << i << ": got " << got[i] << ", want "
                      << dprobs[i];
        ++failures;
      }
    }
  }

  // permute backward: dx = sum of the token's rows (fp32, as the combine); dprobs bitwise.
  std::vector<double> dx(T * H), dprobs(T * p.slots);
  ref::permute_backward(p, in.dxp.data(), in.dpp.data(), H, dx.data(), dprobs.data());
  expect_combined(o.dx, dx, p, in.dxp, H, false, c.dt, "dx");
  for (int64_t i = 0; i < T * p.slots; ++i)
    if (!(static_cast<double>(o.dprobs2[i]) == dprobs[i])) {
      ADD_FAILURE() << "dprobs of permute backward slot " << i << ": got " << o.dprobs2[i] << ", want " << dprobs[i];
      break;
    }
}

// Eager run of every op, twice (same bits), checked against the reference.
void run_on(Dispatcher& d, const Case& c) {
  SCOPED_TRACE(c.name);
  Inputs in = make_inputs(c, c.seed * 100);
  ASSERT_EQ(d.rows(), in.plan.R);
  DeviceState st(c, d);
  st.upload_inputs(in);
  ErrorWord ew;
  st.poison_outputs();
  st.enqueue_all(d, c.form, ew.device_ptr(), nullptr);
  const Outputs first = download(d, st, ew);
  check_against_reference(c, in, first);
  st.poison_outputs();
  st.enqueue_all(d, c.form, ew.device_ptr(), nullptr);
  EXPECT_TRUE(download(d, st, ew) == first) << "a second run gave different bits";
}

void run_case(const Case& c) {
  Dispatcher d(config_of(c));
  run_on(d, c);
}

// ---- shapes: T in {0, 1, 7, 4096, 16384}, H in {128, 1536, 4096, 7168},
// E in {1, 7, 8, 64, 128, 256}, k in {1, 2, 6, 8}, map-form tokens with 0..E experts ----

Case topk_case(const char* name, int64_t T, int64_t H, int E, int k, int A, DType dt = DType::kBF16,
               double skew = 0.0) {
  Case c;
  c.name = name;
  c.T = T;
  c.H = H;
  c.E = E;
  c.k = k;
  c.A = A;
  c.dt = dt;
  c.skew = skew;
  return c;
}

Case map_case(const char* name, int64_t T, int64_t H, int E, int A, DType dt = DType::kBF16) {
  Case c = topk_case(name, T, H, E, E, A, dt);  // up to E experts per token
  c.form = RoutingForm::kMap;
  return c;
}

TEST(Dispatch, TopKShapes) {
  MOE_REQUIRE_GPU();
  run_case(topk_case("T0", 0, 128, 8, 2, 16));
  run_case(topk_case("T1 H7168", 1, 7168, 8, 2, 128));
  run_case(topk_case("T7 H1536 E7 k6 fp32", 7, 1536, 7, 6, 0, DType::kFP32));
  run_case(topk_case("T7 H4096 E1 k1 fp16", 7, 4096, 1, 1, 32, DType::kFP16));
  run_case(topk_case("T1 E256 k8 A256", 1, 128, 256, 8, 256));
  run_case(topk_case("T4096 H512 E64 k6 A128", 4096, 512, 64, 6, 128));
  run_case(topk_case("T4096 E8 k8 (k = E)", 4096, 128, 8, 8, 0));
  run_case(topk_case("T4096 E7 k2 fp32 A16", 4096, 128, 7, 2, 16, DType::kFP32));
  run_case(topk_case("T4096 E128 k2 fp16 A64 skewed", 4096, 256, 128, 2, 64, DType::kFP16, 1.0));
  run_case(topk_case("T16384 E256 k8 A16 skewed", 16384, 128, 256, 8, 16, DType::kBF16, 1.0));
  run_case(topk_case("T16384 E128 k1 A128", 16384, 128, 128, 1, 128));
}

TEST(Dispatch, MapShapes) {
  MOE_REQUIRE_GPU();
  run_case(map_case("map T0", 0, 128, 8, 16));
  run_case(map_case("map T1 E7", 1, 1536, 7, 0));
  run_case(map_case("map T7 H4096 E7", 7, 4096, 7, 0));
  run_case(map_case("map T7 H7168 E8 A128 fp16", 7, 7168, 8, 128, DType::kFP16));
  run_case(map_case("map T1000 E64 A32", 1000, 128, 64, 32));
  run_case(map_case("map T200 E256 A16 fp32", 200, 128, 256, 16, DType::kFP32));
  run_case(map_case("map T16384 E8 A64", 16384, 128, 8, 64));
  Case one = map_case("map E1", 4096, 128, 1, 0);
  run_case(one);
}

TEST(Dispatch, EdgeRoutings) {
  MOE_REQUIRE_GPU();
  // One expert takes every token; the others are empty.
  Case all = topk_case("one expert takes all", 4096, 128, 64, 1, 128);
  all.edit = [](ref::Routing& r) {
    for (auto& e : r.indices) e = 5;
  };
  run_case(all);
  // Every slot empty (-1): nothing routed, y is zero, no error.
  Case none = topk_case("all slots empty", 77, 128, 8, 2, 16);
  none.edit = [](ref::Routing& r) {
    for (auto& e : r.indices) e = -1;
  };
  run_case(none);
  // Pre-padded: counts are multiples of A (512 tokens per expert): no second pad, no flag.
  Case pre = topk_case("pre-padded", 4096, 128, 8, 1, 128);
  pre.pre_padded = true;
  pre.edit = [](ref::Routing& r) {
    for (int64_t t = 0; t < r.T; ++t) r.indices[t] = static_cast<int32_t>(t / 512);
  };
  run_case(pre);
  // Pre-padded with a count that is not a multiple of A: flagged, never padded.
  Case mis = pre;
  mis.name = "pre-padded misaligned";
  mis.edit = [](ref::Routing& r) {
    for (int64_t t = 0; t < r.T; ++t) r.indices[t] = static_cast<int32_t>(t / 500 % 8);
  };
  run_case(mis);
}

TEST(Dispatch, BadInputIsSkippedAndFlagged) {
  MOE_REQUIRE_GPU();
  // Out-of-range ids (including the extremes), repeats, non-finite probs; k = 8 keeps a token's
  // slots inside one warp's 32-slot step, k = 6 and 3 let rows straddle two steps, k = 40 spans
  // several.
  const auto spoil = [](ref::Routing& r) {
    std::mt19937_64 rng(77);
    const int32_t ids[] = {64, 1000, -2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
    for (int i = 0; i < 300; ++i) {
      const size_t slot = rng() % r.indices.size();
      switch (i % 4) {
        case 0: r.indices[slot] = ids[(i / 4) % 5]; break;
        case 1: r.indices[slot] = r.indices[slot - slot % r.k + (slot % r.k + 1) % r.k]; break;  // a repeat
        case 2: r.probs[slot] = (i / 4) % 2 ? kNaN : -std::numeric_limits<double>::infinity(); break;
        default: r.indices[slot] = -1; break;
      }
    }
  };
  for (const int k : {8, 6, 3, 40}) {
    const std::string name = "bad ids / repeats / nan, k = " + std::to_string(k);
    Case bad = topk_case(name.c_str(), 4096, 128, 64, k, 16);
    bad.edit = spoil;
    run_case(bad);
  }
  // Each flag alone.
  Case oor = topk_case("out of range only", 50, 128, 8, 2, 0);
  oor.edit = [](ref::Routing& r) { r.indices[7] = 8; };
  run_case(oor);
  Case dup = topk_case("duplicate only", 50, 128, 8, 3, 0);
  dup.edit = [](ref::Routing& r) { r.indices[3 * 10 + 2] = r.indices[3 * 10 + 0]; };
  run_case(dup);
  Case nan = topk_case("nan only", 50, 128, 8, 2, 0);
  nan.edit = [](ref::Routing& r) { r.probs[11] = kNaN; };
  run_case(nan);
  // Map form: non-finite probs on the map are skipped, off the map ignored.
  Case mnan = map_case("map nan", 300, 128, 16, 16);
  mnan.edit = [](ref::Routing& r) {
    for (size_t i = 0; i < r.map.size(); i += 37) r.probs[i] = kNaN;
    for (size_t i = 0; i < r.map.size(); i += 101) r.map[i] = 7;  // any non-zero byte routes
  };
  run_case(mnan);
}

TEST(Dispatch, RowOverflowNeverWritesPastR) {
  MOE_REQUIRE_GPU();
  // 4096 * 6 rows + padding into 20000 rows.
  Case over = topk_case("overflow", 4096, 256, 64, 6, 128);
  over.R = 20000;
  run_case(over);
  // Only pad rows past R.
  Case pad = topk_case("overflow by padding only", 1000, 128, 8, 2, 256);
  pad.R = 2000;  // 2000 routed rows fit, the padding does not
  run_case(pad);
  Case mover = map_case("map overflow", 2000, 128, 32, 64);
  mover.R = 9000;
  run_case(mover);
}

// Calls with fewer tokens than T_max (the static bound R stays that of T_max).
TEST(Dispatch, BatchesShorterThanMaxTokens) {
  MOE_REQUIRE_GPU();
  for (RoutingForm form : {RoutingForm::kTopK, RoutingForm::kMap}) {
    Case big = form == RoutingForm::kTopK ? topk_case("T_max 512", 512, 256, 16, 4, 32)
                                          : map_case("map T_max 512", 512, 256, 16, 32);
    Dispatcher d(config_of(big));
    for (int64_t T : {512, 100, 0, 37}) {
      Case c = big;
      c.name += " T=" + std::to_string(T);
      c.T = T;
      c.R = d.rows();  // the reference uses the dispatcher's bound
      c.seed = 5 + T;
      run_on(d, c);
    }
  }
}

// Graph capture once; replay with different routing and data in the same buffers == eager.
TEST(Dispatch, GraphReplayWithNewRoutingMatchesEager) {
  MOE_REQUIRE_GPU();
  for (RoutingForm form : {RoutingForm::kTopK, RoutingForm::kMap}) {
    Case c = form == RoutingForm::kTopK ? topk_case("graph top-k", 2048, 512, 64, 8, 128)
                                        : map_case("graph map", 1024, 256, 16, 32);
    SCOPED_TRACE(c.name);
    Dispatcher d(config_of(c));
    DeviceState st(c, d);
    ErrorWord ew;
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // Capture with the first routing's data in place.
    st.upload_inputs(make_inputs(c, 1000));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    st.enqueue_all(d, c.form, ew.device_ptr(), s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int step = 0; step < 3; ++step) {
      Case v = c;
      v.seed = 10 + step;
      v.skew = step == 1 ? 1.5 : 0.0;  // uneven groups
      if (step == 2 && form == RoutingForm::kTopK)
        v.edit = [](ref::Routing& r) {  // bad input through the graph too
          r.indices[5] = 999;
          r.probs[9] = kNaN;
        };
      Inputs in = make_inputs(v, 2000 + step);
      st.upload_inputs(in);
      st.poison_outputs();
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const Outputs replayed = download(d, st, ew);
      check_against_reference(v, in, replayed);
      st.poison_outputs();
      st.enqueue_all(d, c.form, ew.device_ptr(), s);
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      EXPECT_TRUE(download(d, st, ew) == replayed) << "graph replay differs from eager, step " << step;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// Several micro-batches in flight: four plans made first, their combines and backwards run later in
// reverse and in shuffled order; every output is bitwise what that micro-batch gives alone.
TEST(Dispatch, in_flight_plans_backward_in_any_order) {
  MOE_REQUIRE_GPU();
  for (RoutingForm form : {RoutingForm::kTopK, RoutingForm::kMap}) {
    Case c = form == RoutingForm::kTopK ? topk_case("in_flight top-k", 1024, 256, 32, 4, 64)
                                        : map_case("in_flight map", 512, 256, 16, 32);
    SCOPED_TRACE(c.name);
    Dispatcher d(config_of(c));
    ErrorWord ew;
    std::vector<std::unique_ptr<DeviceState>> mb;
    std::vector<Inputs> ins;
    for (int i = 0; i < 4; ++i) {
      Case v = c;
      v.seed = 40 + i;
      v.skew = i % 2 ? 1.2 : 0.0;
      ins.push_back(make_inputs(v, 4000 + 10 * i));
      mb.push_back(std::make_unique<DeviceState>(v, d));
      mb.back()->upload_inputs(ins.back());
    }
    for (const std::vector<int>& order : {std::vector<int>{3, 2, 1, 0}, std::vector<int>{2, 0, 3, 1}}) {
      for (auto& st : mb) st->poison_outputs();
      for (auto& st : mb) st->enqueue_forward(d, form, ew.device_ptr(), nullptr);
      for (int i : order) mb[i]->enqueue_rest(d, form, nullptr);
      std::vector<Outputs> together;
      for (auto& st : mb) together.push_back(download(d, *st, ew));
      for (int i = 0; i < 4; ++i) {
        Case v = c;
        v.seed = 40 + i;
        v.skew = i % 2 ? 1.2 : 0.0;
        check_against_reference(v, ins[i], together[i]);
        mb[i]->poison_outputs();
        mb[i]->enqueue_all(d, form, ew.device_ptr(), nullptr);  // alone
        EXPECT_TRUE(download(d, *mb[i], ew) == together[i]) << "micro-batch " << i << " differs from its run alone";
      }
    }
    // The same schedule captured in one graph, replayed with new routing and data.
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (auto& st : mb) st->enqueue_forward(d, form, ew.device_ptr(), s);
    for (int i : {2, 0, 3, 1}) mb[i]->enqueue_rest(d, form, s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 4; ++i) {
      Case v = c;
      v.seed = 90 + i;
      v.skew = i % 2 ? 0.0 : 1.7;
      ins[i] = make_inputs(v, 9000 + 10 * i);
      mb[i]->upload_inputs(ins[i]);
      mb[i]->poison_outputs();
    }
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < 4; ++i) {
      Case v = c;
      v.seed = 90 + i;
      v.skew = i % 2 ? 0.0 : 1.7;
      const Outputs replayed = download(d, *mb[i], ew);
      check_against_reference(v, ins[i], replayed);
      mb[i]->poison_outputs();
      mb[i]->enqueue_all(d, form, ew.device_ptr(), s);
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      EXPECT_TRUE(download(d, *mb[i], ew) == replayed) << "graph micro-batch " << i << " differs from eager alone";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

// FP8 rows (1 byte per value) and NVFP4 rows (two values per byte) with a per-row scale block move
// through permute bitwise; pad rows get zeros.
TEST(Dispatch, PermuteCarriesScaleBlocks) {
  MOE_REQUIRE_GPU();
  const struct {
    DType dtype;
    int64_t S;
  } cases[] = {{DType::kFP8E4M3, 16}, {DType::kFP8E4M3, 12}, {DType::kFP8E4M3, 3},  // 16-, 4- and 1-byte units
               {DType::kFP8E4M3, 8},   // MXFP8: one E8M0 scale per 32 values, H = 256
               {DType::kFP4E2M1, 16}};  // NVFP4: one E4M3 scale per 16 values
  for (const auto& cs : cases) {
    const int64_t S = cs.S;
    SCOPED_TRACE(std::string(dtype_name(cs.dtype)) + " S=" + std::to_string(S));
    DispatcherConfig cfg;
    cfg.max_tokens = 300;
    cfg.num_experts = 16;
    cfg.topk = 4;
    cfg.hidden = 256;
    cfg.options.align = 32;
    cfg.row_dtype = cs.dtype;
    cfg.scale_bytes_per_row = S;
    Dispatcher d(cfg);
    ref::Routing r = ref::make_topk_routing(300, 16, 4, 5);
    ref::DispatchPlan p = ref::plan_dispatch(r, cfg.options);
    const int64_t R = d.rows(), T = 300, H = 256, B = dtype_bytes(cs.dtype, H);  // B: bytes per row
    std::mt19937_64 rng(S);
    Bytes x(T * B), xs(T * S);
    for (auto& b : x) b = static_cast<uint8_t>(rng());
    for (auto& b : xs) b = static_cast<uint8_t>(rng());
    DeviceBuffer<int32_t> idx(r.indices);
    DeviceBuffer<float> probs(std::vector<float>(r.probs.begin(), r.probs.end()));
    DeviceBuffer<uint8_t> dx(x), dxs(xs), xp(R * B), xps(R * S);
    xp.fill_bytes(0xAB);
    xps.fill_bytes(0xAB);
    ErrorWord ew;
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {T, 4});
    rv.probs = TensorView(probs.get(), DType::kFP32, {T, 4});
    const SavedState plan = d.new_plan();
    d.plan(rv, ew.device_ptr(), plan, nullptr);
    TensorView xsv(dxs.get(), DType::kUInt8, {T, S}), xpsv(xps.get(), DType::kUInt8, {R, S});
    d.permute(plan, TensorView(dx.get(), cs.dtype, {T, H}), TensorView(xp.get(), cs.dtype, {R, H}), nullptr, &xsv,
              &xpsv);
    EXPECT_EQ(ew.fetch_and_clear(nullptr), 0u);
    const Bytes got = xp.download(), got_s = xps.download();
    for (int64_t row = 0; row < R; ++row) {
      const int64_t t = p.row_token[row];
      for (int64_t h = 0; h < B; ++h) ASSERT_EQ(got[row * B + h], t < 0 ? 0 : x[t * B + h]) << "row " << row;
      for (int64_t b = 0; b < S; ++b) ASSERT_EQ(got_s[row * S + b], t < 0 ? 0 : xs[t * S + b]) << "scale row " << row;
    }
    // Quantized rows have no arithmetic path.
    expect_error_naming([&] { d.unpermute(plan, TensorView(xp.get(), cs.dtype, {R, H}),
                                          TensorView(dx.get(), cs.dtype, {T, H}), MergeProbs::kNone, nullptr); },
                        "bf16, fp16 or fp32");
  }
}

// Rowwise 1-D blocks belong to one row, so dispatching quantized rows with their scales is
// quantizing the dispatched rows: permute(quantize(x)) == quantize(permute(x)), bitwise, for MXFP8
// and for NVFP4 (whose global amax the zero pad rows do not change).
TEST(Dispatch, QuantizedRowsDispatchLikeTheirValues) {
  MOE_REQUIRE_GPU();
  for (QuantFormat f : {QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    SCOPED_TRACE(quant_format_name(f));
    const int64_t T = 200, H = 512, E = 8, k = 2;
    QuantConfig q;
    q.format = f;
    const DType data_t = f == QuantFormat::kMXFP8 ? DType::kFP8E4M3 : DType::kFP4E2M1;
    const ScaleShape ss = scale_shape(q, T, H);  // [T, H / b], one byte each
    DispatcherConfig cfg;
    cfg.max_tokens = T;
    cfg.num_experts = E;
    cfg.topk = k;
    cfg.hidden = H;
    cfg.options.align = f == QuantFormat::kMXFP8 ? 32 : 16;
    Dispatcher bf16_d(cfg);
    cfg.row_dtype = data_t;
    cfg.scale_bytes_per_row = ss.cols;
    Dispatcher q_d(cfg);
    const int64_t R = q_d.rows(), B = dtype_bytes(data_t, H);
    ref::Routing r = ref::make_topk_routing(T, E, k, 12);
    DeviceBuffer<int32_t> idx(r.indices);
    DeviceBuffer<float> probs(std::vector<float>(r.probs.begin(), r.probs.end()));
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {T, k});
    rv.probs = TensorView(probs.get(), DType::kFP32, {T, k});
    std::mt19937_64 rng(3);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<uint16_t> xh(T * H);
    for (auto& v : xh) v = float_to_bf16_bits(nd(rng));
    DeviceBuffer<uint16_t> x(xh), x_perm(R * H);
    DeviceBuffer<uint8_t> xq(T * B), xs(T * ss.cols), pq(R * B), ps(R * ss.cols), want_q(R * B), want_s(R * ss.cols);
    DeviceBuffer<float> amax_x(1), amax_p(1);
    ErrorWord ew;
    const SavedState plan_a = bf16_d.new_plan(), plan_b = q_d.new_plan();
    bf16_d.plan(rv, ew.device_ptr(), plan_a, nullptr);
    q_d.plan(rv, ew.device_ptr(), plan_b, nullptr);
    // quantize, then dispatch the codes with their scales
    QuantizedTensor a;
    a.rowwise_data = TensorView(xq.get(), data_t, {T, H});
    a.rowwise_scale = TensorView(xs.get(), ss.dtype, {T, ss.cols});
    if (f == QuantFormat::kNVFP4) a.global_amax = TensorView(amax_x.get(), DType::kFP32, {1});
    quantize(q, TensorView(x.get(), DType::kBF16, {T, H}), a, nullptr);
    TensorView xsv(xs.get(), DType::kUInt8, {T, ss.cols}), psv(ps.get(), DType::kUInt8, {R, ss.cols});
    q_d.permute(plan_b, TensorView(xq.get(), data_t, {T, H}), TensorView(pq.get(), data_t, {R, H}), nullptr, &xsv,
                &psv);
    // dispatch, then quantize the dispatched rows
    bf16_d.permute(plan_a, TensorView(x.get(), DType::kBF16, {T, H}), TensorView(x_perm.get(), DType::kBF16, {R, H}),
                   nullptr);
    QuantizedTensor b;
    b.rowwise_data = TensorView(want_q.get(), data_t, {R, H});
    b.rowwise_scale = TensorView(want_s.get(), ss.dtype, {R, ss.cols});
    if (f == QuantFormat::kNVFP4) b.global_amax = TensorView(amax_p.get(), DType::kFP32, {1});
    quantize(q, TensorView(x_perm.get(), DType::kBF16, {R, H}), b, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(ew.fetch_and_clear(nullptr), 0u);
    EXPECT_EQ(pq.download(), want_q.download());
    EXPECT_EQ(ps.download(), want_s.download());
    if (f == QuantFormat::kNVFP4) EXPECT_EQ(amax_x.download(), amax_p.download());
  }
}

TEST(Dispatch, HostCheckedArguments) {
  MOE_REQUIRE_GPU();
  DispatcherConfig cfg;
  cfg.max_tokens = 64;
  cfg.num_experts = 8;
  cfg.topk = 2;
  cfg.hidden = 128;
  auto bad_cfg = [&](auto edit, const char* needle) {
    DispatcherConfig c = cfg;
    edit(c);
    expect_error_naming([&] { Dispatcher d(c); }, needle);
  };
  bad_cfg([](DispatcherConfig& c) { c.num_experts = 0; }, "num_experts");
  bad_cfg([](DispatcherConfig& c) { c.num_experts = 5000; }, "num_experts");
  bad_cfg([](DispatcherConfig& c) { c.topk = 0; }, "topk");
  bad_cfg([](DispatcherConfig& c) { c.hidden = 100; }, "hidden");  // 200 bytes: not a multiple of 16
  bad_cfg([](DispatcherConfig& c) { c.options.align = 48; }, "align");
  bad_cfg([](DispatcherConfig& c) { c.form = RoutingForm::kMap; }, "row_bound");
  bad_cfg([](DispatcherConfig& c) { c.row_dtype = DType::kInt32; }, "row_dtype");
  bad_cfg([](DispatcherConfig& c) { c.max_tokens = int64_t{1} << 31; }, "max_tokens");

  Dispatcher d(cfg);
  const int64_t R = d.rows(), T = 64;
  DeviceBuffer<int32_t> idx(T * 2);
  DeviceBuffer<float> probs(T * 2);
  DeviceBuffer<uint16_t> x(T * 128), xp(R * 128);
  DeviceBuffer<float> xf(T * 128);
  ErrorWord ew;
  TensorView xv(x.get(), DType::kBF16, {T, 128}), xpv(xp.get(), DType::kBF16, {R, 128});
  const SavedState plan = d.new_plan();
  expect_error_naming([&] { d.permute(plan, xv, xpv, nullptr); }, "empty");
  RoutingView rv;
  rv.indices = TensorView(idx.get(), DType::kInt32, {T, 2});
  rv.probs = TensorView(probs.get(), DType::kFP32, {T, 2});
  expect_error_naming([&] { d.plan(rv, nullptr, plan, nullptr); }, "error_word");
  RoutingView big = rv;
  big.probs = TensorView(probs.get(), DType::kFP32, {T * 2, 1});
  expect_error_naming([&] { d.plan(big, ew.device_ptr(), plan, nullptr); }, "routing.probs");
  RoutingView wrong = rv;
  wrong.indices = TensorView(idx.get(), DType::kInt64, {T, 2});
  expect_error_naming([&] { d.plan(wrong, ew.device_ptr(), plan, nullptr); }, "routing.indices");
  RoutingView map = rv;
  map.form = RoutingForm::kMap;
  expect_error_naming([&] { d.plan(map, ew.device_ptr(), plan, nullptr); }, "routing.form");
  std::vector<int32_t> ids(T * 2);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i % 2);  // experts {0, 1}: valid
  idx.upload(ids);
  MOE_CUDA_CHECK(cudaMemset(probs.get(), 0, T * 2 * sizeof(float)));
  d.plan(rv, ew.device_ptr(), plan, nullptr);
  expect_error_naming([&] { d.permute(plan, TensorView(xf.get(), DType::kFP32, {T, 128}), xpv, nullptr); }, "'x'");
  expect_error_naming([&] { d.permute(plan, xv, TensorView(xp.get(), DType::kBF16, {R - 1, 128}), nullptr); },
                      "'x_perm'");
  TensorView misaligned(reinterpret_cast<char*>(x.get()) + 2, DType::kBF16, {T, 128});
  expect_error_naming([&] { d.permute(plan, misaligned, xpv, nullptr); }, "'x'");
  expect_error_naming([&] { d.unpermute(plan, xv, xv, MergeProbs::kPlanned, nullptr); }, "'Y'");
  expect_error_naming([&] { d.unpermute(plan, xpv, xv, MergeProbs::kGiven, nullptr); }, "'probs'");
  TensorView probs3(probs.get(), DType::kFP32, {T, 1});
  expect_error_naming([&] { d.unpermute(plan, xpv, xv, MergeProbs::kGiven, nullptr, &probs3); }, "'probs'");
  TensorView dprobs(probs.get(), DType::kFP32, {T, 2});
  expect_error_naming([&] { d.unpermute_backward(plan, xv, xpv, MergeProbs::kPlanned, nullptr, nullptr, nullptr, &dprobs); },
                      "'Y'");
  TensorView dprobs_bad(probs.get(), DType::kFP32, {T, 3});
  expect_error_naming([&] { d.permute_backward(plan, xpv, xv, nullptr, nullptr, &dprobs_bad); }, "'dprobs'");
  expect_error_naming([&] { d.counts(plan, DType::kFP32); }, "dtype");
  // Routing read element by element: a 4-byte aligned slice (probs[1:]) is valid input.
  RoutingView sliced = rv;
  sliced.indices = TensorView(idx.get() + 2, DType::kInt32, {T - 1, 2});
  sliced.probs = TensorView(probs.get() + 2, DType::kFP32, {T - 1, 2});
  EXPECT_NO_THROW(d.plan(sliced, ew.device_ptr(), plan, nullptr));
  // A plan of another dispatcher (same config) or an undefined one is refused by name.
  Dispatcher other(cfg);
  const SavedState foreign = other.new_plan();
  other.plan(rv, ew.device_ptr(), foreign, nullptr);
  expect_error_naming([&] { d.permute(foreign, xv, xpv, nullptr); }, "another op");
  expect_error_naming([&] { d.permute(SavedState(), xv, xpv, nullptr); }, "'plan'");
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(ew.fetch_and_clear(nullptr), 0u);
}

}  // namespace
}  // namespace moe
