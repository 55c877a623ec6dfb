// Token dispatch bandwidth (permute + pad, unpermute + unpad; docs/shapes.md): GB/s of each
// dispatch kernel on the named shapes, bf16 rows, beside the device-to-device copy bandwidth of the
// same GPU measured in the same run. Target: >= 85% of the copy bandwidth.
//
// usage: bench_dispatch [SHAPE ...] [--repeats N]     (default: every named shape)
//
// Bytes that must move (b = 2 bytes per bf16 element, N = rows routed (T*k here: no bad input),
// S = sum(padded) = rows of all experts including their pad rows; probs, row maps and the routing
// are small and not counted):
//   permute            read x once per routed row + write every expert row:  (N + S) * H * b
//   unpermute (merge)  read each routed row of Y + write y:                   (N + T) * H * b
//   permute backward   read each routed row of d_x_perm + write dx:           (N + T) * H * b
//   unpermute backward read dy once per routed row + read Y's routed rows (for dprobs) + write
//                      every expert row of dY:                                (2N + S) * H * b
// Rows of x_perm / dY past sum(padded) up to the static bound R are zeroed too but not counted.
// Times: median of CUDA-event-timed replays of a CUDA graph holding one call (the headline, how
// the layer runs), and the eager median beside it.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "moe/dispatch.h"
#include "moe/error_word.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"

namespace {

using namespace moe;

struct Row {
  std::string shape, routing, kernel;
  double bytes, graph_ms, eager_ms;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Token dispatch kernels: GB/s on the named shapes beside the copy bandwidth"};
  std::vector<std::string> names;
  int repeats = 20;
  app.add_option("SHAPE", names, "named shapes (default: every named shape)");
  app.add_option("--repeats", repeats, "timed repeats per measurement (median reported)")
      ->transform(moe::cli::decimal_integer());
  CLI11_PARSE(app, argc, argv);
  std::vector<bench::Shape> shapes;
  if (names.empty())
    shapes = bench::named_shapes();
  else
    for (const auto& n : names) shapes.push_back(bench::shape_by_name(n));

  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbs = bench::copy_bandwidth_gbs(stream);
  std::printf("device: %s\n", bench::device_description().c_str());
  std::printf("device-to-device copy bandwidth (read + write): %.0f GB/s\n\n", copy_gbs);
  std::printf("%-18s %-9s %-22s %10s %10s %10s %8s\n", "shape", "routing", "kernel", "graph us", "graph GB/s",
              "eager GB/s", "% copy");
  std::vector<Row> rows;
  ErrorWord ew;

