// FP8 block-scaled grouped GEMMs (fprop, dgrad on the weights' columnwise copy, wgrad on the tokens'
// columnwise copies) against a dequantize-then-fp64 reference: the operands are quantized by the
// GPU kernels (checked bitwise against the CPU reference quantizer here too), dequantized by the
// CPU reference and multiplied in fp64. Uneven, empty and partial-block groups, N and K that are
// not multiples of 128 (partial scale blocks), both weight layouts and both token-scale layouts
// (bitwise identical), transposed
// weight gradients (within the bound), main_grad accumulation, CUDA graph replay with new groups and data (bitwise
// equal to eager), a wgrad group off the 128-token grid (reported, skipped), zero rows, bad input.
//
// Data: normal values times 2^u per scale block, u uniform in [-6, 6], so block scales differ by
// up to 2^12: a scale applied to the wrong block, or not at all, is off by orders of magnitude.
//
// Tolerance: |gpu - ref| <= 2^-8 |ref| (bf16 output; 0 for fp32) + 2^-9 * sum|a b| + 2^-22 |c|.
// The reference multiplies exactly the dequantized operands, so the only errors are the output
// rounding and the accumulation: FP8 WGMMA sums its products in an accumulator narrower than fp32
// (about 14 significant bits, DeepSeek-V3 report, section 3.3), which the kernel promotes into fp32
// with the two blocks' scales after every 128-long block of the reduction; 2^-9 * sum|a b| bounds
// a 14-bit accumulator's truncation over one block with margin (the largest error / bound seen is
// printed: 0.2-0.9 on the H100).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/grouped_gemm.h"
#include "moe/quantize.h"
#include "reference/grouped_gemm_ref.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using testing::expect_error_naming;

constexpr double kAccumulation = 1.0 / 512;  // 2^-9 of sum|a b|, see the header
constexpr double kBf16Output = 1.0 / 256;    // 2^-8 of |ref|

// bf16 bits of B matrices [M, K]: normal(0, 1) times 2^u, u drawn per block of br x bc elements.
std::vector<uint16_t> block_scaled(int64_t B, int64_t M, int64_t K, int64_t br, int64_t bc, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-6, 6);
  const int64_t rb = (M + br - 1) / br, cb = (K + bc - 1) / bc;
  std::vector<int> u(static_cast<size_t>(B * rb * cb));
  for (int& v : u) v = mag(rng);
  std::vector<uint16_t> x(static_cast<size_t>(B * M * K));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < K; ++c)
        x[(b * M + r) * K + c] = float_to_bf16_bits(std::ldexp(nd(rng), u[(b * rb + r / br) * cb + c / bc]));
  return x;
}

QuantConfig fp8_config(bool two_d, bool rowwise, bool columnwise, ScaleLayout layout) {
  QuantConfig c;
  c.format = QuantFormat::kFP8Block;
  c.blocking = two_d ? QuantBlocking::k2D : QuantBlocking::k1D;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  c.scale_layout = layout;
  return c;
}
// Activations and gradients for fprop / dgrad: rowwise 1x128, scales [rows, blocks] row-major.
QuantConfig token_rowwise() { return fp8_config(false, true, false, ScaleLayout::kRowMajor); }
// Tokens for wgrad: columnwise 128x1 (blocks along the tokens), scales [token blocks, cols].
QuantConfig token_columnwise() { return fp8_config(false, false, true, ScaleLayout::kMNMajor); }
// Weights: 128x128 blocks, both copies.
QuantConfig weight_2d() { return fp8_config(true, true, true, ScaleLayout::kRowMajor); }

// One tensor quantized by the GPU (device copies) and by the CPU reference (host bytes).
struct Quant {
  QuantConfig c;
  int64_t B, M, K;
  bool batched;
  DeviceBuffer<uint8_t> rdata, cdata;
  DeviceBuffer<float> rscale, cscale;
  ref::Quantized host;

