// Fused kernel benchmark: TFLOP/s of the layer's three fused kernels (docs/fused.md) on the named
// shapes, each beside one cuBLAS dense GEMM of the same size, timed in the same interleaved rounds
// (support/interleaved_timing.h):
//   - fc1: the fused fc1 -- x rows gathered through the row map, fc1, activation x prob -- writing h
//     and act (dense: [R, H] x [H, 2F]);
//   - fc2-dgrad: the fused fc2 dgrad -- dy rows gathered, fc2 dgrad, activation backward, dprobs and
//     the recomputed act for fc2's weight gradient -- in its ping-pong and cooperative schedules and
//     as the layer picks (dense: [R, H] x [H, F]);
//   - wgrad-fc1 / wgrad-fc2: the gathered weight gradients, dW1_e = dh_e^T x_e (x gathered) and
//     dW2_e = dY_e^T act_e (dy gathered), written in bf16 and added into an fp32 main_grad (dense:
//     the same output with the reduction over all R rows).
// Each called as the layer calls it (swiglu, probs in the activation, no bias, no padding rows), which
// by default takes these kernels where F <= 2048 (every named shape but mixtral-8x7b). The
// routing is make_topk_routing's (docs/shapes.md, Routing), balanced and skewed; rows are ordered
// as the dispatcher orders them (by expert, then by slot). TFLOP/s = 2 R N K / time, R = T k.
//
// The fc2 dgrad writes dh over h, so each of its calls first restores h from a copy (else h would
// grow from call to call, and the power the tensor cores draw, hence the clock, depends on the
// data); the copy alone is timed in the same rounds and subtracted from those calls.
//
// Figures only: the kernels' results are checked by the GPU tests (gpu_test_grouped_mlp,
// gpu_test_fc2_dgrad_schedules, gpu_test_wgrad_gathered), not here.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "device/cuda_check.h"
#include "fused/fc1_activation.h"
#include "fused/fc2_dgrad_activation.h"
#include "fused/wgrad_gathered.h"
#include "moe/activation.h"
#include "reference/routing_gen.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"
#include "support/dense_gemm.h"
#include "support/interleaved_timing.h"

