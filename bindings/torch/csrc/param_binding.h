// Parameter and gradient binding shared by the layer and experts operators: tensors arrive as lists
// (one grouped tensor or E per-expert tensors) on every call and are (re)bound only when their
// addresses change, so steady-state calls -- and CUDA-graph replays -- do no host work beyond
// enqueueing kernels.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "csrc/torch_interop.h"
#include "moe/activation.h"
#include "moe/grouped_experts.h"

namespace moe::torch_ext {

// The addresses of parameter lists, with a separator so ([a], []) differs from ([], [a]).
inline std::vector<const void*> addresses(std::initializer_list<const std::vector<at::Tensor>*> lists) {
  std::vector<const void*> out;
  for (const auto* l : lists) {
    out.push_back(nullptr);
    for (const auto& t : *l) out.push_back(t.data_ptr());
  }
  return out;
}

// Binding per-expert tensors uploads a pointer table (a synchronous copy): never inside a capture.
inline void check_rebind_allowed(const char* what) {
  MOE_CHECK(!capturing(), "moe_engine: the ", what,
            " tensors changed address during CUDA graph capture; run one eager step with the same tensors "
            "before capturing (binding per-expert tensors needs a synchronous upload)");
}

inline ExpertTensors expert_tensors(const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                    const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  return ExpertTensors{views(w1, "fc1.weight"), views(b1, "fc1.bias"), views(w2, "fc2.weight"),
                       views(b2, "fc2.bias")};
}

// An op with set_weights / set_grads (GroupedMlp, GroupedExperts) and the addresses bound last.
template <typename Op>
struct Bound {
  template <typename Config>
  explicit Bound(const Config& c) : op(c) {}
  Op op;
  std::vector<const void*> weight_ptrs, grad_ptrs;

  void bind_weights(const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                    const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
    bind_weights_with(&Op::set_weights, w1, b1, w2, b2);
  }
  // The same weights at new addresses (op.rebind_weights): the binding the saved states hold stays.
  void rebind_weights(const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                      const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
    bind_weights_with(&Op::rebind_weights, w1, b1, w2, b2);
  }
  void bind_grads(const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                  const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
    auto ptrs = addresses({&w1, &b1, &w2, &b2});
    if (ptrs == grad_ptrs) return;
    const bool grouped_only = w1.size() <= 1 && b1.size() <= 1 && w2.size() <= 1 && b2.size() <= 1;
    if (!grouped_only) check_rebind_allowed("gradient");
    op.set_grads(expert_tensors(w1, b1, w2, b2));
    grad_ptrs = std::move(ptrs);
  }
  // A backward's gradient lists. All four empty outside delayed mode means no expert parameter wants a
  // gradient (frozen experts): nothing is bound and the backward skips the weight gradients. Delayed
  // mode binds them in backward_dw.
  WeightGrads bind_backward_grads(bool delayed, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                  const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
    if (delayed) return WeightGrads::kCompute;
    if (w1.empty() && b1.empty() && w2.empty() && b2.empty()) return WeightGrads::kSkip;
    bind_grads(w1, b1, w2, b2);
    return WeightGrads::kCompute;
  }

 private:
  // Binds the weights through `bind` (set_weights or rebind_weights) unless they are where they are
  // bound already.
  void bind_weights_with(void (Op::*bind)(const ExpertTensors&), const std::vector<at::Tensor>& w1,
                         const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
                         const std::vector<at::Tensor>& b2) {
    auto ptrs = addresses({&w1, &b1, &w2, &b2});
    if (ptrs == weight_ptrs) return;
    check_rebind_allowed("weight");
    (op.*bind)(expert_tensors(w1, b1, w2, b2));
    weight_ptrs = std::move(ptrs);
  }
};

// The expert part of a config from the operators' common arguments.
template <typename Config>
void set_expert_options(Config& c, const std::string& activation, int64_t glu_interleave, double alpha,
                        double limit, double offset, bool bias, bool probs_at_combine, bool per_expert,
                        bool accumulate, bool fp32_wgrad, bool delay_wgrad) {
  c.activation.kind = activation_from_name(activation);
  c.activation.glu_interleave = to_int(glu_interleave, "glu_interleave");
  c.activation.alpha = to_float(alpha, "alpha");
  c.activation.limit = to_float(limit, "limit");
  c.activation.offset = to_float(offset, "offset");
  c.bias = bias;
  c.probs = probs_at_combine ? ProbsPlacement::kAtCombine : ProbsPlacement::kInActivation;
  c.layout = per_expert ? WeightLayout::kPerExpert : WeightLayout::kSingleGrouped;
  c.wgrad = accumulate ? WgradMode::kAccumulate : WgradMode::kWrite;
  c.wgrad_dtype = fp32_wgrad ? DType::kFP32 : DType::kBF16;
  c.delay_wgrad = delay_wgrad;
}

// The quantized-compute options from their Python names: fp8 "none" | "block" (FP8 block scaling)
// | "block_pow2" (the same with power-of-two scales) | "mxfp8" | "nvfp4" (emulated on Hopper,
// ExpertsConfig::emulated), fp8_weight_refresh
// "every_forward" | "on_request" | "from_master".
template <typename Config>
void set_fp8_options(Config& c, const std::string& fp8, const std::string& refresh) {
  MOE_CHECK(fp8 == "none" || fp8 == "block" || fp8 == "block_pow2" || fp8 == "mxfp8" || fp8 == "nvfp4",
            "argument 'fp8': expected 'none', 'block', 'block_pow2', 'mxfp8' or 'nvfp4', got '", fp8, "'");
  c.fp8 = fp8 == "block" ? Fp8Recipe::kBlock : fp8 == "block_pow2" ? Fp8Recipe::kBlockPow2 : Fp8Recipe::kNone;
  c.emulated = fp8 == "mxfp8" ? EmulatedQuant::kMXFP8 : fp8 == "nvfp4" ? EmulatedQuant::kNVFP4 : EmulatedQuant::kNone;
  MOE_CHECK(refresh == "every_forward" || refresh == "on_request" || refresh == "from_master",
            "argument 'fp8_weight_refresh': expected 'every_forward', 'on_request' or 'from_master', got '", refresh,
            "'");
  c.fp8_weight_refresh = refresh == "on_request"    ? Fp8WeightRefresh::kOnRequest
                         : refresh == "from_master" ? Fp8WeightRefresh::kFromMaster
                                                    : Fp8WeightRefresh::kEveryForward;
}

}  // namespace moe::torch_ext
