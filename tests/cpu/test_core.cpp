// Core types: dtypes, tensor views and their argument checks, float conversions, options.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "moe/activation.h"
#include "moe/device_errors.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/grouped_mlp_config.h"
#include "moe/routing.h"
#include "moe/tensor.h"
#include "support/expect_error.h"

namespace moe {
namespace {

// A layer configuration of H = 128, F = 64 the config tests start from.
GroupedMlpConfig small_config(int experts, int topk, int64_t max_tokens) {
  GroupedMlpConfig c;
  c.hidden = 128;
  c.ffn = 64;
  c.experts = experts;
  c.topk = topk;
  c.max_tokens = max_tokens;
  return c;
}

using ::moe::testing::expect_error_naming;

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_bits(DType::kBF16), 16);
  EXPECT_EQ(dtype_bits(DType::kFP4E2M1), 4);
  EXPECT_EQ(dtype_bytes(DType::kFP4E2M1, 3), 2);  // packed, rounded up
  EXPECT_EQ(dtype_bytes(DType::kFP32, 5), 20);
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP64, DType::kInt32, DType::kInt64,
                  DType::kUInt8, DType::kBool, DType::kFP8E4M3, DType::kFP8E5M2, DType::kE8M0, DType::kFP4E2M1})
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  expect_error_naming([] { dtype_from_name("bf17", "weight_dtype"); }, "weight_dtype");
}

TEST(TensorView, ShapeStridesAndChecks) {
  float buf[24];
  TensorView v(buf, DType::kFP32, {2, 3, 4}, Device::kCPU);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.shape_string(), "[2, 3, 4]");
  check_shape(v, "x", {2, -1, 4});
  expect_error_naming([&] { check_shape(v, "x", {2, 3, 5}); }, "'x'");
  expect_error_naming([&] { check_dtype(v, "probs", DType::kBF16); }, "'probs'");
  expect_error_naming([&] { check_device(v, "y", Device::kCUDA); }, "'y'");
  TensorView t = v;
  std::swap(t.strides[1], t.strides[2]);
  expect_error_naming([&] { check_contiguous(t, "w"); }, "'w'");
  TensorView null_view(nullptr, DType::kFP32, {3});
  expect_error_naming([&] { check_pointer(null_view, "dy"); }, "'dy'");
  TensorView misaligned(reinterpret_cast<char*>(buf) + 4, DType::kFP32, {3});
  expect_error_naming([&] { check_pointer(misaligned, "x_perm", 16); }, "'x_perm'");
  TensorView empty(nullptr, DType::kFP32, {0, 4});
  check_pointer(empty, "empty");  // empty tensors may be null
  EXPECT_THROW(TensorView(buf, DType::kFP32, {1, 1, 1, 1, 1}), Error);
}

TEST(FloatConvert, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly half-way between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3*2^-8 is half-way between 1+2^-7 (odd) and 1+2^-6 (even): up.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::nanf("")))));
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isinf(round_to_bf16(std::numeric_limits<float>::max())));  // overflow rounds to inf
}

TEST(FloatConvert, Fp16RoundTripsAndRounds) {
  for (float x : {0.0f, 1.0f, -1.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f})
    EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(x)), x) << x;
  EXPECT_EQ(float_to_fp16_bits(1.0f), 0x3C00);
  EXPECT_EQ(float_to_fp16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);       // tie -> even
  EXPECT_EQ(float_to_fp16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);   // tie -> even (up)
  EXPECT_EQ(float_to_fp16_bits(70000.0f), 0x7C00);                           // overflow -> inf
  EXPECT_EQ(float_to_fp16_bits(std::ldexp(1.0f, -26)), 0x0000);              // below half the smallest
  // Every fp16 bit pattern that is not NaN survives a round trip through fp32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;
    ASSERT_EQ(float_to_fp16_bits(fp16_bits_to_float(static_cast<uint16_t>(h))), h) << h;
  }
}

TEST(DeviceErrors, DescribesBits) {
  EXPECT_EQ(describe_error_bits(0), "");
  std::string s = describe_error_bits(kErrExpertOutOfRange | kErrRowOverflow);
  EXPECT_NE(s.find("expert id out of range"), std::string::npos);
  EXPECT_NE(s.find("row bound"), std::string::npos);
  EXPECT_NE(describe_error_bits(1u << 31).find("unknown"), std::string::npos);
}