  for (const auto& sh : shapes) {
    const int64_t T = sh.T, H = sh.H;
    const int E = sh.E, k = sh.k;
    // One dispatcher per alignment; buffers sized for the larger (A = 128) bound.
    DispatcherConfig cfg;
    cfg.max_tokens = T;
    cfg.num_experts = E;
    cfg.topk = k;
    cfg.hidden = H;
    cfg.row_dtype = DType::kBF16;
    cfg.options.align = 128;
    Dispatcher d128(cfg);
    cfg.options.align = 0;
    Dispatcher d0(cfg);
    const SavedState plan128 = d128.new_plan(), plan0 = d0.new_plan();
    const int64_t R = d128.rows();
    void *x, *x_perm, *dY, *y, *dy, *dx;
    float *probs, *dprobs, *d_probs_perm;
    int32_t* indices;
    const size_t tb = static_cast<size_t>(T * H) * 2, rb = static_cast<size_t>(R * H) * 2;
    MOE_CUDA_CHECK(cudaMalloc(&x, tb));
    MOE_CUDA_CHECK(cudaMalloc(&y, tb));
    MOE_CUDA_CHECK(cudaMalloc(&dy, tb));
    MOE_CUDA_CHECK(cudaMalloc(&dx, tb));
    MOE_CUDA_CHECK(cudaMalloc(&x_perm, rb));
    MOE_CUDA_CHECK(cudaMalloc(&dY, rb));
    MOE_CUDA_CHECK(cudaMalloc(&probs, sizeof(float) * T * k));
    MOE_CUDA_CHECK(cudaMalloc(&dprobs, sizeof(float) * T * k));
    MOE_CUDA_CHECK(cudaMalloc(&d_probs_perm, sizeof(float) * R));
    MOE_CUDA_CHECK(cudaMalloc(&indices, sizeof(int32_t) * T * k));
    MOE_CUDA_CHECK(cudaMemset(x, 0x3c, tb));  // bf16 0x3c3c ~ 0.0115
    MOE_CUDA_CHECK(cudaMemset(dy, 0x3c, tb));
    MOE_CUDA_CHECK(cudaMemset(d_probs_perm, 0, sizeof(float) * R));

    for (double skew : {0.0, 1.0}) {
      const char* routing_name = skew == 0.0 ? "balanced" : "skewed";
      ref::Routing r = ref::make_topk_routing(T, E, k, 1234, skew);
      MOE_CUDA_CHECK(cudaMemcpy(indices, r.indices.data(), sizeof(int32_t) * T * k, cudaMemcpyHostToDevice));
      std::vector<float> pf(r.probs.begin(), r.probs.end());
      MOE_CUDA_CHECK(cudaMemcpy(probs, pf.data(), sizeof(float) * T * k, cudaMemcpyHostToDevice));
      RoutingView rv;
      rv.indices = TensorView(indices, DType::kInt32, {T, k});
      rv.probs = TensorView(probs, DType::kFP32, {T, k});
      DispatchOptions o;
      o.align = 128;
      const ref::DispatchPlan p128 = ref::plan_dispatch(r, o);
      int64_t S = 0, N = 0;
      for (int e = 0; e < E; ++e) {
        S += p128.padded[e];
        N += p128.count[e];
      }

      auto measure = [&](const char* kernel, double bytes, const std::function<void()>& fn) {
        const bench::Timing g = bench::time_cuda_graph(fn, stream, 5, repeats);
        const bench::Timing e = bench::time_cuda(fn, stream, 5, repeats);
        rows.push_back({sh.name, routing_name, kernel, bytes, g.median_ms, e.median_ms});
        const double gbs = bytes > 0 ? bytes / (g.median_ms * 1e-3) / 1e9 : 0;
        const double ebs = bytes > 0 ? bytes / (e.median_ms * 1e-3) / 1e9 : 0;
        if (bytes > 0)
          std::printf("%-18s %-9s %-22s %10.1f %10.0f %10.0f %7.1f%%\n", sh.name, routing_name, kernel,
                      g.median_ms * 1e3, gbs, ebs, 100.0 * gbs / copy_gbs);
        else
          std::printf("%-18s %-9s %-22s %10.1f %10s %10s %8s\n", sh.name, routing_name, kernel, g.median_ms * 1e3,
                      "-", "-", "-");
        std::fflush(stdout);
      };

      auto rows_view = [&](void* p, int64_t n) { return TensorView(p, DType::kBF16, {n, H}); };
      TensorView dprobs_v(dprobs, DType::kFP32, {T, k}), dpp_v(d_probs_perm, DType::kFP32, {R});
      const double b = 2.0 * H;

      // Plan (routing -> counts, offsets, row maps): latency only.
      measure("plan (A=128)", 0, [&] { d128.plan(rv, ew.device_ptr(), plan128, stream); });
      d0.plan(rv, ew.device_ptr(), plan0, stream);
      measure("permute A=0", (N + N) * b,
              [&] { d0.permute(plan0, rows_view(x, T), rows_view(x_perm, d0.rows()), stream); });
      d128.plan(rv, ew.device_ptr(), plan128, stream);
      measure("permute A=128", (N + S) * b,
              [&] { d128.permute(plan128, rows_view(x, T), rows_view(x_perm, R), stream); });
      TensorView Y = rows_view(x_perm, R);  // the permuted rows stand in for the experts' output
      measure("unpermute merge A=128", (N + T) * b,
              [&] { d128.unpermute(plan128, Y, rows_view(y, T), MergeProbs::kPlanned, stream); });
      measure("permute_bwd A=128", (N + T) * b,
              [&] { d128.permute_backward(plan128, Y, rows_view(dx, T), stream, &dpp_v, &dprobs_v); });
      measure("unpermute_bwd A=128", (2 * N + S) * b, [&] {
        d128.unpermute_backward(plan128, rows_view(dy, T), rows_view(dY, R), MergeProbs::kPlanned, stream, nullptr,
                                &Y, &dprobs_v);
      });
      ew.check(stream);  // the benchmark routing is valid: no bits
    }
    for (void* p : {x, y, dy, dx, x_perm, dY}) cudaFree(p);
    for (void* p : {static_cast<void*>(probs), static_cast<void*>(dprobs), static_cast<void*>(d_probs_perm),
                    static_cast<void*>(indices)})
      cudaFree(p);
  }

  // Summary: the weakest figure of each kernel over all shapes and routings.
  std::printf("\nworst case per kernel (graph GB/s, %% of copy %.0f GB/s):\n", copy_gbs);
  for (const char* kernel :
       {"permute A=0", "permute A=128", "unpermute merge A=128", "permute_bwd A=128", "unpermute_bwd A=128"}) {
    double worst = 1e30;
    std::string where;
    for (const auto& r : rows)
      if (r.kernel == kernel) {
        const double gbs = r.bytes / (r.graph_ms * 1e-3) / 1e9;
        if (gbs < worst) {
          worst = gbs;
          where = r.shape + " " + r.routing;
        }
      }
    std::printf("  %-22s %6.0f GB/s  %5.1f%%  (%s)\n", kernel, worst, 100.0 * worst / copy_gbs, where.c_str());
  }
  cudaStreamDestroy(stream);
  return 0;
}