  Quant(const QuantConfig& cfg, const std::vector<uint16_t>& x, int64_t B_, int64_t M_, int64_t K_, bool batched_,
        cudaStream_t stream)
      : c(cfg), B(B_), M(M_), K(K_), batched(batched_) {
    const ScaleShape rs = scale_shape(c, M, K), cs = scale_shape(c, K, M);
    if (c.rowwise) rdata = DeviceBuffer<uint8_t>(B * M * K), rscale = DeviceBuffer<float>(B * rs.rows * rs.cols);
    if (c.columnwise) cdata = DeviceBuffer<uint8_t>(B * M * K), cscale = DeviceBuffer<float>(B * cs.rows * cs.cols);
    DeviceBuffer<uint16_t> dx(x);
    QuantizedTensor q;
    if (c.rowwise) q.rowwise_data = view(rdata.get(), DType::kFP8E4M3, M, K), q.rowwise_scale = view(rscale.get(), DType::kFP32, rs.rows, rs.cols);
    if (c.columnwise) q.columnwise_data = view(cdata.get(), DType::kFP8E4M3, K, M), q.columnwise_scale = view(cscale.get(), DType::kFP32, cs.rows, cs.cols);
    quantize(c, view(dx.get(), DType::kBF16, M, K), q, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    host = ref::quantize(c, x, B, M, K);
    // The operands of the test are the reference's bytes (the quantizer has its own bitwise tests).
    if (c.rowwise) EXPECT_TRUE(same_bytes(rdata, host.rowwise_data) && same_bytes(rscale, host.rowwise_scale));
    if (c.columnwise) EXPECT_TRUE(same_bytes(cdata, host.columnwise_data) && same_bytes(cscale, host.columnwise_scale));
  }
  TensorView view(void* p, DType t, int64_t r, int64_t k) const {
    return batched ? TensorView(p, t, {B, r, k}) : TensorView(p, t, {r, k});
  }
  template <class T>
  static bool same_bytes(const DeviceBuffer<T>& d, const std::vector<uint8_t>& h) {
    const std::vector<T> v = d.download();
    return v.size() * sizeof(T) == h.size() && std::memcmp(v.data(), h.data(), h.size()) == 0;
  }
  // fp64 values of a copy, as the reference dequantizes it ([B, M, K] rowwise, [B, K, M] columnwise).
  std::vector<double> values(bool columnwise) const {
    const std::vector<float> f = ref::dequantize(c, host, columnwise, B, M, K);
    return std::vector<double>(f.begin(), f.end());
  }
  int64_t scale_rows(bool columnwise) const { return columnwise ? scale_shape(c, K, M).rows : scale_shape(c, M, K).rows; }
  int64_t scale_cols(bool columnwise) const { return columnwise ? scale_shape(c, K, M).cols : scale_shape(c, M, K).cols; }
};

std::vector<double> transpose(const std::vector<double>& v, int64_t rows, int64_t cols) {
  std::vector<double> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}
std::vector<double> absolute(std::vector<double> v) {
  for (double& x : v) x = std::fabs(x);
  return v;
}
std::vector<int32_t> offsets_from_sizes(const std::vector<int>& sizes) {
  std::vector<int32_t> off{0};
  for (int s : sizes) off.push_back(off.back() + s);
  return off;
}
ref::Groups groups_of(const std::vector<int32_t>& off) {
  ref::Groups g;
  for (size_t e = 0; e + 1 < off.size(); ++e) g.offset.push_back(off[e]), g.rows.push_back(off[e + 1] - off[e]);
  return g;
}
std::vector<const double*> expert_ptrs(const std::vector<double>& w, int E, int64_t n) {
  std::vector<const double*> p;
  for (int e = 0; e < E; ++e) p.push_back(w.data() + e * n);
  return p;
}

struct Engine {
  // Weight dims up to 1024: every FP8 configuration runs, the 192-wide ones with restated scales.
  // max_sms > 0: the persistent grid is that small, so each CTA runs several tiles.
  Engine(int E, int64_t R, int max_sms = 0) : gg(E, R, max_sms, 1024), ws(gg.workspace_bytes()) {}
  GroupedGemm gg;
  DeviceBuffer<uint8_t> ws;
  TensorView workspace() const { return TensorView(ws.get(), DType::kUInt8, {int64_t(ws.size())}); }
  void run(const GemmProblem& p, cudaStream_t s) const { gg.run(p, workspace(), s); }
};

// Every element of got within the bound of value; returns (and prints) the largest error / bound.
// got: fp32 results, or bf16 ones as doubles.
template <typename T>
double check_within(const std::vector<T>& got, const std::vector<double>& value, const std::vector<double>& abs_sum,
                    double out_rel, const std::vector<double>* prior, const std::string& what) {
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double c = prior ? std::fabs((*prior)[i]) : 0.0;
    const double err = std::fabs(double(got[i]) - value[i]);
    const double bound = out_rel * std::fabs(value[i]) + kAccumulation * abs_sum[i] + 0x1p-22 * c;
    if (bound > 0) worst = std::max(worst, err / bound);
    if (!(err <= bound) && bad++ < 8)
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << value[i] << " (bound " << bound
                    << ")";
  }
  std::printf("%s: largest |gpu - ref| / bound = %.3f\n", what.c_str(), worst);
  return worst;
}

// One fprop/dgrad problem: E experts W [N, K], groups of the R token rows.
struct TokenProblem {
  int E;
  int64_t N, K, R;
  std::vector<int32_t> off;
  DeviceBuffer<int32_t> d_off;
  cudaStream_t stream;
  Quant x, dy, w;