TEST(Routing, RowBoundsAndOptions) {
  EXPECT_EQ(default_row_bound(100, 2, 8, 0, false), 200);
  EXPECT_EQ(default_row_bound(100, 2, 8, 16, false), 200 + 8 * 15);
  EXPECT_EQ(default_row_bound(100, 2, 8, 16, true), 200);
  DispatchOptions o;
  o.align = 16;
  EXPECT_EQ(resolve_row_bound(o, RoutingForm::kTopK, 10, 2, 4), 20 + 60);
  expect_error_naming([&] { resolve_row_bound(o, RoutingForm::kMap, 10, 2, 4); }, "row_bound");
  o.row_bound = 77;
  EXPECT_EQ(resolve_row_bound(o, RoutingForm::kMap, 10, 2, 4), 77);
  o.align = 48;
  expect_error_naming([&] { validate_dispatch_options(o); }, "align");
}

TEST(Activation, LayoutAndValidation) {
  EXPECT_EQ(fc1_out_features(Activation::kSwiGLU, 64), 128);
  EXPECT_EQ(fc1_out_features(Activation::kSquaredReLU, 64), 64);
  EXPECT_EQ(gate_column(5, 64, 0), 5);
  EXPECT_EQ(linear_column(5, 64, 0), 69);
  // s = 32: [g0:32 | l0:32 | g32:64 | l32:64]
  EXPECT_EQ(gate_column(33, 64, 32), 65);
  EXPECT_EQ(linear_column(33, 64, 32), 97);
  EXPECT_EQ(linear_column(0, 64, 32), 32);
  ActivationParams p;
  p.glu_interleave = 24;
  expect_error_naming([&] { validate_activation(p, 64); }, "glu_interleave");
  p.glu_interleave = 32;
  validate_activation(p, 64);
  p.kind = Activation::kSquaredReLU;
  expect_error_naming([&] { validate_activation(p, 64); }, "glu_interleave");
  ActivationParams clamped;
  clamped.kind = Activation::kClampedSwiGLU;
  clamped.limit = 0.0f;
  expect_error_naming([&] { validate_activation(clamped, 64); }, "limit");
  clamped.limit = 7.0f;
  clamped.alpha = std::nanf("");
  expect_error_naming([&] { validate_activation(clamped, 64); }, "alpha");
  EXPECT_EQ(activation_from_name("clamped-swiglu"), Activation::kClampedSwiGLU);
  expect_error_naming([] { activation_from_name("relu6"); }, "activation");
}

// Token chunks are offered where the layer's workspace holds nothing else of R x H: the probs in the
// activation, bf16 experts without bias, the fused fc2 dgrad gathering dy (no dY_perm).
TEST(GroupedMlpConfig, TokenChunksNeedWhatTheyAreBuiltOn) {
  GroupedMlpConfig c = small_config(4, 2, 33);
  c.fuse_fc1 = true;
  c.save_x_perm = false;
  c.fuse_fc2_dgrad = true;
  c.token_chunks = 4;
  c.validate();
  EXPECT_TRUE(c.experts_config().row_windows);
  EXPECT_EQ(c.chunk_row_bound(), 9 * 2);  // ceil(33 / 4) tokens x k rows
  c.token_chunks = 64;
  EXPECT_EQ(c.chunk_row_bound(), 1 * 2);
  c.token_chunks = 1;
  EXPECT_FALSE(c.experts_config().row_windows);
  EXPECT_EQ(c.chunk_row_bound(), c.row_bound());
  c.token_chunks = 2;
  c.delay_wgrad = true;  // dY lives in the state then: x_perm may be saved
  c.save_x_perm = true;
  c.validate();
  c.delay_wgrad = false;
  c.save_x_perm = false;
  auto refused = [&](auto edit, const char* needle) {
    GroupedMlpConfig b = c;
    edit(b);
    expect_error_naming([&] { b.validate(); }, needle);
  };
  refused([](GroupedMlpConfig& b) { b.token_chunks = 0; }, "token_chunks");
  refused([](GroupedMlpConfig& b) { b.token_chunks = 65; }, "token_chunks");
  refused([](GroupedMlpConfig& b) { b.probs = ProbsPlacement::kAtCombine; }, "probs in the activation");
  refused([](GroupedMlpConfig& b) { b.bias = true; }, "bias");
  refused([](GroupedMlpConfig& b) { b.fuse_fc2_dgrad = false; }, "fuse_fc2_dgrad");
  refused([](GroupedMlpConfig& b) { b.save_x_perm = true; }, "save_x_perm");
  ExpertsConfig e = c.experts_config();
  e.bias = true;
  expect_error_naming([&] { e.validate(); }, "row_windows");
}

