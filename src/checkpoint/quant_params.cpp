// The tensors of a quantized parameter in a state dict: their dtypes and shapes, and the check of
// a stored parameter against its format (include/moe/checkpoint_quant.h).
#include <cstdint>
#include <utility>
#include <vector>

#include "checkpoint/key_list.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"

namespace moe {

namespace {

const char* part_name(QuantPart part) {
  switch (part) {
    case QuantPart::kData: return "rowwise data";
    case QuantPart::kScale: return "rowwise scales";
    case QuantPart::kColumnwiseData: return "columnwise data";
    case QuantPart::kColumnwiseScale: return "columnwise scales";
    case QuantPart::kGlobalAmax: return "global amax";
  }
  return "?";
}

// One tensor under `key`: the expert index (-1 when grouped) and the part, parsed from what
// follows the key ("", "_scale_inv", "3", "3_amax", ...). False when it is no part of ours.
bool parse_part_key(const std::string& rest, int64_t* index, QuantPart* part) {
  size_t digits = 0;
  while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  const std::string suffix = rest.substr(digits);
  bool found = false;
  for (QuantPart p : kQuantParts)
    if (suffix == quant_part_suffix(p)) *part = p, found = true;
  if (!found) return false;
  if (digits == 0) {
    *index = -1;
    return true;
  }
  // A canonical index ("0", "17", not "07"); anything else is a tensor of another name.
  if (digits > 9 || (digits > 1 && rest[0] == '0')) return false;
  *index = std::stoll(rest.substr(0, digits));
  return true;
}

std::vector<int64_t> prepend(int64_t E, std::vector<int64_t> shape) {
  shape.insert(shape.begin(), E);
  return shape;
}

}  // namespace

QuantPartLayout quant_part_layout(const QuantConfig& c, QuantPart part, int64_t rows, int64_t cols) {
  validate_quant_config(c, "config");
  MOE_CHECK(rows >= 0 && cols >= 0, "quant_part_layout: negative matrix size [", rows, ", ", cols, "]");
  MOE_CHECK(quant_stores(c, part), "quant_part_layout: ", format_quant_metadata(c), " stores no ", part_name(part));
  const bool fp4 = c.format == QuantFormat::kNVFP4;
  QuantPartLayout l;
  switch (part) {
    case QuantPart::kData:
    case QuantPart::kColumnwiseData: {
      const bool col = part == QuantPart::kColumnwiseData;
      const int64_t r = col ? cols : rows, k = col ? rows : cols;
      MOE_CHECK(!fp4 || k % 2 == 0, "quant_part_layout: nvfp4 ", part_name(part), " [", r, ", ", k,
                "] packs two values per byte, its rows must have an even length");
      l.dtype = fp4 ? DType::kUInt8 : DType::kFP8E4M3;
      l.shape = {r, fp4 ? k / 2 : k};
      break;
    }
    case QuantPart::kScale:
    case QuantPart::kColumnwiseScale: {
      const bool col = part == QuantPart::kColumnwiseScale;
      const ScaleShape s = scale_shape(c, col ? cols : rows, col ? rows : cols, col);
      l.dtype = s.dtype;
      l.shape = {s.rows, s.cols};
      break;
    }
    case QuantPart::kGlobalAmax:
      l.dtype = DType::kFP32;
      l.shape = {};
      break;
  }
  return l;
}

std::string find_quant_companion(const StateDict& sd, const std::string& key) {
  // Every key that is `key`, then an expert index (none for grouped), then a part's suffix: a stray
  // companion of any expert, not only of expert 0, is found.
  // The parts in their order, the first key found of each.
  for (QuantPart p : kQuantParts) {
    if (p == QuantPart::kData) continue;
    for (auto it = sd.lower_bound(key); it != sd.end() && it->first.compare(0, key.size(), key) == 0; ++it) {
      size_t at = key.size();
      while (at < it->first.size() && it->first[at] >= '0' && it->first[at] <= '9') ++at;
      if (it->first.compare(at, std::string::npos, quant_part_suffix(p)) == 0) return it->first;
    }
  }
  return "";
}

QuantizedParamInfo inspect_quantized_param(const StateDict& sd, const std::string& key, const QuantConfig& config,
                                           int experts) {
  validate_quant_config(config, "config");
  MOE_CHECK(experts >= 0, "argument 'experts': expected >= 0, got ", experts);
  const std::string format = format_quant_metadata(config);
  const std::string what = "state dict: quantized '" + key + "' (" + format + ")";

  // Every tensor of ours under `key`, by form.
  std::string grouped_hit;
  std::vector<std::pair<std::string, int64_t>> per_expert_hits;
  for (auto it = sd.lower_bound(key); it != sd.end() && it->first.compare(0, key.size(), key) == 0; ++it) {
    int64_t index;
    QuantPart part;
    if (!parse_part_key(it->first.substr(key.size()), &index, &part)) continue;
    MOE_CHECK(quant_stores(config, part), what, ": '", it->first, "' is present, but the format stores no ",
              part_name(part));
    if (index < 0) {
      if (grouped_hit.empty()) grouped_hit = it->first;
    } else {
      per_expert_hits.emplace_back(it->first, index);
    }
  }
  const std::string per_expert_hit = per_expert_hits.empty() ? "" : per_expert_hits[0].first;
  MOE_CHECK(!grouped_hit.empty() || !per_expert_hit.empty(), what, ": no tensor of it is present (expected '",
            quant_part_key(key, config.rowwise ? QuantPart::kData : QuantPart::kColumnwiseData), "' or '",
            quant_part_key(key + "0", config.rowwise ? QuantPart::kData : QuantPart::kColumnwiseData), "', ...)");
  MOE_CHECK(grouped_hit.empty() || per_expert_hit.empty(), what, ": stored both single grouped ('", grouped_hit,
            "') and per expert ('", per_expert_hit, "')");

  QuantizedParamInfo info;
  info.key = key;
  info.config = config;
  info.layout = grouped_hit.empty() ? WeightLayout::kPerExpert : WeightLayout::kSingleGrouped;
  const bool grouped = info.layout == WeightLayout::kSingleGrouped;

  // Rows and cols (and, grouped, E) from the data: the rowwise copy [rows, cols], else the
  // columnwise copy [cols, rows].
  const QuantPart anchor_part = config.rowwise ? QuantPart::kData : QuantPart::kColumnwiseData;
  const std::string anchor = quant_part_key(grouped ? key : key + "0", anchor_part);
  auto found = sd.find(anchor);
  MOE_CHECK(found != sd.end(), what, ": missing '", anchor, "' (", part_name(anchor_part), ")");
  const HostTensor& a = found->second;
  MOE_CHECK(a.ndim() == (grouped ? 3 : 2), what, ": '", anchor, "' has shape ", a.shape_string(), ", expected ",
            grouped ? "[E, " : "[", config.rowwise ? "rows, cols]" : "cols, rows]");
  const bool packed = config.format == QuantFormat::kNVFP4 && a.dtype() == DType::kUInt8;
  // An expert weight holds data (as unquantized layers must): an empty one would leave E unbounded by
  // the file's bytes, and every per-expert loop after this would run and allocate E times. Its
  // dimensions stay far from where the scale shapes' arithmetic could overflow.
  MOE_CHECK(a.size(-2) > 0 && a.size(-1) > 0 && a.size(-2) <= INT32_MAX && a.size(-1) <= INT32_MAX, what, ": '",
            anchor, "' ", a.shape_string(), " holds no weights or a matrix past 2^31 - 1 rows or columns");
  const int64_t outer = a.size(-2), inner = packed ? 2 * a.size(-1) : a.size(-1);
  info.rows = config.rowwise ? outer : inner;
  info.cols = config.rowwise ? inner : outer;
  if (grouped) {
    MOE_CHECK(a.size(0) >= 1 && a.size(0) <= INT32_MAX, what, ": '", anchor, "' ", a.shape_string(),
              " holds no experts");
    info.experts = static_cast<int>(a.size(0));
    MOE_CHECK(experts == 0 || info.experts == experts, what, ": '", anchor, "' ", a.shape_string(), " holds ",
              info.experts, " experts, expected ", experts);
  } else if (experts > 0) {
    info.experts = experts;
    for (const auto& [k, index] : per_expert_hits)
      MOE_CHECK(index < experts, what, ": '", k, "' names no expert of the layer's ", experts);
  } else {
    // E = the experts whose data is present from 0 on (bounded by the keys, whatever indices an
    // untrusted file holds); a tensor of a later expert means a gap.
    while (info.experts < INT32_MAX && sd.count(quant_part_key(key + std::to_string(info.experts), anchor_part)))
      ++info.experts;
    for (const auto& [k, index] : per_expert_hits)
      MOE_CHECK(index < info.experts, what, ": missing '",
                quant_part_key(key + std::to_string(info.experts), anchor_part), "' (", part_name(anchor_part),
                ") while '", k, "' is present");
  }

  // Every part the format stores, for every expert, with its dtype and shape.
  detail::KeyList missing;
  for (QuantPart p : kQuantParts) {
    if (!quant_stores(config, p)) continue;
    QuantPartLayout l = quant_part_layout(config, p, info.rows, info.cols);
    if (grouped) l.shape = prepend(info.experts, l.shape);
    for (int e = grouped ? -1 : 0; e < (grouped ? 0 : info.experts); ++e) {
      const std::string k = quant_part_key(grouped ? key : key + std::to_string(e), p);
      auto it = sd.find(k);
      if (it == sd.end()) {
        if (missing.full())
          missing.skip();
        else
          missing.add(k);
        continue;
      }
      const HostTensor& t = it->second;
      // Also read: MXFP8 scales as raw U8, NVFP4 data as F4 (shape in values, not bytes).
      const bool fp4_data = config.format == QuantFormat::kNVFP4 &&
                            (p == QuantPart::kData || p == QuantPart::kColumnwiseData) &&
                            t.dtype() == DType::kFP4E2M1;
      std::vector<int64_t> expected = l.shape;
      if (fp4_data) expected.back() *= 2;
      const bool dtype_ok = t.dtype() == l.dtype || fp4_data ||
                            (l.dtype == DType::kE8M0 && t.dtype() == DType::kUInt8);
      MOE_CHECK(dtype_ok, what, ": '", k, "' (", part_name(p), ") has dtype ", safetensors::dtype_to_string(t.dtype()),
                ", expected ", safetensors::dtype_to_string(l.dtype));
      MOE_CHECK(t.shape() == expected, what, ": '", k, "' (", part_name(p), ") has shape ", t.shape_string(),
                ", expected ", shape_string(expected), " for ",
                grouped ? std::to_string(info.experts) + " experts of " : "", "[", info.rows, ", ", info.cols, "]");
    }
  }
  MOE_CHECK(missing.empty(), what, ": missing ", missing.str());
  return info;
}

}  // namespace moe