namespace {

using moe::bench::Candidate;
using moe::bench::DeviceMem;
using moe::bench::tflops;

// The dispatcher's row map of a top-k routing: rows grouped by expert, slots in order within each.
struct RowMap {
  std::vector<int32_t> row_slots;  // [R]: the slot t * k + j of each row
  std::vector<int32_t> offsets;    // [E + 1]
  std::vector<float> probs;        // [R]: the prob of each row's slot
  double busiest = 0;              // rows of the busiest expert over the mean
};

RowMap make_row_map(const moe::bench::Shape& s, double skew) {
  const moe::ref::Routing r = moe::ref::make_topk_routing(s.T, s.E, s.k, /*seed=*/1234, skew);
  std::vector<std::vector<int32_t>> per_expert(s.E);
  for (size_t i = 0; i < r.indices.size(); ++i)
    if (r.indices[i] >= 0) per_expert[r.indices[i]].push_back(int32_t(i));
  RowMap m;
  m.offsets.push_back(0);
  size_t most = 0;
  for (const auto& rows : per_expert) {
    for (int32_t slot : rows) {
      m.row_slots.push_back(slot);
      m.probs.push_back(float(r.probs[slot]));
    }
    m.offsets.push_back(int32_t(m.row_slots.size()));
    most = std::max(most, rows.size());
  }
  m.busiest = m.row_slots.empty() ? 0.0 : double(most) * s.E / double(m.row_slots.size());
  return m;
}

// On the benchmark's stream (a non-blocking one, which a plain cudaMemcpy would not order before the
// kernels), finished before returning.
template <typename T>
void upload(const DeviceMem& d, const std::vector<T>& h, cudaStream_t stream) {
  MOE_CUDA_CHECK(cudaMemcpyAsync(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

bool wanted(const std::vector<std::string>& list, const std::string& item) {
  return list.empty() || std::find(list.begin(), list.end(), item) != list.end();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The fused kernels' TFLOP/s on the named shapes, beside cuBLAS dense GEMMs of the same size"};
  std::vector<std::string> shapes, kernels, routings;
  int rounds = 9;
  double skew = 1.0;
  app.add_option("--shape", shapes, "named shapes or T,H,F,E,k (default: every named shape)");
  app.add_option("--kernel", kernels, "only these kernels: fc1, fc2-dgrad, wgrad-fc1, wgrad-fc2 (default: all)")
      ->check(CLI::IsMember({"fc1", "fc2-dgrad", "wgrad-fc1", "wgrad-fc2"}));
  app.add_option("--routing", routings, "only these routings: balanced, skewed (default: both)")
      ->check(CLI::IsMember({"balanced", "skewed"}));
  app.add_option("--skew", skew, "Zipf-like skew of the skewed routing");
  app.add_option("--rounds", rounds, "interleaved timing rounds per measurement (median reported)")
      ->transform(moe::cli::decimal_integer())
      ->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  shapes = moe::bench::shape_args_or_all(std::move(shapes));

  const moe::bench::CublasOnStream on_stream;
  cudaStream_t stream = on_stream.stream;
  cublasHandle_t blas = on_stream.blas;
  int device = 0, sm_count = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  std::printf("device: %s\n", moe::bench::device_description().c_str());
  std::printf("TFLOP/s = 2*R*N*K / median time, R = T*k (no padding rows); busiest = the busiest expert's rows / mean\n");
  std::printf("%-18s %-8s %7s %-10s %6s %6s %8s %8s  %s\n", "shape", "routing", "busiest", "kernel", "N", "K",
              "ours", "cublas", "details");

  moe::ActivationParams swiglu;  // the named shapes' activation
  for (const std::string& name : shapes) {
    const moe::bench::Shape s = moe::bench::parse_shape(name);
    const int64_t T = s.T, H = s.H, F = s.F, E = s.E, R = s.T * s.k, F1 = 2 * s.F;
    const std::vector<std::string> unsupported = {moe::fused::fc1_activation_unsupported(s.E, H, F, swiglu),
                                                  moe::fused::fc2_dgrad_activation_unsupported(s.E, H, F, swiglu),
                                                  moe::fused::wgrad_gathered_unsupported(s.E, F1, H),
                                                  moe::fused::wgrad_gathered_unsupported(s.E, F, H)};
    for (const std::string& why : unsupported) MOE_CHECK(why.empty(), "shape ", s.name, ": ", why);
    // Operands (bf16 unless noted). x, dy: the caller's [T, H]; h [R, 2F] (and the copy that
    // restores it), act [R, F]; weights [E, 2F, H] and [E, H, F]; gradients bf16 and fp32.
    DeviceMem x(T * H * 2), dy(T * H * 2), h(R * F1 * 2), h_saved(R * F1 * 2), act(R * F * 2);
    DeviceMem w1(E * F1 * H * 2), w2(E * H * F * 2), dw1(E * F1 * H * 2), dw2(E * H * F * 2);
    DeviceMem mg1(E * F1 * H * 4), mg2(E * H * F * 4);
    DeviceMem x_perm(R * H * 2), dy_perm(R * H * 2), dense_out(std::max(R * F1, F1 * H) * 2);
    DeviceMem slots_d(R * 4), offsets_d((E + 1) * 4), probs_d(R * 4), dprobs(R * 4);
    const int feature_blocks = moe::fused::fc2_dgrad_feature_blocks(F);
    DeviceMem dprobs_partial(int64_t(feature_blocks) * R * 4);
    DeviceMem tile_counter(4);  // the gathered weight gradients' tile queue: zero, and left zero
    MOE_CUDA_CHECK(cudaMemset(tile_counter.p, 0, 4));
    moe::bench::fill_bf16_uniform(x.p, T * H, 1, stream);
    moe::bench::fill_bf16_uniform(dy.p, T * H, 2, stream);
    moe::bench::fill_bf16_uniform(w1.p, E * F1 * H, 3, stream);
    moe::bench::fill_bf16_uniform(w2.p, E * H * F, 4, stream);
    moe::bench::fill_bf16_uniform(h_saved.p, R * F1, 5, stream);
    moe::bench::fill_bf16_uniform(act.p, R * F, 6, stream);
    moe::bench::fill_bf16_uniform(x_perm.p, R * H, 7, stream);
    moe::bench::fill_bf16_uniform(dy_perm.p, R * H, 8, stream);
    MOE_CUDA_CHECK(cudaMemsetAsync(mg1.p, 0, E * F1 * H * 4, stream));
    MOE_CUDA_CHECK(cudaMemsetAsync(mg2.p, 0, E * H * F * 4, stream));

    for (const auto& routing_skew : {std::pair<const char*, double>{"balanced", 0.0}, {"skewed", skew}}) {
      const char* routing = routing_skew.first;
      const double sk = routing_skew.second;
      if (!wanted(routings, routing)) continue;
      const RowMap m = make_row_map(s, sk);
      upload(slots_d, m.row_slots, stream);
      upload(offsets_d, m.offsets, stream);
      upload(probs_d, m.probs, stream);
      MOE_CUDA_CHECK(cudaMemcpyAsync(h.p, h_saved.p, R * F1 * 2, cudaMemcpyDeviceToDevice, stream));

      const auto row = [&](const char* kernel, int64_t N, int64_t K, double ours_ms, double dense_ms,
                           const std::string& details) {
        const double flops = 2.0 * double(R) * double(N) * double(K);
        // The layer takes the unfused path by default where F > 2048 (docs/fused.md).
        const char* note = F > 2048 ? " [the layer's default here: unfused]" : "";
        std::printf("%-18s %-8s %7.2f %-10s %6lld %6lld %8.1f %8.1f  %s%s\n", s.name, routing, m.busiest, kernel,
                    (long long)N, (long long)K, tflops(flops, ours_ms), tflops(flops, dense_ms), details.c_str(),
                    note);
        std::fflush(stdout);
      };

      // The arguments both row kernels share: the row map, the sizes, the probs, the activation.
      const auto row_kernel_args = [&](auto& f) {
        f.row_slots = slots_d.as<const int32_t>();
        f.slots = s.k;
        f.group_offsets = offsets_d.as<const int32_t>();
        f.experts = s.E;
        f.R = R;
        f.H = int(H);
        f.F = int(F);
        f.probs = probs_d.as<const float>();
        f.activation = swiglu;
        f.sm_count = sm_count;
      };

      if (wanted(kernels, "fc1")) {
        moe::fused::Fc1ActivationArgs f;
        row_kernel_args(f);
        f.a = x.p;
        f.w1_base = w1.p;
        f.w1_stride_bytes = F1 * H * 2;
        f.h = h.p;
        f.act = act.p;
        const std::vector<double> ms = moe::bench::interleaved_ms(
            {{"fused", [&] { moe::fused::launch_fc1_activation(f, stream); }},
             {"cublas", [&] { moe::bench::dense_gemm(blas, x_perm.p, w1.p, dense_out.p, R, F1, H, false, true); }}},
            stream, rounds);
        row("fc1", F1, H, ms[0], ms[1], "");
      }

      if (wanted(kernels, "fc2-dgrad")) {
        moe::fused::Fc2DgradActivationArgs f;
        row_kernel_args(f);
        f.dy = dy.p;
        f.w2 = w2.p;
        f.h = h.p;
        f.act_out = act.p;
        f.dprobs = dprobs.as<float>();
        f.dprobs_partial = feature_blocks > 1 ? dprobs_partial.as<float>() : nullptr;
        const auto restore = [&] {
          MOE_CUDA_CHECK(cudaMemcpyAsync(h.p, h_saved.p, R * F1 * 2, cudaMemcpyDeviceToDevice, stream));
        };
        const auto with = [&](moe::fused::Fc2DgradSchedule schedule) {
          return [&, schedule] {
            restore();
            moe::fused::Fc2DgradActivationArgs a = f;
            a.schedule = schedule;
            moe::fused::launch_fc2_dgrad_activation(a, stream);
          };
        };
        using moe::fused::Fc2DgradSchedule;
        const std::vector<double> ms = moe::bench::interleaved_ms(
            {{"auto", with(Fc2DgradSchedule::kAuto)},
             {"ping-pong", with(Fc2DgradSchedule::kPingPong)},
             {"cooperative", with(Fc2DgradSchedule::kCooperative)},
             {"restore", restore},
             {"cublas", [&] { moe::bench::dense_gemm(blas, dy_perm.p, w2.p, dense_out.p, R, F, H, false, false); }}},
            stream, rounds);
        const double flops = 2.0 * double(R) * double(H) * double(F);
        char details[160];
        std::snprintf(details, sizeof details, "ping-pong=%.0f cooperative=%.0f (restoring h: %.3f ms a call)",
                      tflops(flops, ms[1] - ms[3]), tflops(flops, ms[2] - ms[3]), ms[3]);
        row("fc2-dgrad", H, F, ms[0] - ms[3], ms[4], details);
      }

      // The weight gradients, written in bf16 and added into fp32 main_grad. fc1: dW1_e [2F, H] =
      // dh_e^T x_e, with h (holding dh after the fc2 dgrad, or its initial values) in the dY role.
      // fc2: dW2_e [H, F] = dY_e^T act_e, stored transposed from act^T dY with dy gathered.
      for (int fc = 1; fc <= 2; ++fc) {
        const std::string kernel = "wgrad-fc" + std::to_string(fc);
        if (!wanted(kernels, kernel)) continue;
        moe::fused::WgradGatheredArgs a;
        a.dy = fc == 1 ? h.p : act.p;
        a.x = fc == 1 ? x.p : dy.p;
        a.row_slots = slots_d.as<const int32_t>();
        a.slots = s.k;
        a.group_offsets = offsets_d.as<const int32_t>();
        a.experts = s.E;
        a.R = R;
        a.M = int(fc == 1 ? F1 : F);
        a.N = int(H);
        a.x_major = fc == 2;
        a.sm_count = sm_count;
        a.tile_counter = tile_counter.as<int>();
        moe::fused::WgradGatheredArgs acc = a;
        a.dw_base = fc == 1 ? dw1.p : dw2.p;
        a.dw_stride_bytes = int64_t(a.M) * H * 2;
        acc.dw_base = fc == 1 ? mg1.p : mg2.p;
        acc.dw_stride_bytes = int64_t(a.M) * H * 4;
        acc.dw_fp32 = acc.accumulate = true;
        // Dense: the output [M, H] (fc1) or [H, F] (fc2) with the reduction over all R rows.
        const std::function<void()> dense =
            fc == 1 ? std::function<void()>([&] {
              moe::bench::dense_gemm(blas, h.p, x_perm.p, dense_out.p, F1, H, R, true, false);
            })
                    : std::function<void()>([&] {
                        moe::bench::dense_gemm(blas, dy_perm.p, act.p, dense_out.p, H, F, R, true, false);
                      });
        // The schedule the kernel picks from the routing, beside both forced ones (bf16 written).
        moe::fused::WgradGatheredArgs stride = a, queue = a;
        stride.schedule = moe::fused::WgradSchedule::kStride;
        queue.schedule = moe::fused::WgradSchedule::kQueue;
        const std::vector<double> ms = moe::bench::interleaved_ms(
            {{"written", [&] { moe::fused::launch_wgrad_gathered(a, stream); }},
             {"main_grad", [&] { moe::fused::launch_wgrad_gathered(acc, stream); }},
             {"cublas", dense},
             {"stride", [&] { moe::fused::launch_wgrad_gathered(stride, stream); }},
             {"queue", [&] { moe::fused::launch_wgrad_gathered(queue, stream); }}},
            stream, rounds);
        const double flops = 2.0 * double(R) * double(a.M) * double(H);
        char details[128];
        std::snprintf(details, sizeof details, "bf16 written; into fp32 main_grad %.0f; stride %.0f, queue %.0f",
                      tflops(flops, ms[1]), tflops(flops, ms[3]), tflops(flops, ms[4]));
        // N, K as bench_grouped_gemm names the product: fc1 (2F, H), fc2 (H, F).
        row(kernel.c_str(), fc == 1 ? F1 : H, fc == 1 ? H : F, ms[0], ms[2], details);
      }
    }
  }
  return 0;
}