// Bounds whose products would wrap around int64 into small buffers, dimensions past what a kernel
// indexes, counts past a kernel's tables, and enumeration values outside their type: each refused
// at validation, naming the field (a layer sized from them would write past its buffers).
TEST(GroupedMlpConfig, RefusesSizesThatWouldWrapOrExceedTheKernels) {
  GroupedMlpConfig c = small_config(8, 4, 1000);
  c.validate();
  auto refuses = [&](const std::function<void(GroupedMlpConfig&)>& edit, const char* name) {
    GroupedMlpConfig bad = c;
    edit(bad);
    expect_error_naming([&] { bad.validate(); }, name);
  };
  refuses([](GroupedMlpConfig& b) { b.max_tokens = int64_t{1} << 62; }, "'max_tokens'");
  refuses([](GroupedMlpConfig& b) { b.max_tokens = std::numeric_limits<int64_t>::max(); }, "'max_tokens'");
  refuses([](GroupedMlpConfig& b) { b.max_tokens = (int64_t{1} << 31) / 4 + 1; }, "'max_tokens'");
  refuses([](GroupedMlpConfig& b) {
    b.routing_form = RoutingForm::kMap;
    b.dispatch.row_bound = 1000;
    b.max_tokens = int64_t{1} << 62;
  }, "'max_tokens'");
  refuses([](GroupedMlpConfig& b) { b.hidden = int64_t{1} << 40; }, "'hidden'");
  refuses([](GroupedMlpConfig& b) { b.ffn = int64_t{1} << 40; }, "'ffn'");
  refuses([](GroupedMlpConfig& b) { b.experts = 2000; }, "'experts'");
  refuses([](GroupedMlpConfig& b) { b.activation.kind = static_cast<Activation>(7); }, "'activation'");
  refuses([](GroupedMlpConfig& b) { b.probs = static_cast<ProbsPlacement>(5); }, "'probs'");
  refuses([](GroupedMlpConfig& b) { b.layout = static_cast<WeightLayout>(5); }, "'layout'");
  refuses([](GroupedMlpConfig& b) { b.wgrad = static_cast<WgradMode>(5); }, "'wgrad'");
  refuses([](GroupedMlpConfig& b) { b.routing_form = static_cast<RoutingForm>(5); }, "'routing_form'");
  // The quantized experts' quantize kernels take at most 65535 x 128 rows.
  refuses([](GroupedMlpConfig& b) {
    b.fp8 = Fp8Recipe::kBlock;
    b.dispatch.align = 128;
    b.max_tokens = 3000000;  // x 4 slots: past 65535 x 128 rows
  }, "'max_tokens'");
  GroupedMlpConfig big = c;
  big.max_tokens = (int64_t{1} << 31) / 4 - 1024;  // the largest bound still fits the int32 rows
  big.validate();

  ExpertsConfig e = c.experts_config();
  e.validate();
  ExpertsConfig bad = e;
  bad.experts = 70000;
  expect_error_naming([&] { bad.validate(); }, "'experts'");
  bad = e;
  bad.emulated = EmulatedQuant::kMXFP8;
  bad.max_rows = int64_t{65535} * 128 + 32;
  expect_error_naming([&] { bad.validate(); }, "'max_rows'");
  bad = e;
  bad.probs = static_cast<ProbsPlacement>(9);
  expect_error_naming([&] { bad.validate(); }, "'probs'");
}

