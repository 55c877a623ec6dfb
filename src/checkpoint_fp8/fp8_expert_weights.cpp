// save_fp8_expert_weights / load_fp8_expert_weights (moe/checkpoint_fp8.h): host <-> device copies
// between a state dict's quantized-weight tensors and the FP8 experts' weight copies.
#include "moe/checkpoint_fp8.h"

#include <vector>

#include "device/cuda_check.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"

namespace moe {
namespace {

constexpr Param kWeights[] = {Param::kFc1Weight, Param::kFc2Weight};
constexpr QuantPart kParts[] = {QuantPart::kData, QuantPart::kScale, QuantPart::kColumnwiseData,
                                QuantPart::kColumnwiseScale};

// What the FP8 experts' weight copies are: 128x128 blocks, both copies, row-major fp32 scales.
QuantConfig weight_copy_config() {
  QuantConfig c;
  c.format = QuantFormat::kFP8Block;
  c.blocking = QuantBlocking::k2D;
  c.rowwise = c.columnwise = true;
  c.scale_layout = ScaleLayout::kRowMajor;
  return c;
}

const TensorView& part_view(const QuantizedTensor& q, QuantPart part) {
  switch (part) {
    case QuantPart::kData: return q.rowwise_data;
    case QuantPart::kScale: return q.rowwise_scale;
    case QuantPart::kColumnwiseData: return q.columnwise_data;
    default: return q.columnwise_scale;
  }
}

// Whether a declared format is the copies' format. pow2_scale is informational (how the scales were
// made, not how they are read), and an explicit row-major columnwise layout is the same layout.
bool is_weight_copy_format(const QuantConfig& c) {
  return c.format == QuantFormat::kFP8Block && c.blocking == QuantBlocking::k2D && c.rowwise && c.columnwise &&
         copy_scale_layout(c, false) == ScaleLayout::kRowMajor && copy_scale_layout(c, true) == ScaleLayout::kRowMajor;
}

}  // namespace

void save_fp8_expert_weights(const GroupedExperts& experts, const std::string& prefix, StateDict& sd,
                             Metadata& metadata, cudaStream_t stream) {
  MOE_CHECK(experts.config().fp8 != Fp8Recipe::kNone, "save_fp8_expert_weights: the experts do not run FP8 ",
            "(config.fp8)");
  MOE_CHECK(experts.fp8_weights_current(), "save_fp8_expert_weights: the FP8 weight copies were not made since the ",
            "last set_weights (call refresh_fp8_weights, or run a forward, first)");
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (Param p : kWeights) {
    const std::string key = expert_param_key(prefix, p);
    const QuantizedTensor q = experts.fp8_weights(p);
    for (QuantPart part : kParts) {
      const TensorView& v = part_view(q, part);
      HostTensor h(v.dtype, std::vector<int64_t>(v.shape, v.shape + v.ndim));
      MOE_CUDA_CHECK(cudaMemcpy(h.mutable_data(), v.data, static_cast<size_t>(v.nbytes()), cudaMemcpyDeviceToHost));
      sd[quant_part_key(key, part)] = h;
    }
    set_quant_metadata(metadata, key, weight_copy_config());
  }
}

void load_fp8_expert_weights(GroupedExperts& experts, const StateDict& sd, const Metadata& metadata,
                             const std::string& prefix, cudaStream_t stream) {
  const ExpertsConfig& c = experts.config();
  MOE_CHECK(c.fp8 != Fp8Recipe::kNone, "load_fp8_expert_weights: the experts do not run FP8 (config.fp8)");
  MOE_CHECK(c.fp8_weight_refresh != Fp8WeightRefresh::kEveryForward, "load_fp8_expert_weights: with ",
            "config.fp8_weight_refresh = every forward, each forward quantizes the bf16 weights over loaded copies; ",
            "use on request or from master");
  MOE_CHECK(experts.weight_binding() != 0, "load_fp8_expert_weights: no weights bound (call set_weights first; ",
            "a later set_weights asks for a refresh, which would replace the loaded copies)");
  // Every check first: metadata, then each part of each expert against the copy it lands in.
  const std::vector<QuantizedParamDecl> decls = quantized_params(metadata);
  std::vector<QuantizedParamInfo> infos;
  for (Param p : kWeights) {
    const std::string key = expert_param_key(prefix, p);
    const QuantizedParamDecl* decl = nullptr;
    for (const auto& d : decls)
      if (d.key == key) decl = &d;
    MOE_CHECK(decl != nullptr, "load_fp8_expert_weights: no __metadata__ '", quant_metadata_key(key),
              "' (the format of '", key, "')");
    MOE_CHECK(is_weight_copy_format(decl->config), "__metadata__ '", quant_metadata_key(key), "': expected ",
              format_quant_metadata(weight_copy_config()), " (the FP8 experts' weight copies), got ",
              format_quant_metadata(decl->config));
    const QuantizedParamInfo info = inspect_quantized_param(sd, key, decl->config, c.experts);
    const TensorView& data = experts.fp8_weights(p).rowwise_data;  // [E, N, K]
    MOE_CHECK(info.rows == data.shape[1] && info.cols == data.shape[2], "'", key, "': one expert's matrix is [",
              info.rows, ", ", info.cols, "], expected [", data.shape[1], ", ", data.shape[2], "]");
    infos.push_back(info);
  }
  // On the stream, after the work that may still read the copies; done when this returns (pageable
  // host memory: a plain cudaMemcpy could return before its bytes reach the device).
  for (size_t i = 0; i < infos.size(); ++i) {
    const Param p = kWeights[i];
    const QuantizedTensor q = experts.fp8_weights(p);
    for (QuantPart part : kParts) {
      const TensorView& v = part_view(q, part);
      auto* dst = static_cast<uint8_t*>(v.data);
      if (infos[i].layout == WeightLayout::kSingleGrouped) {
        const HostTensor& h = sd.at(quant_part_key(expert_param_key(prefix, p), part));
        MOE_CUDA_CHECK(
            cudaMemcpyAsync(dst, h.data(), static_cast<size_t>(h.nbytes()), cudaMemcpyHostToDevice, stream));
        continue;
      }
      const size_t per_expert = static_cast<size_t>(v.nbytes() / c.experts);
      for (int e = 0; e < c.experts; ++e) {
        const HostTensor& h = sd.at(quant_part_key(expert_param_key(prefix, p, e), part));
        MOE_CUDA_CHECK(cudaMemcpyAsync(dst + e * per_expert, h.data(), per_expert, cudaMemcpyHostToDevice, stream));
      }
    }
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  experts.accept_fp8_weights();
}

}  // namespace moe
