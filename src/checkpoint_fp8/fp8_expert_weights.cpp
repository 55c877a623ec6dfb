// save_fp8_expert_weights / load_fp8_expert_weights (moe/checkpoint_fp8.h): host <-> device copies
// between a state dict's quantized-weight tensors and the quantized experts' weight copies (FP8, or
// the emulated MXFP8 / NVFP4 codes).
#include "moe/checkpoint_fp8.h"

#include <vector>

#include "device/cuda_check.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"

namespace moe {
namespace {

constexpr Param kWeights[] = {Param::kFc1Weight, Param::kFc2Weight};

const TensorView& part_view(const QuantizedTensor& q, QuantPart part) {
  switch (part) {
    case QuantPart::kData: return q.rowwise_data;
    case QuantPart::kScale: return q.rowwise_scale;
    case QuantPart::kColumnwiseData: return q.columnwise_data;
    case QuantPart::kColumnwiseScale: return q.columnwise_scale;
    default: return q.global_amax;
  }
}

// The parts the experts' copies store (the global amax for NVFP4).
std::vector<QuantPart> stored_parts(const QuantConfig& c) {
  std::vector<QuantPart> parts;
  for (QuantPart part : kQuantParts)
    if (quant_stores(c, part)) parts.push_back(part);
  return parts;
}

// Whether a declared format is the copies' format. pow2_scale is informational (how the scales were
// made, not how they are read), and an explicit row-major columnwise layout is the same layout.
bool is_weight_copy_format(const QuantConfig& c, const QuantConfig& copies) {
  return c.format == copies.format && c.blocking == copies.blocking && c.rowwise && c.columnwise &&
         copy_scale_layout(c, false) == ScaleLayout::kRowMajor && copy_scale_layout(c, true) == ScaleLayout::kRowMajor;
}

// A device view's bytes as a host tensor: NVFP4 data (two E2M1 per byte) as U8 [.., cols / 2],
// the naming's storage (moe/checkpoint_quant.h).
HostTensor to_host(const TensorView& v) {
  std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
  DType dtype = v.dtype;
  if (dtype == DType::kFP4E2M1) {
    dtype = DType::kUInt8;
    shape.back() /= 2;
  }
  HostTensor h(dtype, shape);
  MOE_CUDA_CHECK(cudaMemcpy(h.mutable_data(), v.data, static_cast<size_t>(v.nbytes()), cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace

void save_fp8_expert_weights(const GroupedExperts& experts, const std::string& prefix, StateDict& sd,
                             Metadata& metadata, cudaStream_t stream) {
  const ExpertsConfig& c = experts.config();
  MOE_CHECK(c.fp8 != Fp8Recipe::kNone || c.emulated != EmulatedQuant::kNone, "save_fp8_expert_weights: the ",
            "experts do not quantize their weights (config.fp8 or config.emulated)");
  MOE_CHECK(experts.fp8_weights_current(), "save_fp8_expert_weights: the quantized weight copies were not made ",
            "since the last set_weights (call refresh_fp8_weights, or run a forward, first)");
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const QuantConfig copies = experts.fp8_weights_format();
  for (Param p : kWeights) {
    const std::string key = expert_param_key(prefix, p);
    const QuantizedTensor q = experts.fp8_weights(p);
    for (QuantPart part : stored_parts(copies)) sd[quant_part_key(key, part)] = to_host(part_view(q, part));
    set_quant_metadata(metadata, key, copies);
  }
}

void load_fp8_expert_weights(GroupedExperts& experts, const StateDict& sd, const Metadata& metadata,
                             const std::string& prefix, cudaStream_t stream) {
  const ExpertsConfig& c = experts.config();
  MOE_CHECK(c.fp8 != Fp8Recipe::kNone || c.emulated != EmulatedQuant::kNone, "load_fp8_expert_weights: the ",
            "experts do not quantize their weights (config.fp8 or config.emulated)");
  MOE_CHECK(c.fp8_weight_refresh != Fp8WeightRefresh::kEveryForward, "load_fp8_expert_weights: with ",
            "config.fp8_weight_refresh = every forward, each forward quantizes the bf16 weights over loaded copies; ",
            "use on request or from master");
  MOE_CHECK(experts.weight_binding() != 0, "load_fp8_expert_weights: no weights bound (call set_weights first; ",
            "a later set_weights asks for a refresh, which would replace the loaded copies)");
  // Every check first: metadata, then each part of each expert against the copy it lands in.
  const QuantConfig copies = experts.fp8_weights_format();
  const std::vector<QuantizedParamDecl> decls = quantized_params(metadata);
  std::vector<QuantizedParamInfo> infos;
  for (Param p : kWeights) {
    const std::string key = expert_param_key(prefix, p);
    const QuantizedParamDecl* decl = nullptr;
    for (const auto& d : decls)
      if (d.key == key) decl = &d;
    MOE_CHECK(decl != nullptr, "load_fp8_expert_weights: no __metadata__ '", quant_metadata_key(key),
              "' (the format of '", key, "')");
    MOE_CHECK(is_weight_copy_format(decl->config, copies), "__metadata__ '", quant_metadata_key(key), "': expected ",
              format_quant_metadata(copies), " (the experts' weight copies), got ", format_quant_metadata(decl->config));
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
    for (QuantPart part : stored_parts(copies)) {
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
  experts.accept_fp8_weights(stream);  // emulated formats: dequantizes the loaded codes on the stream
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace moe