  TokenProblem(int E_, int64_t N_, int64_t K_, std::vector<int> sizes, uint64_t seed, cudaStream_t s)
      : E(E_), N(N_), K(K_), R(0), off(offsets_from_sizes(sizes)), d_off(off), stream(s),
        x(token_rowwise(), block_scaled(1, off.back(), K_, 1, 128, seed), 1, off.back(), K_, false, s),
        dy(token_rowwise(), block_scaled(1, off.back(), N_, 1, 128, seed + 1), 1, off.back(), N_, false, s),
        w(weight_2d(), block_scaled(E_, N_, K_, 128, 128, seed + 2), E_, N_, K_, true, s) {
    R = off.back();
  }
  TensorView offsets() const { return TensorView(d_off.get(), DType::kInt32, {int64_t(E) + 1}); }
  GemmProblem fprop(const TensorView& y) const {
    GemmProblem p;
    p.op = GemmOp::kFprop;
    p.a = TensorView(x.rdata.get(), DType::kFP8E4M3, {R, K});
    p.a_scale = TensorView(x.rscale.get(), DType::kFP32, {R, x.scale_cols(false)});
    p.w = ExpertMatrices::grouped(TensorView(w.rdata.get(), DType::kFP8E4M3, {int64_t(E), N, K}), "w");
    p.w_scale = ExpertMatrices::grouped(
        TensorView(w.rscale.get(), DType::kFP32, {int64_t(E), w.scale_rows(false), w.scale_cols(false)}), "w_scale", 4);
    p.d = y;
    p.group_offsets = offsets();
    return p;
  }
  GemmProblem dgrad(const TensorView& dx) const {
    GemmProblem p;
    p.op = GemmOp::kDgrad;
    p.a = TensorView(dy.rdata.get(), DType::kFP8E4M3, {R, N});
    p.a_scale = TensorView(dy.rscale.get(), DType::kFP32, {R, dy.scale_cols(false)});
    p.w = ExpertMatrices::grouped(TensorView(w.cdata.get(), DType::kFP8E4M3, {int64_t(E), K, N}), "w").as_transposed();
    p.w_scale = ExpertMatrices::grouped(TensorView(w.cscale.get(), DType::kFP32,
                                                   {int64_t(E), w.scale_rows(true), w.scale_cols(true)}),
                                        "w_scale", 4)
                    .as_transposed();
    p.d = dx;
    p.group_offsets = offsets();
    return p;
  }
};

class Fp8GroupedGemm : public testing::StreamTest {};

TEST_F(Fp8GroupedGemm, FpropAndDgradMatchTheDequantizedReference) {
  struct Case {
    int E;
    int64_t N, K;
    std::vector<int> sizes;
    int sms = 0;  // > 0: a grid of that many SMs
  };
  // N and K not multiples of 128 (partial scale blocks in both operands), empty groups, groups
  // shorter than a tile, one long group. Reductions of 4 and 8 blocks take the 128x192 tile's
  // 16-byte scale loads (four blocks per load; with 8, the second load too), the others its
  // word-by-word copies. The last case runs on 4 SMs: 8 blocks per tile and several tiles per CTA
  // wrap the stage ring within and across tiles.
  const Case cases[] = {{4, 400, 336, {130, 0, 77, 301}},
                        {3, 256, 512, {0, 640, 16}},
                        {1, 128, 128, {5}},
                        {2, 1024, 1024, {200, 72}},
                        {2, 1024, 1024, {200, 72}, 4}};
  // Every compiled fprop-form configuration (dgrad runs on the fprop-form kernel too).
  for (const std::string& config : GroupedGemm::configs(GemmOp::kFprop, DType::kBF16, DType::kFP8E4M3))
    for (const Case& cs : cases) {
      const TokenProblem p(cs.E, cs.N, cs.K, cs.sizes, 7 + cs.N, stream);
      Engine eng(cs.E, p.R, cs.sms);
      eng.gg.force_config(GemmOp::kFprop, config);
      const std::string tag = config + " E=" + std::to_string(cs.E) + " N=" + std::to_string(cs.N) +
                              " K=" + std::to_string(cs.K) + " SMs=" + std::to_string(eng.gg.sm_count());
      const ref::Groups g = groups_of(p.off);
      const std::vector<double> xd = p.x.values(false), dyd = p.dy.values(false), wd = p.w.values(false);
      const std::vector<double> xa = absolute(xd), dya = absolute(dyd), wa = absolute(wd);

      DeviceBuffer<uint16_t> y(p.R * cs.N), dx(p.R * cs.K);
      eng.run(p.fprop(TensorView(y.get(), DType::kBF16, {p.R, cs.N})), stream);
      eng.run(p.dgrad(TensorView(dx.get(), DType::kBF16, {p.R, cs.K})), stream);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));

      std::vector<double> yv(p.R * cs.N), ya(p.R * cs.N), dxv(p.R * cs.K), dxa(p.R * cs.K);
      ref::grouped_fprop(g, xd.data(), expert_ptrs(wd, cs.E, cs.N * cs.K).data(), cs.N, cs.K, yv.data());
      ref::grouped_fprop(g, xa.data(), expert_ptrs(wa, cs.E, cs.N * cs.K).data(), cs.N, cs.K, ya.data());
      ref::grouped_dgrad(g, dyd.data(), expert_ptrs(wd, cs.E, cs.N * cs.K).data(), cs.N, cs.K, dxv.data());
      ref::grouped_dgrad(g, dya.data(), expert_ptrs(wa, cs.E, cs.N * cs.K).data(), cs.N, cs.K, dxa.data());
      check_within(testing::layer_data::from_bf16(y.download()), yv, ya, kBf16Output, nullptr, "fprop " + tag);
      check_within(testing::layer_data::from_bf16(dx.download()), dxv, dxa, kBf16Output, nullptr, "dgrad " + tag);
    }
}

