// Fused router: time and bandwidth of forward and backward for T in {16384, 32768, 65536},
// E in {8, 64, 128, 256}, k in {2, 8}, bf16 and fp32 logits, beside the device-to-device copy
// bandwidth measured in the same run.
//
// usage: bench_router [--repeats N] [--warm-l2] [--dtype bf16|fp32|both]
//
// GB/s counts the logits read once (T * E * element bytes) -- the floor of any router; the other traffic
// (indices / probs / selected written, d logits written) is listed at the end. Two comparisons with
// the device-to-device copy measured in the same run (a 2 GiB buffer, so DRAM-bound):
//   "%cp": the logits-read rate / the copy's bytes moved (read + write) per second;
//   "%rd": the logits-read rate / the copy's read rate (half of that).
// Routing variants: "mixtral" (softmax, top-k, renormalise), "deepseek" (sigmoid + bias, groups of
// E/8 keeping 4, renormalise, scaled; E >= 64), "losses" (mixtral + aux loss + z-loss). Medians of
// CUDA-event-timed replays of a graph holding one call; before each timed replay a 256 MiB write
// evicts the logits from L2 (they would otherwise stay there between replays: at most 32 MiB here),
// unless --warm-l2. Each time includes the graph launch of one call.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

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
  bool warm_l2 = false;
  std::string dtypes = "both";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--repeats" && i + 1 < argc) {
      repeats = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--warm-l2") {
      warm_l2 = true;
    } else if (a == "--dtype" && i + 1 < argc && (std::string(argv[i + 1]) == "bf16" ||
                                                   std::string(argv[i + 1]) == "fp32" ||
                                                   std::string(argv[i + 1]) == "both")) {
      dtypes = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_router [--repeats N] [--warm-l2] [--dtype bf16|fp32|both]\n");
      return 2;
    }
  }
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double copy_gbs = bench::copy_bandwidth_gbs(stream);
  const double copy_read_gbs = copy_gbs / 2;
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = nullptr;
  if (!warm_l2) MOE_CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  // Before each timed replay (outside its events): overwrite the flush buffer, evicting the logits.
  int flushes = 0;
  std::function<void()> evict_l2;
  if (flush) evict_l2 = [&] { MOE_CUDA_CHECK(cudaMemsetAsync(flush, flushes++ & 0xff, flush_bytes, stream)); };
  std::printf("device: %s\n", bench::device_description().c_str());
  std::printf("device-to-device copy bandwidth (read + write): %.0f GB/s (read %.0f GB/s)\n", copy_gbs,
              copy_read_gbs);
  std::printf("L2 %s between timed replays\n\n", warm_l2 ? "kept warm" : "flushed");
  std::printf("%-9s %4s %6s %4s %3s %9s %9s %6s %6s %9s %9s %6s %6s\n", "variant", "type", "T", "E", "k", "fwd us",
              "fwd GB/s",
              "%cp", "%rd", "bwd us", "bwd GB/s", "%cp", "%rd");

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
  for (const bool bf16 : {true, false})
    for (int64_t T : {16384, 32768, 65536})
      for (int E : {8, 64, 128, 256})
        for (int k : {2, 8})
          for (const Variant& v : variants) {
            if (std::string(v.name) == "deepseek" && E < 64) continue;
            if (dtypes != "both" && (dtypes == "bf16") != bf16) continue;
            const size_t esize = bf16 ? 2 : 4;
            const DType dtype = bf16 ? DType::kBF16 : DType::kFP32;
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
            MOE_CUDA_CHECK(cudaMalloc(&logits, T * E * esize));
            MOE_CUDA_CHECK(cudaMalloc(&dlogits, T * E * esize));
            MOE_CUDA_CHECK(cudaMalloc(&probs, sizeof(float) * T * k));
            MOE_CUDA_CHECK(cudaMalloc(&dprobs, sizeof(float) * T * k));
            MOE_CUDA_CHECK(cudaMalloc(&bias, sizeof(float) * E));
            MOE_CUDA_CHECK(cudaMalloc(&scalars, sizeof(float) * 8));
            MOE_CUDA_CHECK(cudaMalloc(&indices, sizeof(int32_t) * T * k));
            MOE_CUDA_CHECK(cudaMalloc(&selected, sizeof(int32_t) * T * W));
            MOE_CUDA_CHECK(cudaMalloc(&counts, sizeof(int32_t) * E));
            MOE_CUDA_CHECK(cudaMalloc(&selcounts, sizeof(int32_t) * E));
            if (bf16)
              bench::fill_random_bf16(logits, T * E, 42, 1.0f, stream);
            else
              bench::fill_random_fp32(static_cast<float*>(logits), T * E, 42, 1.0f, stream);
            MOE_CUDA_CHECK(cudaMemsetAsync(bias, 0, sizeof(float) * E, stream));
            MOE_CUDA_CHECK(cudaMemsetAsync(dprobs, 0, sizeof(float) * T * k, stream));
            MOE_CUDA_CHECK(cudaMemsetAsync(scalars, 0, sizeof(float) * 8, stream));
            const TensorView lv(logits, dtype, {T, E});
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
            const TensorView dv(dlogits, dtype, {T, E});
            const double f_ms =
                bench::time_cuda_graph([&] { router.forward(lv, bv, o, ew.device_ptr(), stream); }, stream, 5, repeats,
                                       evict_l2)
                    .median_ms;
            const double b_ms =
                bench::time_cuda_graph([&] { router.backward(lv, o, g, dv, stream); }, stream, 5, repeats, evict_l2)
                    .median_ms;
            ew.check(stream);
            const double bytes = static_cast<double>(esize) * T * E;
            const double fg = bytes / (f_ms * 1e-3) / 1e9, bg = bytes / (b_ms * 1e-3) / 1e9;
            std::printf("%-9s %4s %6lld %4d %3d %9.1f %9.0f %5.1f%% %5.1f%% %9.1f %9.0f %5.1f%% %5.1f%%\n", v.name,
                        bf16 ? "bf16" : "fp32", static_cast<long long>(T), E, k, f_ms * 1e3, fg, 100.0 * fg / copy_gbs,
                        100.0 * fg / copy_read_gbs, b_ms * 1e3, bg, 100.0 * bg / copy_gbs, 100.0 * bg / copy_read_gbs);
            std::fflush(stdout);
            for (void* p : {logits, dlogits, static_cast<void*>(probs), static_cast<void*>(dprobs),
                            static_cast<void*>(bias), static_cast<void*>(scalars), static_cast<void*>(indices),
                            static_cast<void*>(selected), static_cast<void*>(counts), static_cast<void*>(selcounts)})
              cudaFree(p);
          }
  std::printf("\nbytes per row (s = 2 for bf16, 4 for fp32 logits): forward reads sE (logits) and writes 8k\n"
              "(indices + probs) + 4W (selected); backward reads sE + 12k and writes sE (d logits).\n");
  if (flush) cudaFree(flush);
  cudaStreamDestroy(stream);
  return 0;
}
