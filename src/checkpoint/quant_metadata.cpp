// Names of the tensors of a quantized parameter and the __metadata__ entry recording its format
// (include/moe/checkpoint_quant.h).
#include <set>

#include "moe/checkpoint_quant.h"
#include "moe/error.h"

namespace moe {

namespace {

const char* layout_name(ScaleLayout l) {
  switch (l) {
    case ScaleLayout::kRowMajor: return "row_major";
    case ScaleLayout::kMNMajor: return "mn_major";
    case ScaleLayout::kSwizzled128x4: return "swizzled_128x4";
  }
  detail::throw_error("scale layout: unknown enum value ", static_cast<int>(l));
}

// The stored scale's name in the metadata: fp32 scale_inv, E8M0 exponent, E4M3 scale.
const char* scale_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kFP8Block: return "f32";
    case QuantFormat::kMXFP8: return "e8m0";
    case QuantFormat::kNVFP4: return "e4m3";
  }
  detail::throw_error("quant format: unknown enum value ", static_cast<int>(f));
}

std::string block_name(const QuantConfig& c) {
  const std::string b = std::to_string(quant_block_size(c.format));
  return (c.blocking == QuantBlocking::k2D ? b : std::string("1")) + "x" + b;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

ScaleLayout parse_layout(const std::string& v, const std::string& where, const char* field) {
  for (ScaleLayout l : {ScaleLayout::kRowMajor, ScaleLayout::kMNMajor, ScaleLayout::kSwizzled128x4})
    if (v == layout_name(l)) return l;
  detail::throw_error(where, ": unknown ", field, " '", v, "' (expected row_major, mn_major or swizzled_128x4)");
}

}  // namespace

const char* quant_part_suffix(QuantPart part) {
  switch (part) {
    case QuantPart::kData: return "";
    case QuantPart::kScale: return "_scale_inv";
    case QuantPart::kColumnwiseData: return "_columnwise";
    case QuantPart::kColumnwiseScale: return "_columnwise_scale_inv";
    case QuantPart::kGlobalAmax: return "_amax";
  }
  detail::throw_error("quant part: unknown enum value ", static_cast<int>(part));
}

std::string quant_part_key(const std::string& key, QuantPart part) { return key + quant_part_suffix(part); }

bool quant_stores(const QuantConfig& c, QuantPart part) {
  switch (part) {
    case QuantPart::kData:
    case QuantPart::kScale: return c.rowwise;
    case QuantPart::kColumnwiseData:
    case QuantPart::kColumnwiseScale: return c.columnwise;
    case QuantPart::kGlobalAmax: return c.format == QuantFormat::kNVFP4;
  }
  return false;
}

std::string quant_metadata_key(const std::string& param_key) { return kQuantMetadataPrefix + param_key; }

std::string format_quant_metadata(const QuantConfig& c) {
  validate_quant_config(c, "config");
  std::string s = quant_format_name(c.format);
  s += ";block=" + block_name(c);
  s += std::string(";scale=") + scale_name(c.format);
  s += std::string(";layout=") + layout_name(c.scale_layout);
  if (c.columnwise_scale_layout) s += std::string(";columnwise_layout=") + layout_name(*c.columnwise_scale_layout);
  const char* copies = c.rowwise && c.columnwise ? "rowwise,columnwise" : c.rowwise ? "rowwise" : "columnwise";
  s += std::string(";copies=") + copies;
  if (c.pow2_scale) s += ";pow2_scale=1";
  return s;
}

QuantConfig parse_quant_metadata(const std::string& value, const std::string& what) {
  const std::string where = what + " = '" + value + "'";
  const std::vector<std::string> fields = split(value, ';');
  QuantConfig c;
  bool known = false;
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4})
    if (fields[0] == quant_format_name(f)) c.format = f, known = true;
  MOE_CHECK(known, where, ": unknown format '", fields[0], "' (expected fp8_block, mxfp8 or nvfp4)");

  std::set<std::string> seen;
  std::string block, scale, layout, columnwise_layout, copies;
  for (size_t i = 1; i < fields.size(); ++i) {
    const size_t eq = fields[i].find('=');
    MOE_CHECK(eq != std::string::npos, where, ": field '", fields[i], "' is not name=value");
    const std::string name = fields[i].substr(0, eq), v = fields[i].substr(eq + 1);
    MOE_CHECK(seen.insert(name).second, where, ": field '", name, "' given twice");
    if (name == "block") {
      block = v;
    } else if (name == "scale") {
      scale = v;
    } else if (name == "layout") {
      layout = v;
    } else if (name == "columnwise_layout") {
      columnwise_layout = v;
    } else if (name == "copies") {
      copies = v;
    } else if (name == "pow2_scale") {
      MOE_CHECK(v == "0" || v == "1", where, ": pow2_scale must be 0 or 1, got '", v, "'");
      c.pow2_scale = v == "1";
    } else {
      detail::throw_error(where, ": unknown field '", name, "' (expected block, scale, layout, columnwise_layout, copies, pow2_scale)");
    }
  }
  for (const char* required : {"block", "scale", "layout", "copies"})
    MOE_CHECK(seen.count(required), where, ": missing field '", required, "'");

  const std::string b = std::to_string(quant_block_size(c.format));
  if (block == "1x" + b) {
    c.blocking = QuantBlocking::k1D;
  } else if (block == b + "x" + b) {
    c.blocking = QuantBlocking::k2D;
  } else {
    detail::throw_error(where, ": block '", block, "' is not a ", quant_format_name(c.format), " block (1x", b, " or ",
                        b, "x", b, ")");
  }
  MOE_CHECK(scale == scale_name(c.format), where, ": scale '", scale, "' is not the ", quant_format_name(c.format),
            " scale '", scale_name(c.format), "'");
  c.scale_layout = parse_layout(layout, where, "layout");
  if (seen.count("columnwise_layout")) c.columnwise_scale_layout = parse_layout(columnwise_layout, where, "columnwise_layout");
  c.rowwise = copies == "rowwise" || copies == "rowwise,columnwise";
  c.columnwise = copies == "columnwise" || copies == "rowwise,columnwise";
  MOE_CHECK(c.rowwise || c.columnwise, where, ": copies '", copies,
            "' (expected rowwise, columnwise or rowwise,columnwise)");
  validate_quant_config(c, what.c_str());  // e.g. mxfp8 with 2-D blocks, mn_major for nvfp4
  return c;
}

std::vector<QuantizedParamDecl> quantized_params(const Metadata& metadata) {
  std::vector<QuantizedParamDecl> out;
  const std::string prefix = kQuantMetadataPrefix;
  for (const auto& [k, v] : metadata) {
    if (k.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string key = k.substr(prefix.size());
    MOE_CHECK(!key.empty(), "__metadata__ '", k, "': names no tensor");
    out.push_back({key, parse_quant_metadata(v, "__metadata__ '" + k + "'")});
  }
  return out;
}

void set_quant_metadata(Metadata& metadata, const std::string& param_key, const QuantConfig& config) {
  const std::string k = quant_metadata_key(param_key), v = format_quant_metadata(config);
  for (auto& kv : metadata)
    if (kv.first == k) {
      kv.second = v;
      return;
    }
  metadata.emplace_back(k, v);
}

}  // namespace moe
