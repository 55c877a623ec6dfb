// Quantize / dequantize bandwidth of every format: GB/s of each call on bf16 matrices beside the
// device-to-device copy bandwidth of the same GPU measured in the same run (target >= 85% of it).
//
// usage: bench_quantize [MxK ...] [--repeats N]     (default: 16384x7168 65536x2048)
//
// Bytes that must move per call (x bf16 [M, K]; data 1 byte (FP8) or 1/2 byte (FP4) per element;
// scales: 4 bytes per 128 (FP8 block), 1 per 32 (MXFP8), 1 per 16 (NVFP4) elements per copy):
//   quantize rowwise                 read 2MK + write data + scales
//   quantize rowwise + columnwise    read 2MK + write both copies (one read of x: the fused kernel)
//   NVFP4 adds one more read of x (2MK) for the global amax pass
//   fp32 x (FP8 block 128x128, master weights): read 4MK instead of 2MK
//   dequantize (one copy, bf16 out)  read data + scales + write 2MK
//   fake quantize (the emulated experts' token operands, 8 equal expert groups, rowwise or
//   columnwise blocks)               read 2MK + write 2MK (NVFP4: + 2MK, the groups' amax pass)
// Times: median of CUDA-event-timed replays of a CUDA graph holding one call (the NVFP4 graph
// holds the global amax memset and pass too). "% copy" is GB/s over the device-to-device copy
// bandwidth (bytes read + written) measured at the start of the same run.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "moe/quantize.h"
#include "quant/fake_quantize.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"

namespace {

using namespace moe;

struct Variant {
  const char* name;
  QuantConfig config;
  bool fp32_input = false;  // fp32 x (master weights into FP8 block 128x128)
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  auto make = [](QuantFormat f, QuantBlocking b, bool col, ScaleLayout layout = ScaleLayout::kRowMajor,
                 bool sr = false) {
    QuantConfig c;
    c.format = f;
    c.blocking = b;
    c.rowwise = true;
    c.columnwise = col;
    c.scale_layout = layout;
    c.stochastic_rounding = sr;
    return c;
  };
  using QF = QuantFormat;
  using QB = QuantBlocking;
  v.push_back({"fp8_block 1x128 row", make(QF::kFP8Block, QB::k1D, false)});
  v.push_back({"fp8_block 1x128 row+col", make(QF::kFP8Block, QB::k1D, true, ScaleLayout::kMNMajor)});
  v.push_back({"fp8_block 1x128 row+col rm/mn", make(QF::kFP8Block, QB::k1D, true)});
  v.back().config.columnwise_scale_layout = ScaleLayout::kMNMajor;  // what the FP8 experts write
  v.push_back({"fp8_block 128x128 row+col", make(QF::kFP8Block, QB::k2D, true)});
  v.push_back({"fp8_block 128x128 fp32 in", make(QF::kFP8Block, QB::k2D, true), true});
  v.push_back({"mxfp8 row", make(QF::kMXFP8, QB::k1D, false)});
  v.push_back({"mxfp8 row+col swizzled", make(QF::kMXFP8, QB::k1D, true, ScaleLayout::kSwizzled128x4)});
  v.push_back({"nvfp4 row", make(QF::kNVFP4, QB::k1D, false)});
  v.push_back({"nvfp4 row+col swizzled", make(QF::kNVFP4, QB::k1D, true, ScaleLayout::kSwizzled128x4)});
  v.push_back({"nvfp4 row+col SR", make(QF::kNVFP4, QB::k1D, true, ScaleLayout::kRowMajor, true)});
  v.push_back({"nvfp4 16x16 row+col", make(QF::kNVFP4, QB::k2D, true)});
  return v;
}

double scale_bytes(const QuantConfig& c, int64_t rows, int64_t cols, bool columnwise = false) {
  const ScaleShape s = scale_shape(c, rows, cols, columnwise);
  return static_cast<double>(s.rows * s.cols) * (s.dtype == DType::kFP32 ? 4 : 1);
}

}  // namespace