// Row bounds: T x k refused past the int32 row indices, by division (no product that wraps).
TEST(Routing, RowBoundsRefuseTokenCountsPastTheRowIndices) {
  EXPECT_EQ(default_row_bound((int64_t{1} << 31) / 8 - 1, 8, 4, 0, false), ((int64_t{1} << 31) / 8 - 1) * 8);
  expect_error_naming([] { default_row_bound(int64_t{1} << 61, 8, 4, 0, false); }, "'max_tokens'");
  expect_error_naming([] { default_row_bound(-1, 8, 4, 0, false); }, "'max_tokens'");
  expect_error_naming([] { default_row_bound(10, 0, 4, 0, false); }, "'topk'");
}

// A view set up by hand with a negative extent, or an ndim past the four dimensions, is refused by
// the shape checks and described without reading past the shape.
TEST(TensorView, ShapeChecksRefuseNegativeExtentsAndBadRanks) {
  TensorView t(nullptr, DType::kBF16, {5, 128});
  check_shape(t, "x", {-1, 128});  // -1 expected: any extent
  t.shape[0] = -2;
  expect_error_naming([&] { check_shape(t, "x", {-1, 128}); }, "'x'");
  t.ndim = 9;
  EXPECT_EQ(t.shape_string(), "[invalid ndim 9]");
  expect_error_naming([&] { check_shape(t, "x", {5, 128}); }, "'x'");
}

