// Quantized weights read back as floating-point values (dequantize.h).
#include "checkpoint/dequantize.h"

#include <cstring>

#include "checkpoint/byte_transpose.h"
#include "checkpoint/element_io.h"
#include "checkpoint/hf_tensors.h"
#include "checkpoint/key_text.h"
#include "checkpoint/parallel_for.h"
#include "moe/checkpoint_hf.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "reference/quantize_ref.h"

namespace moe::detail {

namespace {

constexpr Param kParams[] = {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias};

// One part of a quantized parameter, every expert's bytes in expert order (a grouped tensor's bytes as
// they are; per expert, the experts' tensors one after the other).
std::vector<uint8_t> part_bytes(const StateDict& sd, const QuantizedParamInfo& info, QuantPart part) {
  std::vector<uint8_t> out;
  const int count = info.layout == WeightLayout::kSingleGrouped ? 1 : info.experts;
  for (int e = 0; e < count; ++e) {
    const std::string key =
        quant_part_key(info.layout == WeightLayout::kSingleGrouped ? info.key : info.key + std::to_string(e), part);
    const HostTensor& t = sd.at(key);
    out.insert(out.end(), t.data(), t.data() + t.nbytes());
  }
  return out;
}

// The parameter decoded into fp32 [E, rows, cols].
HostTensor decoded(const StateDict& sd, const QuantizedParamInfo& info) {
  const QuantConfig& c = info.config;
  const int64_t E = info.experts, rows = info.rows, cols = info.cols;
  const bool rowwise = quant_stores(c, QuantPart::kData);
  ref::Quantized q;
  if (rowwise) {
    q.rowwise_data = part_bytes(sd, info, QuantPart::kData);
    q.rowwise_scale = part_bytes(sd, info, QuantPart::kScale);
  } else {
    q.columnwise_data = part_bytes(sd, info, QuantPart::kColumnwiseData);
    q.columnwise_scale = part_bytes(sd, info, QuantPart::kColumnwiseScale);
  }
  if (quant_stores(c, QuantPart::kGlobalAmax)) {
    const std::vector<uint8_t> amax = part_bytes(sd, info, QuantPart::kGlobalAmax);
    q.global_amax.resize(amax.size() / sizeof(float));
    std::memcpy(q.global_amax.data(), amax.data(), amax.size());
  }
  const std::vector<float> v = ref::dequantize(c, q, /*columnwise=*/!rowwise, E, rows, cols);
  HostTensor t(DType::kFP32, {E, rows, cols});
  float* out = reinterpret_cast<float*>(t.mutable_data());
  if (rowwise) {
    std::memcpy(out, v.data(), v.size() * sizeof(float));
  } else {  // [E, cols, rows] -> [E, rows, cols]
    for (int64_t e = 0; e < E; ++e)
      transpose_bytes(reinterpret_cast<const uint8_t*>(v.data() + e * cols * rows),
                      reinterpret_cast<uint8_t*>(out + e * rows * cols), cols, rows, sizeof(float));
  }
  return t;
}

HostTensor widened(const std::string& key, const HostTensor& t) {
  MOE_CHECK(t.dtype() == DType::kBF16 || t.dtype() == DType::kFP16 || t.dtype() == DType::kFP32, "state dict: '", key,
            "' of a quantized expert layer has dtype ", dtype_name(t.dtype()), ", expected bf16, fp16 or fp32 (or a ",
            "quantized format declared in __metadata__)");
  HostTensor out(DType::kFP32, t.shape());
  const int64_t n = t.numel();
  float* o = reinterpret_cast<float*>(out.mutable_data());
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(load_element(t.dtype(), t.data(), i));
  return out;
}

// Whether `key` is one of the tensors of a parameter `declared` names: any part (data or companion) of
// its grouped key or of a per-expert one (digits after it).
bool is_declared(const std::string& key, const std::vector<QuantizedParamDecl>& declared) {
  int64_t index;
  for (const QuantizedParamDecl& d : declared)
    if (key.compare(0, d.key.size(), d.key) == 0 && our_key_rest(key.substr(d.key.size()), true, &index)) return true;
  return false;
}

}  // namespace

StateDict dequantized_expert_tensors(const StateDict& sd, const std::string& prefix,
                                     const std::vector<QuantizedParamInfo>& params) {
  MOE_CHECK(!params.empty(), "convert: no quantized parameter of the experts under '", prefix, "' to decode");
  const int E = params.front().experts;
  StateDict out;
  std::set<std::string> declared;
  for (const QuantizedParamInfo& info : params) {
    out.emplace(info.key, decoded(sd, info));
    declared.insert(info.key);
  }
  // The layer's unquantized parameters, in whichever layout they are stored (made grouped below).
  for (Param p : kParams) {
    const std::string key = expert_param_key(prefix, p);
    if (declared.count(key)) continue;
    if (auto it = sd.find(key); it != sd.end()) out.emplace(key, widened(key, it->second));
    for (int e = 0; e < E; ++e)
      if (auto it = sd.find(key + std::to_string(e)); it != sd.end())
        out.emplace(it->first, widened(it->first, it->second));
  }
  normalize_expert_keys(out, prefix, E, WeightLayout::kSingleGrouped);
  // Nothing left per expert: a parameter stored in both layouts is refused (the grouped one would win).
  for (const auto& kv : out)
    for (Param p : kParams) {
      const std::string key = expert_param_key(prefix, p);
      MOE_CHECK(kv.first.size() == key.size() || kv.first.compare(0, key.size(), key) != 0, "convert: '", kv.first,
                "' of the experts under '", prefix, "' is stored in both layouts (beside '", key, "')");
    }
  return out;
}

std::vector<std::string> fp8_block_weights(const StateDict& sd, const std::set<std::string>& skip,
                                           const Metadata& metadata) {
  const std::vector<QuantizedParamDecl> declared = quantized_params(metadata);
  std::vector<std::string> keys;
  for (const auto& [key, t] : sd)
    if (t.dtype() == DType::kFP8E4M3 && t.ndim() >= 2 && !skip.count(key) && !is_declared(key, declared) &&
        sd.count(key + kFp8ScaleSuffix))
      keys.push_back(key);
  return keys;
}

void check_fp8_block_scales(const std::string& key, const HostTensor& t, const HostTensor& s) {
  std::vector<int64_t> want = t.shape();
  want[want.size() - 2] = blocks_of_128(want[want.size() - 2]);
  want.back() = blocks_of_128(want.back());
  MOE_CHECK((s.dtype() == DType::kFP32 || s.dtype() == DType::kBF16) && s.shape() == want, "state dict: '",
            key + kFp8ScaleSuffix, "' has dtype ", dtype_name(s.dtype()), " and shape ", s.shape_string(),
            "; the FP8 tensor '", key, "' ", t.shape_string(), " needs fp32 (or bf16) block scales of shape ",
            shape_string(want), " (one per 128x128 block)");
}

void dequantize_fp8_block_tensors(StateDict& sd, DType dtype, const std::set<std::string>& skip,
                                  const Metadata& metadata) {
  MOE_CHECK(dtype == DType::kBF16 || dtype == DType::kFP32, "argument 'dequantize': expected bf16 or fp32, got ",
            dtype_name(dtype));
  const std::vector<std::string> keys = fp8_block_weights(sd, skip, metadata);
  // Every tensor checked before any is replaced: a refused dict is left as it was.
  for (const std::string& key : keys) check_fp8_block_scales(key, sd.at(key), sd.at(key + kFp8ScaleSuffix));
  // Every E4M3 code's value (0x7F / 0xFF: NaN).
  float code_value[256];
  for (int c = 0; c < 256; ++c) code_value[c] = static_cast<float>(ref::e4m3_to_double(static_cast<uint8_t>(c)));
  // The outputs are made here; the tensors are decoded on every core, each by one thread.
  std::vector<HostTensor> outs;
  std::vector<uint8_t*> out_data;
  for (const std::string& key : keys) {
    outs.emplace_back(dtype, sd.at(key).shape());
    out_data.push_back(outs.back().mutable_data());
  }
  parallel_for(keys.size(), [&](size_t k) {
    const HostTensor& t = sd.at(keys[k]);
    const HostTensor& s = sd.at(keys[k] + kFp8ScaleSuffix);
    if (t.numel() == 0) return;  // nothing to decode (and other dimensions may be too large to multiply)
    const int64_t rows = t.shape()[t.ndim() - 2], cols = t.shape().back();
    const int64_t matrices = t.numel() / (rows * cols);
    const int64_t row_blocks = blocks_of_128(rows), col_blocks = blocks_of_128(cols);
    std::vector<float> row_scales(col_blocks);
    for (int64_t m = 0; m < matrices; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        if (r % 128 == 0)  // a new row of 128x128 blocks: its scales
          for (int64_t j = 0; j < col_blocks; ++j)
            row_scales[j] =
                static_cast<float>(load_element(s.dtype(), s.data(), (m * row_blocks + r / 128) * col_blocks + j));
        const int64_t first = (m * rows + r) * cols;
        const uint8_t* codes = t.data() + first;
        if (dtype == DType::kFP32) {
          float* o = reinterpret_cast<float*>(out_data[k]) + first;
          for (int64_t c = 0; c < cols; ++c) o[c] = code_value[codes[c]] * row_scales[c / 128];
        } else {
          uint16_t* o = reinterpret_cast<uint16_t*>(out_data[k]) + first;
          for (int64_t c = 0; c < cols; ++c) o[c] = float_to_bf16_bits(code_value[codes[c]] * row_scales[c / 128]);
        }
      }
  });
  for (size_t k = 0; k < keys.size(); ++k) {
    sd.erase(keys[k] + kFp8ScaleSuffix);
    sd[keys[k]] = std::move(outs[k]);
  }
}

}  // namespace moe::detail
