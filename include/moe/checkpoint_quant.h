// Quantized expert weights in checkpoints: the tensors that store one quantized parameter (data,
// block scales, the columnwise copy and its scales, the NVFP4 global amax), their key names in
// both layouts, and the __metadata__ entry that records the format. The byte contents are those
// of include/moe/quantize.h (docs/quantization.md); the naming is in docs/checkpoints.md.
//
//   key P (e.g. "fc1.weight", per expert "fc1.weight3")   rowwise data
//   P_scale_inv                                           rowwise scales
//   P_columnwise, P_columnwise_scale_inv                  columnwise copy and its scales
//   P_amax                                                NVFP4 global amax
//   __metadata__ "moe.quant.<grouped key>"                the format, e.g.
//       "mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=rowwise,columnwise"
//
// Layout conversion (grouped <-> per expert) moves every part with the data: see
// normalize_expert_keys in moe/state_dict.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/dtype.h"
#include "moe/grouped_mlp_config.h"
#include "moe/quant_format.h"
#include "moe/state_dict.h"

namespace moe {

// The tensors of a quantized parameter (the fields of QuantizedTensor in moe/quantize.h).
enum class QuantPart : uint8_t {
  kData,             // rowwise data                 P
  kScale,            // rowwise block scales         P_scale_inv
  kColumnwiseData,   // columnwise data              P_columnwise
  kColumnwiseScale,  // columnwise block scales      P_columnwise_scale_inv
  kGlobalAmax,       // NVFP4 global amax            P_amax
};
inline constexpr QuantPart kQuantParts[] = {QuantPart::kData, QuantPart::kScale, QuantPart::kColumnwiseData,
                                            QuantPart::kColumnwiseScale, QuantPart::kGlobalAmax};

// "", "_scale_inv", "_columnwise", "_columnwise_scale_inv", "_amax".
const char* quant_part_suffix(QuantPart part);
// The key of `part` of the tensor stored under `key` (a grouped "fc1.weight" or a per-expert
// "fc1.weight3"): key + suffix.
std::string quant_part_key(const std::string& key, QuantPart part);
// Whether `config` stores `part` (data and scales per copy it produces; the amax for NVFP4).
bool quant_stores(const QuantConfig& config, QuantPart part);

// How `part` is written for ONE matrix of [rows, cols] (the rowwise orientation: fc1 [fc1_out, H],
// fc2 [H, F]); a grouped tensor prepends E. Data: F8_E4M3 [rows, cols] (columnwise [cols, rows]),
// NVFP4 U8 [rows, cols / 2] (two E2M1 per byte, low nibble first); scales: scale_shape() in the
// configured layout, F32 / F8_E8M0 / F8_E4M3; amax: F32, 0-d (grouped: [E]).
struct QuantPartLayout {
  DType dtype = DType::kUInt8;
  std::vector<int64_t> shape;
};
QuantPartLayout quant_part_layout(const QuantConfig& config, QuantPart part, int64_t rows, int64_t cols);

// ---- __metadata__ ---------------------------------------------------------------------------
inline constexpr const char kQuantMetadataPrefix[] = "moe.quant.";
// "moe.quant." + the parameter's grouped key (one entry per parameter, in both layouts).
std::string quant_metadata_key(const std::string& param_key);
// "<format>;block=<r>x<c>;scale=<f32|e8m0|e4m3>;layout=<row_major|mn_major|swizzled_128x4>;
// copies=<rowwise|columnwise|rowwise,columnwise>[;pow2_scale=1]". What the bytes need to be read;
// stochastic rounding (how they were made) is not recorded.
std::string format_quant_metadata(const QuantConfig& config);
// The inverse; throws moe::Error naming `what` on any unknown, missing, repeated or inconsistent field.
QuantConfig parse_quant_metadata(const std::string& value, const std::string& what);

// A parameter that the metadata declares quantized.
struct QuantizedParamDecl {
  std::string key;  // grouped key, e.g. "model.layers.0.mlp.experts.fc1.weight"
  QuantConfig config;
};
// Every "moe.quant.*" entry of `metadata`, parsed, in metadata order.
std::vector<QuantizedParamDecl> quantized_params(const Metadata& metadata);
// Adds or replaces the entry of `param_key`.
void set_quant_metadata(Metadata& metadata, const std::string& param_key, const QuantConfig& config);

// ---- a quantized parameter in a state dict ---------------------------------------------------
struct QuantizedParamInfo {
  std::string key;  // grouped key
  QuantConfig config;
  WeightLayout layout = WeightLayout::kSingleGrouped;
  int experts = 0;
  int64_t rows = 0, cols = 0;  // one expert's matrix
};

// Finds the tensors of quantized parameter `key` (its grouped key) in `sd` and checks them against
// `config`: stored in one layout, every part the config stores present for every expert with its
// dtype and shape, no part it does not store, no expert index past E. `experts` = 0 takes E from
// the tensors (grouped: the first dim; per expert: the consecutive indices). Rows and cols come
// from the data. Accepted on reading besides what quant_part_layout writes: MXFP8 scales as U8,
// NVFP4 data as F4 [.., cols]. Any problem is a moe::Error naming the tensor's key.
QuantizedParamInfo inspect_quantized_param(const StateDict& sd, const std::string& key, const QuantConfig& config,
                                           int experts = 0);

// Any part other than the data (P_scale_inv, ...) of `key` present in sd, grouped or for any
// expert: the key found, or "" (a quantized tensor whose metadata is missing).
std::string find_quant_companion(const StateDict& sd, const std::string& key);

}  // namespace moe