TEST(GroupedMlpConfig, ValidatesFields) {
  GroupedMlpConfig c = small_config(4, 2, 32);
  c.validate();
  EXPECT_EQ(c.fc1_out(), 128);
  EXPECT_EQ(c.row_bound(), 64);
  auto bad = c;
  bad.hidden = 100;
  expect_error_naming([&] { bad.validate(); }, "hidden");
  bad = c;
  bad.save_x_perm = false;  // only the fused kernels can gather the rows of x
  expect_error_naming([&] { bad.validate(); }, "save_x_perm");
  bad.fuse_fc1 = true;
  bad.validate();
  bad = c;
  bad.topk = 5;
  expect_error_naming([&] { bad.validate(); }, "topk");
  bad = c;
  bad.wgrad_dtype = DType::kFP16;
  expect_error_naming([&] { bad.validate(); }, "wgrad_dtype");
  bad = c;
  bad.routing_form = RoutingForm::kMap;
  expect_error_naming([&] { bad.validate(); }, "row_bound");
  bad = c;
  bad.max_sms = -1;
  expect_error_naming([&] { bad.validate(); }, "max_sms");
  ExpertsConfig e = c.experts_config();
  EXPECT_EQ(e.max_sms, 0);
  e.max_sms = -2;
  expect_error_naming([&] { e.validate(); }, "max_sms");
  bad.max_sms = 100;
  EXPECT_EQ(bad.experts_config().max_sms, 100);
  // The dprobs partial sums go to dx_perm exactly where the layer's fused backward passes no dY_out
  // (fused fc2 dgrad, probs in the activation, no bias, no delayed wgrad, no saved x_perm).
  bad = c;
  bad.fuse_fc1 = true;
  bad.fuse_fc2_dgrad = true;
  bad.save_x_perm = false;
  EXPECT_TRUE(bad.experts_config().dprobs_partials_in_dx_perm);
  bad.experts_config().validate();
  for (int which = 0; which < 5; ++which) {
    auto f = bad;
    if (which == 0) f.fuse_fc2_dgrad = false;
    if (which == 1) f.bias = true;
    if (which == 2) f.delay_wgrad = true;
    if (which == 3) f.save_x_perm = true;
    if (which == 4) f.probs = ProbsPlacement::kAtCombine;
    EXPECT_FALSE(f.experts_config().dprobs_partials_in_dx_perm) << which;
  }
  e = bad.experts_config();
  e.fuse_fc2_dgrad = false;
  expect_error_naming([&] { e.validate(); }, "dprobs_partials_in_dx_perm");
  e.fuse_fc2_dgrad = true;
  e.probs = ProbsPlacement::kAtCombine;
  expect_error_naming([&] { e.validate(); }, "dprobs_partials_in_dx_perm");
  // Transposed weights: the unfused path only (the fused kernels read the standard orientation).
  bad = c;
  bad.transposed_weights = true;
  bad.validate();
  EXPECT_TRUE(bad.experts_config().transposed_weights);
  bad.fuse_fc1 = true;
  expect_error_naming([&] { bad.validate(); }, "transposed_weights");
  expect_error_naming([&] { bad.experts_config().validate(); }, "fuse_fc1");
  bad.fuse_fc1 = false;
  bad.fuse_fc2_dgrad = true;
  expect_error_naming([&] { bad.validate(); }, "fuse_fc2_dgrad");
  // FP8 experts: A = 128, the unfused path, the standard orientation (delayed wgrad allowed); the row
  // bound is rounded up to a multiple of 16 and passed on to the experts with the recipe.
  bad = c;
  bad.fp8 = Fp8Recipe::kBlock;
  expect_error_naming([&] { bad.validate(); }, "dispatch.align");
  bad.dispatch.align = 128;
  bad.validate();
  EXPECT_EQ(bad.row_bound() % 16, 0);
  EXPECT_GE(bad.row_bound(), default_row_bound(bad.max_tokens, bad.topk, bad.experts, 128, false));
  EXPECT_EQ(bad.experts_config().fp8, Fp8Recipe::kBlock);
  EXPECT_EQ(bad.experts_config().max_rows, bad.row_bound());
  bad.experts_config().validate();
  for (int which = 0; which < 3; ++which) {
    auto f = bad;
    if (which == 0) f.fuse_fc1 = true;
    if (which == 1) f.fuse_fc2_dgrad = true;
    if (which == 2) f.transposed_weights = true;
    expect_error_naming([&] { f.validate(); }, "'fp8'");
    expect_error_naming([&] { f.experts_config().validate(); }, "'fp8'");
  }
  auto delayed = bad;
  delayed.delay_wgrad = true;
  delayed.validate();
  EXPECT_TRUE(delayed.experts_config().delay_wgrad);
  delayed.experts_config().validate();
  ExpertsConfig fe = bad.experts_config();
  fe.max_rows = 100;  // not a multiple of 16
  expect_error_naming([&] { fe.validate(); }, "max_rows");
  // FP8 primary weights (fp32 master weights bound) need the FP8 experts.
  auto master = bad;
  master.fp8_weight_refresh = Fp8WeightRefresh::kFromMaster;
  master.validate();
  EXPECT_EQ(master.experts_config().fp8_weight_refresh, Fp8WeightRefresh::kFromMaster);
  master.fp8 = Fp8Recipe::kNone;
  expect_error_naming([&] { master.validate(); }, "fp8_weight_refresh");
  expect_error_naming([&] { master.experts_config().validate(); }, "fp8_weight_refresh");
  // Emulated MXFP8 / NVFP4: any alignment, the unfused path, the standard orientation, hidden and
  // ffn in whole blocks, not with fp8; from master allowed; passed on to the experts.
  for (EmulatedQuant q : {EmulatedQuant::kMXFP8, EmulatedQuant::kNVFP4}) {
    auto em = c;
    em.emulated = q;
    em.validate();
    EXPECT_EQ(em.experts_config().emulated, q);
    em.delay_wgrad = true;
    em.validate();
    for (int which = 0; which < 5; ++which) {
      auto f = em;
      if (which == 0) f.fuse_fc1 = true;
      if (which == 1) f.fuse_fc2_dgrad = true;
      if (which == 2) f.transposed_weights = true;
      if (which == 3) f.fp8 = Fp8Recipe::kBlock, f.dispatch.align = 128;
      if (which == 4) f.ffn = q == EmulatedQuant::kMXFP8 ? c.ffn + 16 : c.ffn + 8;
      expect_error_naming([&] { f.validate(); }, "'emulated'");
      expect_error_naming([&] { f.experts_config().validate(); }, "'emulated'");
    }
    auto fm = em;  // quantized primary weights: fp32 master weights bound
    fm.fp8_weight_refresh = Fp8WeightRefresh::kFromMaster;
    fm.validate();
    EXPECT_EQ(fm.experts_config().fp8_weight_refresh, Fp8WeightRefresh::kFromMaster);
  }
  EXPECT_STREQ(emulated_quant_name(EmulatedQuant::kNVFP4), "nvfp4");
}

}  // namespace
}  // namespace moe
