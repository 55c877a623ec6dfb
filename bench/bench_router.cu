// Fused router: time and bandwidth of forward and backward for T in {16384, 32768, 65536},
// E in {8, 64, 128, 256}, k in {2, 8}, bf16 logits, beside the device-to-device copy bandwidth
// measured in the same run.
//
// usage: bench_router [--repeats N]
//
// GB/s counts the logits read once (T * E * 2 bytes) -- the floor of any router; the other
// traffic (indices / probs written, d logits written) is listed in the bytes column of each row.
// "% copy" compares that logits-read rate with the copy's read rate (half its read + write figure).
// Routing variants: "mixtral" (softmax, top-k, renormalise), "deepseek" (sigmoid + bias, groups of
// E/8 keeping 4, renormalise, scaled; E >= 64), "losses" (mixtral + aux loss + z-loss). Medians of
// CUDA-event-timed replays of a graph holding one call.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "moe/error_word.h"
#include "moe/router.h"
#include "support/bench_util.h"
#include "support/device_random.h"

namespace {

using namespace moe;

struct Variant {
  const char* name;
  void (*edit)(RouterConfig&);
};

}  // namespace

int main(int argc, char** argv) {
  int repeats = 20;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) repeats = std::atoi(argv[++i]);
  }
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbs = bench::copy_bandwidth_gbs(stream);
  const double copy_read_gbs = copy_gbs / 2;
  std::printf("device: %s\n", bench::device_description().c_str());
  std::printf("device-to-device copy bandwidth (read + write): %.0f GB/s (read %.0f GB/s)\n\n", copy_gbs,
              copy_read_gbs);
  std::printf("%-9s %6s %4s %3s %-9s %10s %10s %8s %10s %10s %8s\n", "variant", "T", "E", "k", "", "fwd us",
              "fwd GB/s", "% copy", "bwd us", "bwd GB/s", "% copy");

  const Variant variants[] = {
      {"mixtral", [](RouterConfig& c) { c.normalize_topk = true; }},
      {"deepseek",
       [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.expert_bias = true;
         c.num_groups = 8;
         c.topk_groups = 4;
         c.scaling_factor = 2.5f;
       }},
      {"losses",
       [](RouterConfig& c) {
         c.normalize_topk = true;
         c.aux_loss_coeff = 0.01f;
         c.z_loss_coeff = 0.001f;
       }},
  };
  ErrorWord ew;
  for (int64_t T : {16384, 32768, 65536})
    for (int E : {8, 64, 128, 256})
      for (int k : {2, 8})
        for (const Variant& v : variants) {
          if (std::string(v.name) == "deepseek" && E < 64) continue;
          RouterConfig cfg;
          cfg.num_experts = E;
          cfg.topk = k;
          cfg.max_tokens = T;
          v.edit(cfg);
          Router router(cfg);
          const int W = router.selection_width();
          void *logits, *dlogits;
          float *probs, *dprobs, *bias, *scalars;
          int32_t *indices, *selected, *counts, *selcounts;
          MOE_CUDA_CHECK(cudaMalloc(&logits, T * E * 2));
          MOE_CUDA_CHECK(cudaMalloc(&dlogits, T * E * 2));
          MOE_CUDA_CHECK(cudaMalloc(&probs, sizeof(float) * T * k));
          MOE_CUDA_CHECK(cudaMalloc(&dprobs, sizeof(float) * T * k));
          MOE_CUDA_CHECK(cudaMalloc(&bias, sizeof(float) * E));
          MOE_CUDA_CHECK(cudaMalloc(&scalars, sizeof(float) * 8));
          MOE_CUDA_CHECK(cudaMalloc(&indices, sizeof(int32_t) * T * k));
          MOE_CUDA_CHECK(cudaMalloc(&selected, sizeof(int32_t) * T * W));
          MOE_CUDA_CHECK(cudaMalloc(&counts, sizeof(int32_t) * E));
          MOE_CUDA_CHECK(cudaMalloc(&selcounts, sizeof(int32_t) * E));
          bench::fill_random_bf16(logits, T * E, 42, 1.0f, stream);
          MOE_CUDA_CHECK(cudaMemsetAsync(bias, 0, sizeof(float) * E, stream));
          MOE_CUDA_CHECK(cudaMemsetAsync(dprobs, 0, sizeof(float) * T * k, stream));
          MOE_CUDA_CHECK(cudaMemsetAsync(scalars, 0, sizeof(float) * 8, stream));
          const TensorView lv(logits, DType::kBF16, {T, E});
          const TensorView bv = cfg.expert_bias ? TensorView(bias, DType::kFP32, {E}) : TensorView();
          RouterOutputs o;
          o.indices = TensorView(indices, DType::kInt32, {T, k});
          o.probs = TensorView(probs, DType::kFP32, {T, k});
          o.selected = TensorView(selected, DType::kInt32, {T, W});
          o.selection_counts = TensorView(selcounts, DType::kInt32, {E});
          o.counts = TensorView(counts, DType::kInt32, {E});
          if (cfg.aux_loss_coeff != 0.0f) o.aux_loss = TensorView(scalars, DType::kFP32, {1});
          if (cfg.z_loss_coeff != 0.0f) o.z_loss = TensorView(scalars + 1, DType::kFP32, {1});
          RouterGrads g;
          g.d_probs = TensorView(dprobs, DType::kFP32, {T, k});
          g.d_aux_loss = TensorView(scalars + 2, DType::kFP32, {1});
          g.d_z_loss = TensorView(scalars + 3, DType::kFP32, {1});
          const TensorView dv(dlogits, DType::kBF16, {T, E});
          const bench::Timing f = bench::time_cuda_graph(
              [&] { router.forward(lv, bv, o, ew.device_ptr(), stream); }, stream, 5, repeats);
          const bench::Timing b =
              bench::time_cuda_graph([&] { router.backward(lv, o, g, dv, stream); }, stream, 5, repeats);
          ew.check(stream);
          const double bytes = 2.0 * T * E;
          const double fg = bytes / (f.median_ms * 1e-3) / 1e9, bg = bytes / (b.median_ms * 1e-3) / 1e9;
          std::printf("%-9s %6lld %4d %3d %-9s %10.1f %10.0f %7.1f%% %10.1f %10.0f %7.1f%%\n", v.name,
                      static_cast<long long>(T), E, k, "", f.median_ms * 1e3, fg, 100.0 * fg / copy_read_gbs,
                      b.median_ms * 1e3, bg, 100.0 * bg / copy_read_gbs);
          std::fflush(stdout);
          for (void* p : {logits, dlogits, static_cast<void*>(probs), static_cast<void*>(dprobs),
                          static_cast<void*>(bias), static_cast<void*>(scalars), static_cast<void*>(indices),
                          static_cast<void*>(selected), static_cast<void*>(counts), static_cast<void*>(selcounts)})
            cudaFree(p);
        }
  std::printf("\nbytes per row: forward reads 2E (logits) and writes 8k (indices + probs) + 4W (selected);\n"
              "backward reads 2E + 12k and writes 2E (d logits).\n");
  cudaStreamDestroy(stream);
  return 0;
}