// Untimed replays before each series (with 5, the first dequantize series of a run read 10% slow).
constexpr int kWarmup = 20;

int main(int argc, char** argv) {
  CLI::App app{"Quantize / dequantize GB/s of every format on bf16 matrices, beside the copy bandwidth"};
  std::vector<std::string> shape_args;
  int repeats = 20;
  const CLI::Validator mxk(
      [](std::string& a) {
        return a.find('x') == std::string::npos ? "bad shape '" + a + "' (expected MxK)" : std::string();
      },
      "MxK");
  app.add_option("MxK", shape_args, "matrix shapes, e.g. 16384x7168 (default: 16384x7168 65536x2048)")->check(mxk);
  app.add_option("--repeats", repeats, "timed graph replays per measurement (median reported)")
      ->transform(moe::cli::decimal_integer());
  CLI11_PARSE(app, argc, argv);
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const std::string& a : shape_args) {
    const size_t xpos = a.find('x');
    shapes.push_back({std::atoll(a.substr(0, xpos).c_str()), std::atoll(a.substr(xpos + 1).c_str())});
  }
  if (shapes.empty()) shapes = {{16384, 7168}, {65536, 2048}};

  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbs = bench::copy_bandwidth_gbs(stream);
  std::printf("device: %s\n", bench::device_description().c_str());
  std::printf("device-to-device copy bandwidth (read + write): %.0f GB/s\n\n", copy_gbs);
  std::printf("%-12s %-28s %-11s %10s %10s %10s %8s\n", "shape", "variant", "op", "MB moved", "time us", "GB/s",
              "% copy");

  for (const auto& [M, K] : shapes) {
    const size_t xb = static_cast<size_t>(M * K) * 4;  // fp32 or bf16 x
    void *x, *rd, *rs, *cd, *cs, *out;
    float* amax;
    MOE_CUDA_CHECK(cudaMalloc(&x, xb));
    MOE_CUDA_CHECK(cudaMalloc(&out, xb / 2));
    MOE_CUDA_CHECK(cudaMalloc(&rd, static_cast<size_t>(M * K)));
    MOE_CUDA_CHECK(cudaMalloc(&cd, static_cast<size_t>(M * K)));
    MOE_CUDA_CHECK(cudaMalloc(&rs, static_cast<size_t>(M * K) / 8 + (1 << 20)));  // >= any scale tensor
    MOE_CUDA_CHECK(cudaMalloc(&cs, static_cast<size_t>(M * K) / 8 + (1 << 20)));
    MOE_CUDA_CHECK(cudaMalloc(&amax, sizeof(float)));
    MOE_CUDA_CHECK(cudaMemset(x, 0x3c, xb));  // bf16 0x3c3c ~ 0.0115, fp32 0x3c3c3c3c ~ 0.0115: finite, non-zero
    // First touch of every output outside the timings (the first variant would pay it otherwise).
    MOE_CUDA_CHECK(cudaMemset(out, 0, xb / 2));
    for (void* buf : {rd, cd}) MOE_CUDA_CHECK(cudaMemset(buf, 0, static_cast<size_t>(M * K)));
    for (void* buf : {rs, cs}) MOE_CUDA_CHECK(cudaMemset(buf, 0, static_cast<size_t>(M * K) / 8 + (1 << 20)));
    const std::string shape_name = std::to_string(M) + "x" + std::to_string(K);
    for (const Variant& v : variants()) {
      const QuantConfig& c = v.config;
      const DType dt = c.format == QuantFormat::kNVFP4 ? DType::kFP4E2M1 : DType::kFP8E4M3;
      QuantizedTensor q;
      const ScaleShape srow = scale_shape(c, M, K), scol = scale_shape(c, K, M, true);
      q.rowwise_data = TensorView(rd, dt, {M, K});
      q.rowwise_scale = TensorView(rs, srow.dtype, {srow.rows, srow.cols});
      if (c.columnwise) {
        q.columnwise_data = TensorView(cd, dt, {K, M});
        q.columnwise_scale = TensorView(cs, scol.dtype, {scol.rows, scol.cols});
      }
      if (c.format == QuantFormat::kNVFP4) q.global_amax = TensorView(amax, DType::kFP32, {1});
      const double data_bytes = static_cast<double>(M * K) * (c.format == QuantFormat::kNVFP4 ? 0.5 : 1.0);
      const int copies = c.columnwise ? 2 : 1;
      const double x_bytes = (v.fp32_input ? 4.0 : 2.0) * M * K;
      double qbytes = x_bytes + copies * data_bytes + scale_bytes(c, M, K) + (c.columnwise ? scale_bytes(c, K, M, true) : 0);
      if (c.format == QuantFormat::kNVFP4) qbytes += 2.0 * M * K;  // the global amax pass
      const TensorView vx(x, v.fp32_input ? DType::kFP32 : DType::kBF16, {M, K});
      const bench::Timing tq =
          bench::time_cuda_graph([&] { quantize(c, vx, q, stream); }, stream, kWarmup, repeats);
      const double qgbs = qbytes / (tq.median_ms * 1e-3) / 1e9;
      std::printf("%-12s %-28s %-11s %10.1f %10.1f %10.0f %7.1f%%\n", shape_name.c_str(), v.name, "quantize",
                  qbytes / 1e6, tq.median_ms * 1e3, qgbs, 100.0 * qgbs / copy_gbs);
      const double dbytes = data_bytes + scale_bytes(c, M, K) + 2.0 * M * K;
      const TensorView vout(out, DType::kBF16, {M, K});
      const bench::Timing td =
          bench::time_cuda_graph([&] { dequantize(c, q, false, vout, stream); }, stream, kWarmup, repeats);
      const double dgbs = dbytes / (td.median_ms * 1e-3) / 1e9;
      std::printf("%-12s %-28s %-11s %10.1f %10.1f %10.0f %7.1f%%\n", shape_name.c_str(), v.name, "dequantize",
                  dbytes / 1e6, td.median_ms * 1e3, dgbs, 100.0 * dgbs / copy_gbs);
      std::fflush(stdout);
    }
    // Quantize-dequantize of token operands in expert groups (the emulated MXFP8 / NVFP4 experts).
    constexpr int kGroups = 8;
    std::vector<int32_t> offsets(kGroups + 1);
    for (int e = 0; e <= kGroups; ++e) offsets[e] = static_cast<int32_t>(M * e / kGroups);
    int32_t* doffsets;
    void* ws;
    MOE_CUDA_CHECK(cudaMalloc(&doffsets, offsets.size() * sizeof(int32_t)));
    MOE_CUDA_CHECK(cudaMemcpy(doffsets, offsets.data(), offsets.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMalloc(&ws, quant::fake_quantize_workspace_bytes(kGroups)));
    for (const QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4})
      for (const bool columnwise : {false, true}) {
        QuantConfig c;
        c.format = f;
        const double bytes = 4.0 * M * K + (f == QuantFormat::kNVFP4 ? 2.0 * M * K : 0.0);
        const TensorView vx(x, DType::kBF16, {M, K}), vout(out, DType::kBF16, {M, K});
        const TensorView voff(doffsets, DType::kInt32, {kGroups + 1});
        const bench::Timing t = bench::time_cuda_graph(
            [&] { quant::fake_quantize_groups(c, columnwise, vx, voff, vout, ws, stream); }, stream, kWarmup, repeats);
        const double gbs = bytes / (t.median_ms * 1e-3) / 1e9;
        const std::string name = std::string(quant_format_name(f)) + " 8 groups " + (columnwise ? "col" : "row");
        std::printf("%-12s %-28s %-11s %10.1f %10.1f %10.0f %7.1f%%\n", shape_name.c_str(), name.c_str(), "fake quant",
                    bytes / 1e6, t.median_ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
        std::fflush(stdout);
      }
    for (void* p : {x, out, rd, cd, rs, cs, static_cast<void*>(amax), static_cast<void*>(doffsets), ws}) cudaFree(p);
  }
  cudaStreamDestroy(stream);
  return 0;
}
