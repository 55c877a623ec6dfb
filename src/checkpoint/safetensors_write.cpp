// Writing safetensors files in the exact byte layout of the safetensors library (so that a file
// read here and written back is identical to the one the library wrote).
#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/atomic_write.h"
#include "moe/error.h"
#include "moe/safetensors.h"

namespace moe::safetensors {

namespace {

// The library's dtype enum order (BOOL < F4 < U8 < F8_E5M2 < F8_E4M3 < F8_E8M0 < F16 < BF16 <
// I32 < F32 < F64 < I64, leaving out dtypes we do not map); it writes larger ranks first.
int library_rank(DType t) {
  switch (t) {
    case DType::kBool: return 0;
    case DType::kFP4E2M1: return 1;
    case DType::kUInt8: return 2;
    case DType::kFP8E5M2: return 3;
    case DType::kFP8E4M3: return 4;
    case DType::kE8M0: return 5;
    case DType::kFP16: return 6;
    case DType::kBF16: return 7;
    case DType::kInt32: return 8;
    case DType::kFP32: return 9;
    case DType::kFP64: return 10;
    case DType::kInt64: return 11;
  }
  return -1;
}

uint64_t source_bytes(const TensorSource& t) {
  // What the reader accepts: at most kMaxRank dimensions, and a byte count that no product wraps.
  MOE_CHECK(t.shape.size() <= static_cast<size_t>(kMaxRank), "tensor '", t.name, "': ", t.shape.size(),
            " dimensions, at most ", kMaxRank, " supported");
  const int64_t max_numel = std::numeric_limits<int64_t>::max() / dtype_bits(t.dtype);
  int64_t numel = 1;
  for (int64_t s : t.shape) MOE_CHECK(s >= 0, "tensor '", t.name, "': negative dimension ", s);
  for (int64_t s : t.shape) {
    if (s == 0) return 0;
    MOE_CHECK(numel <= max_numel / s, "tensor '", t.name, "': too many elements to address");
    numel *= s;
  }
  const int64_t bits = numel * dtype_bits(t.dtype);
  MOE_CHECK(bits % 8 == 0, "tensor '", t.name, "': ", numel, " elements of ", dtype_name(t.dtype),
            " are not whole bytes");
  return static_cast<uint64_t>(bits / 8);
}

void put_le64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

std::string make_header(std::vector<TensorSource>& tensors, const Metadata& metadata) {
  std::set<std::string> names;
  for (const TensorSource& t : tensors) {
    MOE_CHECK(!t.name.empty(), "safetensors write: a tensor has an empty name");
    MOE_CHECK(t.name != "__metadata__", "safetensors write: '__metadata__' is not a tensor name");
    MOE_CHECK(names.insert(t.name).second, "safetensors write: tensor '", t.name, "' given twice");
    dtype_to_string(t.dtype);  // throws for dtypes the format cannot name
  }
  std::stable_sort(tensors.begin(), tensors.end(), [](const TensorSource& a, const TensorSource& b) {
    const int ra = library_rank(a.dtype), rb = library_rank(b.dtype);
    return ra != rb ? ra > rb : a.name < b.name;
  });

  // ordered_json keeps insertion order: __metadata__ first, then the tensors in data order, and
  // inside an entry dtype, shape, data_offsets -- the library's layout. dump() is compact.
  // The keys are known to be unique (checked with sets), so entries are appended to the ordered map's
  // storage directly: its operator[] searches linearly, quadratic over many tensors.
  using OJson = nlohmann::ordered_json;
  const auto append = [](OJson& object, const std::string& key, OJson value) {
    auto& items = static_cast<std::vector<OJson::object_t::value_type>&>(object.get_ref<OJson::object_t&>());
    items.emplace_back(key, std::move(value));
  };
  OJson h = OJson::object();
  if (!metadata.empty()) {
    OJson m = OJson::object();
    std::set<std::string> keys;
    for (const auto& [k, v] : metadata) {
      MOE_CHECK(keys.insert(k).second, "safetensors write: metadata key '", k, "' given twice");
      append(m, k, v);
    }
    append(h, "__metadata__", std::move(m));
  }
  uint64_t offset = 0;
  for (const TensorSource& t : tensors) {
    const uint64_t n = source_bytes(t);
    nlohmann::ordered_json e = nlohmann::ordered_json::object();
    e["dtype"] = dtype_to_string(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + n};
    append(h, t.name, std::move(e));
    offset += n;
  }
  std::string json;
  try {
    json = h.dump();
  } catch (const nlohmann::ordered_json::exception& e) {  // e.g. a name that is not UTF-8
    detail::throw_error("safetensors write: cannot encode the header (", e.what(), ")");
  }
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  put_le64(out, json.size());
  out += json;
  return out;
}

std::string serialize(std::vector<TensorSource> tensors, const Metadata& metadata) {
  std::string out = make_header(tensors, metadata);
  for (const TensorSource& t : tensors) {
    const uint64_t n = source_bytes(t);
    MOE_CHECK(n == 0 || t.data != nullptr, "tensor '", t.name, "': null data");
    if (n > 0) out.append(static_cast<const char*>(t.data), n);
  }
  return out;
}

void write_file(const std::string& path, std::vector<TensorSource> tensors,
                const Metadata& metadata, const ProgressFn& progress) {
  const std::string header = make_header(tensors, metadata);
  uint64_t total = 0;
  for (const TensorSource& t : tensors) {
    const uint64_t n = source_bytes(t);
    MOE_CHECK(n == 0 || t.data != nullptr, "tensor '", t.name, "': null data");
    total += n;
  }

  detail::write_atomically(path, [&](std::FILE* f) {
    if (std::fwrite(header.data(), 1, header.size(), f) != header.size()) return false;
    // Chunks keep the progress callback lively on multi-GiB tensors.
    constexpr uint64_t kChunk = 64ull << 20;
    uint64_t done = 0;
    if (progress) progress(0, total);
    for (const TensorSource& t : tensors) {
      const uint64_t n = source_bytes(t);
      const char* p = static_cast<const char*>(t.data);
      for (uint64_t at = 0; at < n; at += kChunk) {
        const uint64_t len = std::min(kChunk, n - at);
        if (std::fwrite(p + at, 1, len, f) != len) return false;
        done += len;
        if (progress) progress(done, total);
      }
    }
    return true;
  });
}

}  // namespace moe::safetensors