TEST_F(Fp8GroupedGemm, BothWeightLayoutsAreBitwiseEqual) {
  const TokenProblem p(3, 256, 384, {200, 0, 150}, 11, stream);
  const Engine eng(3, p.R);
  DeviceBuffer<uint16_t> y1(p.R * p.N), y2(p.R * p.N), dx1(p.R * p.K), dx2(p.R * p.K);
  GemmProblem f = p.fprop(TensorView(y1.get(), DType::kBF16, {p.R, p.N}));
  GemmProblem d = p.dgrad(TensorView(dx1.get(), DType::kBF16, {p.R, p.K}));
  eng.run(f, stream);
  eng.run(d, stream);
  // Per-expert views of the same bytes: the weights and their scales.
  auto per_expert = [&](void* base, DType t, int64_t r, int64_t c, const char* name) {
    std::vector<TensorView> v;
    for (int e = 0; e < p.E; ++e) v.push_back(TensorView(static_cast<char*>(base) + dtype_bytes(t, e * r * c), t, {r, c}));
    return ExpertMatrices::per_expert(v, name, t == DType::kFP32 ? 4 : 16);
  };
  f.w = per_expert(p.w.rdata.get(), DType::kFP8E4M3, p.N, p.K, "w");
  f.w_scale = per_expert(p.w.rscale.get(), DType::kFP32, p.w.scale_rows(false), p.w.scale_cols(false), "w_scale");
  f.d = TensorView(y2.get(), DType::kBF16, {p.R, p.N});
  d.w = per_expert(p.w.cdata.get(), DType::kFP8E4M3, p.K, p.N, "w").as_transposed();
  d.w_scale =
      per_expert(p.w.cscale.get(), DType::kFP32, p.w.scale_rows(true), p.w.scale_cols(true), "w_scale").as_transposed();
  d.d = TensorView(dx2.get(), DType::kBF16, {p.R, p.K});
  eng.run(f, stream);
  eng.run(d, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(y1.download(), y2.download());
  EXPECT_EQ(dx1.download(), dx2.download());
}

TEST_F(Fp8GroupedGemm, TokenScalesOffTheVectorAlignmentGiveTheSameBits) {
  // 8 scale blocks per row: the 128x192 tile loads four at a time from 16-byte aligned scales and
  // copies them word by word from scales starting one word off that alignment (valid input: fp32
  // scales need 4-byte alignment only). The same products either way, bit for bit.
  const TokenProblem p(2, 1024, 1024, {200, 72}, 13, stream);
  const int64_t cols = p.x.scale_cols(false);
  DeviceBuffer<float> shifted(p.R * cols + 1);
  MOE_CUDA_CHECK(cudaMemcpyAsync(shifted.get() + 1, p.x.rscale.get(), p.R * cols * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream));
  for (const std::string& config : GroupedGemm::configs(GemmOp::kFprop, DType::kBF16, DType::kFP8E4M3)) {
    Engine eng(p.E, p.R);
    eng.gg.force_config(GemmOp::kFprop, config);
    DeviceBuffer<uint16_t> y1(p.R * p.N), y2(p.R * p.N);
    eng.run(p.fprop(TensorView(y1.get(), DType::kBF16, {p.R, p.N})), stream);
    GemmProblem f = p.fprop(TensorView(y2.get(), DType::kBF16, {p.R, p.N}));
    f.a_scale = TensorView(shifted.get() + 1, DType::kFP32, {p.R, cols});
    eng.run(f, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(y1.download(), y2.download()) << config;
  }
}

TEST_F(Fp8GroupedGemm, MnMajorTokenScalesGiveTheBitsOfRowMajorOnes) {
  // The same token operands with their scales MN-major ([blocks, round_up(rows, 4)]): tiles whose
  // group starts on a multiple of 4 rows take the bulk copy of a block's 128 scales, the others
  // (starts at rows 130 and 207 in the first case) the word-by-word copy; partial last tiles read
  // up to the layout's padding. Reductions of 3, 4 and 8 blocks, and a grid of 4 SMs that wraps the
  // stage ring. The products are those of the row-major scales, bit for bit, fprop and dgrad.
  struct Case {
    int E;
    int64_t N, K;
    std::vector<int> sizes;
    int sms = 0;
  };
  const Case cases[] = {{4, 400, 336, {130, 0, 77, 301}},
                        {3, 256, 512, {0, 640, 16}},
                        {1, 128, 128, {5}},
                        {2, 1024, 1024, {200, 72}, 4}};
  const QuantConfig mn = fp8_config(false, true, false, ScaleLayout::kMNMajor);
  for (const std::string& config : GroupedGemm::configs(GemmOp::kFprop, DType::kBF16, DType::kFP8E4M3))
    for (const Case& cs : cases) {
      const TokenProblem p(cs.E, cs.N, cs.K, cs.sizes, 17 + cs.K, stream);
      const Quant x_mn(mn, block_scaled(1, p.R, cs.K, 1, 128, 17 + cs.K), 1, p.R, cs.K, false, stream);
      const Quant dy_mn(mn, block_scaled(1, p.R, cs.N, 1, 128, 18 + cs.K), 1, p.R, cs.N, false, stream);
      Engine eng(cs.E, p.R, cs.sms);
      eng.gg.force_config(GemmOp::kFprop, config);
      const std::string tag = config + " E=" + std::to_string(cs.E) + " K=" + std::to_string(cs.K);
      DeviceBuffer<uint16_t> y1(p.R * cs.N), y2(p.R * cs.N), dx1(p.R * cs.K), dx2(p.R * cs.K);
      eng.run(p.fprop(TensorView(y1.get(), DType::kBF16, {p.R, cs.N})), stream);
      eng.run(p.dgrad(TensorView(dx1.get(), DType::kBF16, {p.R, cs.K})), stream);
      GemmProblem f = p.fprop(TensorView(y2.get(), DType::kBF16, {p.R, cs.N}));
      f.a = TensorView(x_mn.rdata.get(), DType::kFP8E4M3, {p.R, cs.K});
      f.a_scale = TensorView(x_mn.rscale.get(), DType::kFP32, {x_mn.scale_rows(false), x_mn.scale_cols(false)});
      f.a_scale_layout = ScaleLayout::kMNMajor;
      GemmProblem d = p.dgrad(TensorView(dx2.get(), DType::kBF16, {p.R, cs.K}));
      d.a = TensorView(dy_mn.rdata.get(), DType::kFP8E4M3, {p.R, cs.N});
      d.a_scale = TensorView(dy_mn.rscale.get(), DType::kFP32, {dy_mn.scale_rows(false), dy_mn.scale_cols(false)});
      d.a_scale_layout = ScaleLayout::kMNMajor;
      eng.run(f, stream);
      eng.run(d, stream);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      // The codes are the same bytes in both layouts; only the scales move.
      EXPECT_EQ(x_mn.rdata.download(), p.x.rdata.download()) << tag;
      EXPECT_EQ(y1.download(), y2.download()) << "fprop " << tag;
      EXPECT_EQ(dx1.download(), dx2.download()) << "dgrad " << tag;
    }
}

// wgrad: dW_e [N, K] = dY_e^T X_e from the columnwise copies, groups on the 128-token grid.
struct WgradProblem {
  int E;
  int64_t N, K, R;
  std::vector<int32_t> off;
  DeviceBuffer<int32_t> d_off;
  Quant dy, x;
  WgradProblem(int E_, int64_t N_, int64_t K_, std::vector<int> sizes, uint64_t seed, cudaStream_t s)
      : E(E_), N(N_), K(K_), R(0), off(offsets_from_sizes(sizes)), d_off(off),
        dy(token_columnwise(), block_scaled(1, off.back(), N_, 128, 1, seed), 1, off.back(), N_, false, s),
        x(token_columnwise(), block_scaled(1, off.back(), K_, 128, 1, seed + 1), 1, off.back(), K_, false, s) {
    R = off.back();
  }
  GemmProblem problem(const ExpertMatrices& dw, bool accumulate) const {
    GemmProblem p;
    p.op = GemmOp::kWgrad;
    p.a = TensorView(dy.cdata.get(), DType::kFP8E4M3, {N, R});
    p.a_scale = TensorView(dy.cscale.get(), DType::kFP32, {dy.scale_rows(true), dy.scale_cols(true)});
    p.b = TensorView(x.cdata.get(), DType::kFP8E4M3, {K, R});
    p.b_scale = TensorView(x.cscale.get(), DType::kFP32, {x.scale_rows(true), x.scale_cols(true)});
    p.w = dw;
    p.group_offsets = TensorView(d_off.get(), DType::kInt32, {int64_t(E) + 1});
    p.epilogue = accumulate ? GemmEpilogue::kAccumulate : GemmEpilogue::kStore;
    return p;
  }
};

TEST_F(Fp8GroupedGemm, WgradMatchesTheDequantizedReference) {
  // Groups start on the 128-token grid (the dispatch pads to A = 128); the last one ends off it.
  const WgradProblem p(5, 272, 400, {256, 0, 128, 384, 208}, 23, stream);
  // On 4 SMs: each CTA runs about a dozen tiles, so the stage ring wraps across tiles.
  Engine eng(p.E, p.R, 4);
  const ref::Groups g = groups_of(p.off);
  // The reference reads the tokens' copies back in token-major order.
  const std::vector<double> dyd = transpose(p.dy.values(true), p.N, p.R), xd = transpose(p.x.values(true), p.K, p.R);
  const std::vector<double> dya = absolute(dyd), xa = absolute(xd);
  const int64_t NK = p.N * p.K;
  std::vector<double> want(p.E * NK, 0.0), asum(p.E * NK, 0.0);
  std::vector<double*> wp, ap;
  for (int e = 0; e < p.E; ++e) wp.push_back(want.data() + e * NK), ap.push_back(asum.data() + e * NK);
  ref::grouped_wgrad(g, dyd.data(), xd.data(), p.N, p.K, wp.data(), false);
  ref::grouped_wgrad(g, dya.data(), xa.data(), p.N, p.K, ap.data(), false);

  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> prior(p.E * NK);
  for (float& f : prior) f = u(rng);
  std::vector<double> acc(p.E * NK), priord(prior.begin(), prior.end());
  for (size_t i = 0; i < acc.size(); ++i) acc[i] = prior[i] + want[i];
  const auto nk = [&p](void* data, DType dtype) {
    return ExpertMatrices::grouped(TensorView(data, dtype, {int64_t(p.E), p.N, p.K}), "dw");
  };

  // Every compiled FP8 weight-gradient configuration (each has a bf16 and an fp32 form), N and K off
  // every tile width.
  for (const std::string& config : GroupedGemm::configs(GemmOp::kWgrad, DType::kFP32, DType::kFP8E4M3)) {
    SCOPED_TRACE(config);
    eng.gg.force_config(GemmOp::kWgrad, config);
    // Written (the empty expert gets zeros over the poison), accumulated into a main_grad, and
    // written transposed (dW_e^T [K, N], the orientation of transposed weights).
    DeviceBuffer<float> dw(p.E * NK), main_grad(prior), dwt(p.E * NK);
    dw.fill_bytes(0xFF);
    eng.run(p.problem(nk(dw.get(), DType::kFP32), false), stream);
    eng.run(p.problem(nk(main_grad.get(), DType::kFP32), true), stream);
    eng.run(p.problem(ExpertMatrices::grouped(TensorView(dwt.get(), DType::kFP32, {int64_t(p.E), p.K, p.N}), "dw")
                          .as_transposed(),
                      false),
            stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    check_within(dw.download(), want, asum, 0.0, nullptr, config + ": wgrad write");
    // bf16 written: one more rounding (2^-8 of |ref|).
    DeviceBuffer<uint16_t> dwb(p.E * NK);
    eng.run(p.problem(nk(dwb.get(), DType::kBF16), false), stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_within(testing::layer_data::from_bf16(dwb.download()), want, asum, kBf16Output, nullptr,
                 config + ": wgrad write bf16");
    check_within(main_grad.download(), acc, asum, 0.0, &priord, config + ": wgrad accumulate");
    // The transposed product exchanges the operands' roles inside the FP8 tensor-core accumulation,
    // so it is within the same bound rather than bitwise equal.
    const std::vector<float> t = dwt.download();
    std::vector<float> back(t.size());
    for (int e = 0; e < p.E; ++e)
      for (int64_t n = 0; n < p.N; ++n)
        for (int64_t k = 0; k < p.K; ++k) back[e * NK + n * p.K + k] = t[e * NK + k * p.N + n];
    check_within(back, want, asum, 0.0, nullptr, config + ": wgrad write transposed");
  }
  eng.gg.force_config(GemmOp::kWgrad, "");
}

TEST_F(Fp8GroupedGemm, WgradScalesOffTheBulkAlignmentGiveTheSameBits) {
  // Each stage's scales are two runs of a tile's rows, bulk-copied where they start 16-byte aligned
  // (N and K are multiples of 16, so they do whenever the tensors do); scales one word off that
  // alignment (valid: fp32 needs 4 bytes) take CUTLASS's word-by-word copy. The same bits either
  // way, with partial last tiles (N = 272, K = 400).
  const WgradProblem p(3, 272, 400, {256, 128, 208}, 29, stream);
  const int64_t na = p.dy.scale_rows(true) * p.dy.scale_cols(true), nb = p.x.scale_rows(true) * p.x.scale_cols(true);
  DeviceBuffer<float> sa(na + 1), sb(nb + 1);
  MOE_CUDA_CHECK(cudaMemcpyAsync(sa.get() + 1, p.dy.cscale.get(), na * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  MOE_CUDA_CHECK(cudaMemcpyAsync(sb.get() + 1, p.x.cscale.get(), nb * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  const int64_t NK = p.N * p.K;
  for (const std::string& config : GroupedGemm::configs(GemmOp::kWgrad, DType::kFP32, DType::kFP8E4M3)) {
    Engine eng(p.E, p.R, 4);
    eng.gg.force_config(GemmOp::kWgrad, config);
    DeviceBuffer<float> dw1(p.E * NK), dw2(p.E * NK);
    const auto dw = [&](DeviceBuffer<float>& b) {
      return ExpertMatrices::grouped(TensorView(b.get(), DType::kFP32, {int64_t(p.E), p.N, p.K}), "dw");
    };
    eng.run(p.problem(dw(dw1), false), stream);
    GemmProblem shifted = p.problem(dw(dw2), false);
    shifted.a_scale = TensorView(sa.get() + 1, DType::kFP32, {p.dy.scale_rows(true), p.dy.scale_cols(true)});
    shifted.b_scale = TensorView(sb.get() + 1, DType::kFP32, {p.x.scale_rows(true), p.x.scale_cols(true)});
    eng.run(shifted, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(dw1.download(), dw2.download()) << config;
  }
}

TEST_F(Fp8GroupedGemm, WgradWarpGroupStoresGiveTheTmaEpiloguesBits) {
  // The warp-group store epilogue (the fp32 configuration the engine takes for main_grad
  // accumulation) against CUTLASS's TMA epilogue on the same main loop: the same bytes written and
  // added into a main_grad, in both tile orders, with partial tiles in both directions (N = 272,
  // K = 400), an empty expert, and several tiles per CTA (4 SMs), so that each warp group's buffer
  // is reused across tiles and groups.
  const WgradProblem p(4, 272, 400, {256, 0, 384, 208}, 37, stream);
  const int64_t NK = p.N * p.K;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> prior(p.E * NK);
  for (float& f : prior) f = u(rng);
  const auto nk = [&p](float* data) {
    return ExpertMatrices::grouped(TensorView(data, DType::kFP32, {int64_t(p.E), p.N, p.K}), "dw");
  };
  const auto run = [&](const char* config, bool along_n) {
    Engine eng(p.E, p.R, 4);
    eng.gg.force_config(GemmOp::kWgrad, config, along_n);
    DeviceBuffer<float> dw(p.E * NK), main_grad(prior);
    dw.fill_bytes(0xFF);
    eng.run(p.problem(nk(dw.get()), false), stream);
    eng.run(p.problem(nk(main_grad.get()), true), stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::make_pair(dw.download(), main_grad.download());
  };
  const auto same_bytes = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (bool along_n : {false, true}) {
    const auto tma = run("fp8_coop_128x128x128_c2x1", along_n);
    const auto rows = run("fp8_coop_128x128x128_c2x1_wgstores", along_n);
    EXPECT_TRUE(same_bytes(rows.first, tma.first)) << "written, along " << (along_n ? "N" : "M");
    EXPECT_TRUE(same_bytes(rows.second, tma.second)) << "added into main_grad, along " << (along_n ? "N" : "M");
    EXPECT_FALSE(same_bytes(tma.second, prior)) << "the accumulation changed main_grad";
  }
}

TEST_F(Fp8GroupedGemm, WgradGroupOffTheTokenGridIsReportedAndSkipped) {
  // Expert 1 [128, 192) ends inside a 128-token block that expert 2 [192, 256) continues, so both
  // would read scale blocks shared with other tokens: both are skipped (as if empty) and reported;
  // expert 0 fills whole blocks and is computed.
  const WgradProblem p(3, 128, 128, {128, 64, 64}, 31, stream);
  const Engine eng(p.E, p.R);
  const int64_t NK = p.N * p.K;
  for (bool accumulate : {true, false}) {
    DeviceBuffer<float> dw(p.E * NK);
    dw.fill_bytes(accumulate ? 0 : 0xFF);  // main_grad zeros, or poison that write mode must replace
    DeviceBuffer<uint32_t> err(std::vector<uint32_t>{0});
    GemmProblem pr = p.problem(ExpertMatrices::grouped(TensorView(dw.get(), DType::kFP32, {3, p.N, p.K}), "dw"),
                               accumulate);
    pr.error_word = err.get();
    eng.run(pr, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(err.download()[0], uint32_t(kErrUnalignedGroup)) << describe_error_bits(err.download()[0]);
    const std::vector<float> got = dw.download();
    EXPECT_TRUE(std::all_of(got.begin() + NK, got.end(), [](float v) { return v == 0.0f; }))
        << "the skipped groups: main_grad left as it was, or zeros written";
    EXPECT_TRUE(std::all_of(got.begin(), got.begin() + NK, [](float v) { return std::isfinite(v); }) &&
                std::any_of(got.begin(), got.begin() + NK, [](float v) { return v != 0.0f; }))
        << "the group on the grid is computed";
  }
}

TEST_F(Fp8GroupedGemm, GraphReplayWithNewGroupsIsBitwiseEager) {
  const int E = 4;
  const int64_t N = 256, K = 256, R = 512;
  const std::vector<int> s1 = {100, 0, 300, 112}, s2 = {0, 512, 0, 0};
  // Two problems with the same buffer shapes: the graph runs on the first one's device buffers,
  // into which the second one's data and offsets are copied before the replay.
  TokenProblem a(E, N, K, s1, 41, stream), b(E, N, K, s2, 43, stream);
  const Engine eng(E, R);
  DeviceBuffer<uint16_t> y(R * N), y_eager(R * N);
  y.fill_bytes(0), y_eager.fill_bytes(0);
  eng.run(b.fprop(TensorView(y_eager.get(), DType::kBF16, {R, N})), stream);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  eng.run(a.fprop(TensorView(y.get(), DType::kBF16, {R, N})), stream);
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  auto copy = [&](void* dst, const void* src, size_t bytes) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  };
  copy(a.x.rdata.get(), b.x.rdata.get(), a.x.rdata.size());
  copy(a.x.rscale.get(), b.x.rscale.get(), a.x.rscale.size() * sizeof(float));
  copy(a.w.rdata.get(), b.w.rdata.get(), a.w.rdata.size());
  copy(a.w.rscale.get(), b.w.rscale.get(), a.w.rscale.size() * sizeof(float));
  copy(a.d_off.get(), b.d_off.get(), a.d_off.size() * sizeof(int32_t));
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(y.download(), y_eager.download());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

TEST_F(Fp8GroupedGemm, ZeroRowsAreValid) {
  const TokenProblem p(2, 128, 128, {0, 0}, 3, stream);
  const Engine eng(2, 16);
  DeviceBuffer<uint16_t> y(16);
  GemmProblem f = p.fprop(TensorView(y.get(), DType::kBF16, {0, 128}));
  EXPECT_NO_THROW(eng.run(f, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

TEST_F(Fp8GroupedGemm, BadInputNamesTheArgument) {
  const TokenProblem p(2, 128, 256, {64, 64}, 5, stream);
  const Engine eng(2, p.R);
  DeviceBuffer<uint16_t> y(p.R * p.N), dx(p.R * p.K);
  const TensorView yv(y.get(), DType::kBF16, {p.R, p.N}), dxv(dx.get(), DType::kBF16, {p.R, p.K});
  GemmProblem f = p.fprop(yv);
  f.a_scale = TensorView();
  expect_error_naming([&] { eng.run(f, stream); }, "'a_scale'");
  f = p.fprop(yv);
  f.a_scale = TensorView(p.x.rscale.get(), DType::kFP32, {p.R, 1});
  expect_error_naming([&] { eng.run(f, stream); }, "'a_scale'");
  f = p.fprop(yv);
  f.a_scale_layout = ScaleLayout::kMNMajor;  // the row-major scales' shape, [rows, blocks]
  expect_error_naming([&] { eng.run(f, stream); }, "'a_scale'");
  f = p.fprop(yv);
  f.a_scale_layout = ScaleLayout::kSwizzled128x4;
  expect_error_naming([&] { eng.run(f, stream); }, "'a_scale_layout'");
  f = p.fprop(yv);
  f.w_scale = ExpertMatrices();
  expect_error_naming([&] { eng.run(f, stream); }, "'w_scale'");
  f = p.fprop(yv);
  f.w = f.w.as_transposed();  // a transposed view where fprop needs the rowwise copy
  expect_error_naming([&] { eng.run(f, stream); }, "'w'");
  GemmProblem d = p.dgrad(dxv);
  d.w = p.fprop(yv).w;  // the rowwise copy where dgrad needs the columnwise one
  expect_error_naming([&] { eng.run(d, stream); }, "'w'");
  f = p.fprop(yv);
  f.d = TensorView(y.get(), DType::kFP32, {p.R / 2, p.N});  // FP8 products write bf16
  expect_error_naming([&] { eng.run(f, stream); }, "'y'");
  // FP8 wgrad writes bf16 or fp32.
  const WgradProblem wp(2, 128, 128, {128, 128}, 9, stream);
  DeviceBuffer<uint16_t> dwb(2 * 128 * 128);
  expect_error_naming(
      [&] {
        eng.run(wp.problem(ExpertMatrices::grouped(TensorView(dwb.get(), DType::kFP16, {2, 128, 128}), "dw"), false),
                stream);
      },
      "'dw'");
  // Tokens (the columns of the columnwise copies) not a multiple of 16.
  DeviceBuffer<float> dwf(2 * 128 * 128);
  GemmProblem w = wp.problem(ExpertMatrices::grouped(TensorView(dwf.get(), DType::kFP32, {2, 128, 128}), "dw"), false);
  w.a = TensorView(wp.dy.cdata.get(), DType::kFP8E4M3, {128, 120});
  w.b = TensorView(wp.x.cdata.get(), DType::kFP8E4M3, {128, 120});
  expect_error_naming([&] { eng.run(w, stream); }, "'dy'");
  // A 192-wide configuration forced on an engine built without the weight-dim bound (no room for
  // its restated weight scales), and on one whose bound is below the weights' dims.
  for (int64_t bound : {0, 128}) {
    GroupedGemm gg(2, p.R, 0, bound);
    DeviceBuffer<uint8_t> ws(gg.workspace_bytes());
    gg.force_config(GemmOp::kFprop, "fp8_coop_128x192x128_c2x1");
    expect_error_naming(
        [&] { gg.run(p.fprop(yv), TensorView(ws.get(), DType::kUInt8, {int64_t(ws.size())}), stream); },
        "max_weight_dim");
  }
}

}  // namespace
}  // namespace moe
