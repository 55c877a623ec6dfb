// The expert-layer benchmark behind `moe-engine bench` (the main job): builds a GroupedMlp for a
// named shape with random bf16 data and softmax-top-k routing, checks a sample of tokens against the
// CPU reference, then times forward and forward+backward, eager and CUDA-graph captured, and
// measures the device memory the layer adds.
#pragma once

#include <cstdint>
#include <string>

#include "moe/activation.h"
#include "moe/grouped_mlp_config.h"
#include "support/bench_util.h"

namespace moe::bench {

struct LayerBenchOptions {
  double skew = 0.0;      // routing skew (0 = balanced on average; > 0 Zipf-like popularity)
  int align = 0;          // per-expert row alignment A
  Activation activation = Activation::kSwiGLU;
  bool fuse_fc1 = true;   // the fused fc1 (gather + GEMM + bias + activation x prob); false: unfused
  bool save_x_perm = true;  // false (fused only): no x_perm, the fc1 weight gradient gathers the rows of x
  bool fuse_fc2_dgrad = false;  // fc2 dgrad gathering dy + activation backward in one kernel
  int token_chunks = 1;  // fc2 + combine and fc1 dgrad + dx sum in this many pieces of tokens
  Fp8Recipe fp8 = Fp8Recipe::kNone;  // FP8 experts (needs align 128 and the unfused path)
  // kOnRequest: the weights are quantized once after binding, outside the timed runs (as in a step
  // with several micro-batches); kEveryForward: inside every forward.
  Fp8WeightRefresh fp8_weight_refresh = Fp8WeightRefresh::kEveryForward;
  // Emulated MXFP8 / NVFP4 experts (the unfused path); the weights follow fp8_weight_refresh.
  EmulatedQuant emulated = EmulatedQuant::kNone;
  WgradMode wgrad = WgradMode::kWrite;  // kAccumulate: weight gradients added into fp32 main_grad buffers
  bool frozen = false;  // frozen experts: the backward computes dx and dprobs only (WeightGrads::kSkip)
  bool check = true;      // compare sampled tokens with the CPU reference first
  int sample_tokens = 8;  // tokens checked
  int warmup = 3;
  int repeats = 20;
  int rest_ms = 1000;  // idle time before each timed phase
  uint64_t seed = 1;
};

struct SampleCheck {
  bool ran = false;
  double y_rel_err = 0, dx_rel_err = 0, dprobs_rel_err = 0;  // worst relative L2 error over samples
  double tolerance = 0;
  bool passed() const { return !ran || (y_rel_err <= tolerance && dx_rel_err <= tolerance && dprobs_rel_err <= tolerance); }
};

struct LayerBenchResult {
  Shape shape{};
  double skew = 0;
  Timing fwd_eager, fwd_bwd_eager, fwd_graph, fwd_bwd_graph;
  double extra_gib = 0;      // device memory the layer, its outputs and weight gradients add
  SampleCheck check;
  double flops_fwd() const { return 6.0 * shape.T * shape.k * shape.H * shape.F; }
};

// The layer configuration the benchmark builds for a shape (validate() it to check the shape and the
// options without a GPU).
GroupedMlpConfig layer_bench_config(const Shape& shape, const LayerBenchOptions& options);

LayerBenchResult run_layer_bench(const Shape& shape, const LayerBenchOptions& options);

}  // namespace moe::bench
