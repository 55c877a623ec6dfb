// Parsing and validation of a safetensors header (see include/moe/safetensors.h for the rules).
// Everything here works on the caller's buffer with explicit bounds; this file is what the
// libFuzzer target in tests/fuzz/ exercises.
#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/json_tokens.h"
#include "moe/error.h"
#include "moe/safetensors.h"

namespace moe::safetensors {

namespace {

using Json = nlohmann::json;

struct DTypeName {
  DType type;
  const char* name;
};
constexpr DTypeName kNames[] = {
    {DType::kBF16, "BF16"},       {DType::kFP16, "F16"},        {DType::kFP32, "F32"},     {DType::kFP64, "F64"},
    {DType::kInt32, "I32"},       {DType::kInt64, "I64"},       {DType::kUInt8, "U8"},     {DType::kBool, "BOOL"},
    {DType::kFP8E4M3, "F8_E4M3"}, {DType::kFP8E5M2, "F8_E5M2"}, {DType::kE8M0, "F8_E8M0"}, {DType::kFP4E2M1, "F4"},
};

// The deepest container a valid header has: root object (0) > entry object (1) > shape array (2).
constexpr int kMaxContainerDepth = 2;

// The header's tokens in order (nlohmann's SAX interface), before the DOM is built: rejects nesting
// a header never has (bounding memory and recursion) and repeated keys (which a DOM silently
// collapses to one), and records __metadata__'s key order (the DOM's map forgets it).
struct HeaderTokens : detail::JsonShapeTokens {
  explicit HeaderTokens(const std::string& source) : where(source) {}
  const std::string& where;
  std::vector<bool> open_is_object;             // the open containers, innermost last
  std::vector<std::set<std::string>> open_keys;  // the keys of each open object
  std::string root_key;                          // the root key whose value is being read
  std::vector<std::string> metadata_order;

