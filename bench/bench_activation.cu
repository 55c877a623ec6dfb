// Activation x prob bandwidth (the unfused activation + prob kernels; docs/shapes.md): GB/s of the
// forward and backward swiglu-with-probs kernels on R = T*k rows of each named shape, beside the
// device-to-device copy bandwidth measured in the same run. Target: >= 85% of the copy bandwidth.
// The per-expert bias kernels of the layer (fc2 bias, H columns) are timed too, for reference.
//
// usage: bench_activation [--shape NAME ...] [--repeats N]     (default: every named shape)
//
// Bytes that must move (bf16 = 2 bytes, fp32 probs / dprobs = 4 bytes per row):
//   forward   read h [R, 2F], probs; write out [R, F]                      R * (4F + 2F + 4)
//   backward  read h [R, 2F], d_out [R, F], probs; write dh [R, 2F], dprobs  R * (4F + 2F + 4 + 4F + 4)
//   bias_add  read + write y [R, H], read probs                             R * (4H + 4)
//   bias_grad read dy [R, H] and probs (partials and bias rows are small)    R * (2H + 4)
//   dprobs    read dy [R, H]; write dprobs                                  R * (2H + 4)
// Rows are split evenly over the E experts (group_offsets on the device, as the layer passes them).
// Times: median of CUDA-event-timed CUDA-graph replays of one call (the headline), eager beside it.
#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "device/cuda_check.h"
#include "moe/activation_ops.h"
#include "moe/bias_ops.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"

namespace {

// Deterministic pseudo-random bf16 in [-3, 3) (a hash of the index: no host round trip).
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(6.0f * (x & 0xFFFFFF) / 16777216.0f - 3.0f);
  }
}