  bool open(bool object) {
    if (static_cast<int>(open_is_object.size()) > kMaxContainerDepth)
      detail::throw_error(where, ": header JSON nested deeper than a safetensors header");
    open_is_object.push_back(object);
    if (object) open_keys.emplace_back();
    return true;
  }
  bool close() {
    if (open_is_object.back()) open_keys.pop_back();
    open_is_object.pop_back();
    return true;
  }
  bool start_object(std::size_t) override { return open(true); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_array() override { return close(); }
  bool key(string_t& key) override {
    MOE_CHECK(open_keys.back().insert(key).second, where, ": header repeats the key '", key, "'");
    if (open_is_object.size() == 1) root_key = key;
    else if (open_is_object.size() == 2 && root_key == "__metadata__") metadata_order.push_back(key);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    detail::throw_error(where, ": header is not valid JSON (", e.what(), ")");
  }
};

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON value that must be a non-negative integer (a float, a negative or an out-of-range
// number is rejected, never truncated).
uint64_t as_u64(const Json& v, const std::string& what) {
  MOE_CHECK(v.is_number_unsigned(), what, ": expected a non-negative integer, got ", v.dump());
  return v.get<uint64_t>();
}

TensorEntry parse_entry(const std::string& name, const Json& v, const std::string& where) {
  const std::string what = where + ": tensor '" + name + "'";
  MOE_CHECK(!name.empty(), where, ": a tensor has an empty name");
  MOE_CHECK(v.is_object(), what, ": expected an object {dtype, shape, data_offsets}, got ", v.type_name());
  for (const auto& item : v.items()) {
    const std::string& k = item.key();
    MOE_CHECK(k == "dtype" || k == "shape" || k == "data_offsets", what, ": unexpected field '", k, "'");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"})
    MOE_CHECK(v.contains(field), what, ": missing field '", field, "'");

  TensorEntry t;
  t.name = name;
  const Json& dtype = v["dtype"];
  MOE_CHECK(dtype.is_string(), what, ": 'dtype' must be a string, got ", dtype.dump());
  t.dtype = dtype_from_string(dtype.get<std::string>(), what);

  const Json& shape = v["shape"];
  MOE_CHECK(shape.is_array(), what, ": 'shape' must be an array, got ", shape.dump());
  MOE_CHECK(shape.size() <= static_cast<size_t>(kMaxRank), what, ": ", shape.size(), " dimensions, at most ",
            kMaxRank, " supported");
  uint64_t numel = 1;
  for (const Json& d : shape) {
    const uint64_t s = as_u64(d, what + " shape");
    MOE_CHECK(s <= static_cast<uint64_t>(INT64_MAX), what, ": dimension ", s, " too large");
    MOE_CHECK(!__builtin_mul_overflow(numel, s, &numel) && numel <= static_cast<uint64_t>(INT64_MAX), what,
              ": shape ", shape.dump(), " has too many elements");
    t.shape.push_back(static_cast<int64_t>(s));
  }

  const Json& off = v["data_offsets"];
  MOE_CHECK(off.is_array() && off.size() == 2, what, ": 'data_offsets' must be [begin, end], got ", off.dump());
  t.begin = as_u64(off[0], what + " data_offsets");
  t.end = as_u64(off[1], what + " data_offsets");
  MOE_CHECK(t.begin <= t.end, what, ": data_offsets [", t.begin, ", ", t.end, "] end before they begin");

  // numel x bits must be whole bytes (packed FP4 with an odd count is not representable).
  uint64_t bits = 0;
  MOE_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_bits(t.dtype)), &bits), what, ": shape ",
            shape.dump(), " has too many elements");
  MOE_CHECK(bits % 8 == 0, what, ": ", numel, " elements of ", dtype_to_string(t.dtype), " are not whole bytes");
  MOE_CHECK(bits / 8 == t.nbytes(), what, ": ", dtype_to_string(t.dtype), " ", shape.dump(), " needs ", bits / 8,
            " bytes, data_offsets [", t.begin, ", ", t.end, "] hold ", t.nbytes());
  return t;
}

// Tensors must tile [0, data_size): sorted by offset, each starts where the previous ended.
void check_tiling(std::vector<TensorEntry>& tensors, uint64_t data_size, const std::string& where) {
  for (const TensorEntry& t : tensors)
    MOE_CHECK(t.end <= data_size, where, ": tensor '", t.name, "' data_offsets [", t.begin, ", ", t.end,
              "] run past the end of the data section (", data_size, " bytes)");
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  const TensorEntry* prev = nullptr;
  for (const TensorEntry& t : tensors) {
    MOE_CHECK(t.begin >= pos, where, ": tensor '", t.name, "' [", t.begin, ", ", t.end, ") overlaps tensor '",
              prev ? prev->name : "", "' [", prev ? prev->begin : 0, ", ", pos, ")");
    MOE_CHECK(t.begin == pos, where, ": ", t.begin - pos, " bytes at [", pos, ", ", t.begin,
              ") of the data section belong to no tensor (before tensor '", t.name, "')");
    pos = t.end;
    prev = &t;
  }
  MOE_CHECK(pos == data_size, where, ": ", data_size - pos, " bytes after the last tensor belong to no tensor");
}

}  // namespace

const char* dtype_to_string(DType t) {
  for (const auto& n : kNames)
    if (n.type == t) return n.name;
  detail::throw_error("safetensors: dtype ", dtype_name(t), " has no safetensors name");
}

DType dtype_from_string(const std::string& name, const std::string& what) {
  for (const auto& n : kNames)
    if (name == n.name) return n.type;
  std::string known;
  for (const auto& n : kNames) known += std::string(known.empty() ? "" : ", ") + n.name;
  detail::throw_error(what, ": unknown dtype '", name, "' (supported: ", known, ")");
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;  // validated against overflow when parsed
  return n;
}

const std::string* find_metadata(const Metadata& metadata, const std::string& key) {
  for (const auto& [k, v] : metadata)
    if (k == key) return &v;
  return nullptr;
}

const TensorEntry* Header::find(const std::string& name) const {
  for (const TensorEntry& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Header parse_header(const uint8_t* data, size_t size, const std::string& source) {
  const std::string& where = source;
  MOE_CHECK(data != nullptr || size == 0, where, ": null buffer");
  MOE_CHECK(size >= 8, where, ": ", size, " bytes, too short for the 8-byte header length");
  const uint64_t n = read_le64(data);
  MOE_CHECK(n <= kMaxHeaderBytes, where, ": header length ", n, " exceeds the limit of ", kMaxHeaderBytes,
            " bytes");
  MOE_CHECK(n <= size - 8, where, ": header length ", n, " runs past the end of the file (", size, " bytes)");
  MOE_CHECK(n >= 2 && data[8] == '{', where, ": header is not a JSON object");

  const char* first = reinterpret_cast<const char*>(data + 8);
  const char* last = first + n;
  // A NUL byte is never valid JSON (strings escape it), and the JSON reader would take it for the
  // end of the input, accepting whatever follows.
  MOE_CHECK(std::memchr(first, 0, n) == nullptr, where, ": header contains a NUL byte");
  // First pass over the tokens, then the DOM (a DOM parse with a per-token callback would do both
  // but rescans the parent object at every closing brace: quadratic in the number of tensors).
  HeaderTokens tokens(where);
  try {
    Json::sax_parse(first, last, &tokens, nlohmann::detail::input_format_t::json, /*strict=*/true,
                    /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    detail::throw_error(where, ": header is not valid JSON (", e.what(), ")");
  }
  const std::vector<std::string>& metadata_order = tokens.metadata_order;
  Json root;
  try {
    root = Json::parse(first, last, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const Json::exception& e) {
    detail::throw_error(where, ": header is not valid JSON (", e.what(), ")");
  }
  MOE_CHECK(root.is_object(), where, ": header is not a JSON object");

  Header h;
  h.data_start = 8 + n;
  h.data_size = size - h.data_start;
  for (const auto& item : root.items()) {
    if (item.key() == "__metadata__") {
      MOE_CHECK(item.value().is_object(), where, ": __metadata__ must be an object of strings");
      MOE_CHECK(metadata_order.size() == item.value().size(), where, ": __metadata__ could not be read in order");
      for (const std::string& k : metadata_order) {
        auto it = item.value().find(k);
        MOE_CHECK(it != item.value().end(), where, ": __metadata__ could not be read in order");
        const Json& v = *it;
        MOE_CHECK(v.is_string(), where, ": __metadata__ '", k, "' must be a string, got ", v.dump());
        h.metadata.emplace_back(k, v.get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(item.key(), item.value(), where));
  }
  check_tiling(h.tensors, h.data_size, where);
  return h;
}

}  // namespace moe::safetensors