__global__ void fill_f32(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

template <typename T>
T* alloc(int64_t n) {
  void* p = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&p, sizeof(T) * static_cast<size_t>(n)));
  return static_cast<T*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Activation x prob and bias kernels: GB/s on the named shapes beside the copy bandwidth"};
  std::vector<std::string> shapes;
  int repeats = 30;
  app.add_option("--shape", shapes, "named shapes (default: all)");
  app.add_option("--repeats", repeats, "timed repeats per measurement (median reported)")
      ->transform(moe::cli::decimal_integer());
  CLI11_PARSE(app, argc, argv);
  shapes = moe::bench::shape_args_or_all(std::move(shapes));

  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbs = moe::bench::copy_bandwidth_gbs(stream);
  std::printf("device: %s\n", moe::bench::device_description().c_str());
  std::printf("copy bandwidth (device-to-device, read + write): %.0f GB/s\n", copy_gbs);
  std::printf("%-18s %-14s %8s %6s %9s %9s %9s %9s %7s\n", "shape", "kernel", "rows", "cols", "graph_ms", "eager_ms",
              "GB/s", "eager", "%copy");

  for (const std::string& name : shapes) {
    const moe::bench::Shape& s = moe::bench::shape_by_name(name);
    const int64_t R = s.T * s.k, F = s.F, H = s.H;
    const int E = s.E;
    auto* h = alloc<__nv_bfloat16>(R * 2 * F);
    auto* out = alloc<__nv_bfloat16>(R * F);
    auto* d_out = alloc<__nv_bfloat16>(R * F);
    auto* dh = alloc<__nv_bfloat16>(R * 2 * F);
    auto* y = alloc<__nv_bfloat16>(R * H);
    auto* bias = alloc<__nv_bfloat16>(E * H);
    auto* probs = alloc<float>(R);
    auto* dprobs = alloc<float>(R);
    auto* grad = alloc<float>(E * H);
    const size_t ws_bytes = moe::bias_grad_workspace_bytes(R, E, H);
    auto* ws = alloc<uint8_t>(static_cast<int64_t>(ws_bytes));
    std::vector<int32_t> off(E + 1);
    for (int e = 0; e <= E; ++e) off[e] = static_cast<int32_t>(R * e / E);
    auto* d_off = alloc<int32_t>(E + 1);
    MOE_CUDA_CHECK(cudaMemcpy(d_off, off.data(), sizeof(int32_t) * off.size(), cudaMemcpyHostToDevice));
    fill_bf16<<<1024, 256, 0, stream>>>(h, R * 2 * F, 1);
    fill_bf16<<<1024, 256, 0, stream>>>(d_out, R * F, 2);
    fill_bf16<<<1024, 256, 0, stream>>>(y, R * H, 3);
    fill_bf16<<<1024, 256, 0, stream>>>(bias, E * H, 4);
    fill_f32<<<1024, 256, 0, stream>>>(probs, R, 0.25f);
    MOE_CUDA_CHECK_LAUNCH();
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    using moe::DType;
    using moe::TensorView;
    moe::ActivationParams swiglu;  // swiglu, no interleave
    TensorView vh(h, DType::kBF16, {R, 2 * F}), vout(out, DType::kBF16, {R, F}), vdout(d_out, DType::kBF16, {R, F});
    TensorView vdh(dh, DType::kBF16, {R, 2 * F}), vp(probs, DType::kFP32, {R}), vdp(dprobs, DType::kFP32, {R});
    TensorView voff(d_off, DType::kInt32, {E + 1}), vy(y, DType::kBF16, {R, H});
    TensorView vws(ws, DType::kUInt8, {static_cast<int64_t>(ws_bytes)});
    const moe::ExpertRows vbias = moe::ExpertRows::single_grouped(TensorView(bias, DType::kBF16, {E, H}));
    const moe::ExpertRows vgrad = moe::ExpertRows::single_grouped(TensorView(grad, DType::kFP32, {E, H}));

    struct Op {
      const char* kernel;
      int64_t cols;
      double bytes;
      std::function<void()> fn;
    };
    const double r = static_cast<double>(R);
    std::vector<Op> ops = {
        {"act_fwd", F, r * (4.0 * F + 2.0 * F + 4),
         [&] { moe::activation_forward(swiglu, vh, vp, voff, vout, stream); }},
        {"act_bwd", F, r * (4.0 * F + 2.0 * F + 4 + 4.0 * F + 4),
         [&] { moe::activation_backward(swiglu, vh, vp, vdout, voff, vdh, vdp, stream); }},
        {"bias_add", H, r * (4.0 * H + 4), [&] { moe::bias_add(vy, vbias, vp, voff, stream); }},
        {"bias_grad", H, r * (2.0 * H + 4),
         [&] { moe::bias_grad(vy, vp, voff, vgrad, false, vws, stream); }},
        {"bias_dprobs", H, r * (2.0 * H + 4),
         [&] { moe::bias_dprobs(vy, vbias, voff, vdp, false, stream); }},
    };
    // >= 50 ms of back-to-back launches first: after the host-side allocations the GPU has idled and
    // its clocks need to ramp up (a few launches of warm-up were not enough on the H100).
    auto warm = [&](const std::function<void()>& fn) {
      const auto t0 = std::chrono::steady_clock::now();
      do {
        for (int i = 0; i < 10; ++i) fn();
        MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      } while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50));
    };
    for (const Op& op : ops) {
      warm(op.fn);
      moe::bench::Timing g = moe::bench::time_cuda_graph(op.fn, stream, 5, repeats);
      warm(op.fn);
      moe::bench::Timing e = moe::bench::time_cuda(op.fn, stream, 5, repeats);
      const double gbs = op.bytes / (g.median_ms * 1e-3) / 1e9, egbs = op.bytes / (e.median_ms * 1e-3) / 1e9;
      std::printf("%-18s %-14s %8lld %6lld %9.4f %9.4f %9.0f %9.0f %6.1f%%   (graph min %.4f max %.4f ms)\n",
                  s.name, op.kernel, static_cast<long long>(R), static_cast<long long>(op.cols), g.median_ms,
                  e.median_ms, gbs, egbs, 100.0 * gbs / copy_gbs, g.min_ms, g.max_ms);
    }
    std::fflush(stdout);
    for (void* p : {static_cast<void*>(h), static_cast<void*>(out), static_cast<void*>(d_out), static_cast<void*>(dh),
                    static_cast<void*>(y), static_cast<void*>(bias), static_cast<void*>(probs),
                    static_cast<void*>(dprobs), static_cast<void*>(grad), static_cast<void*>(ws),
                    static_cast<void*>(d_off)})
      MOE_CUDA_CHECK(cudaFree(p));
  }
  std::printf("copy bandwidth again at the end: %.0f GB/s\n", moe::bench::copy_bandwidth_gbs(stream));
  return 0;
}
