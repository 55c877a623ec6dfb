// Sharded checkpoints' index files (include/moe/safetensors_index.h).
#include "moe/safetensors_index.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "checkpoint/atomic_write.h"
#include "checkpoint/json_tokens.h"
#include "checkpoint/key_text.h"
#include "moe/error.h"

namespace moe::safetensors {

namespace {

using Json = nlohmann::json;  // std::map objects: members come out sorted, as save_pretrained sorts them

constexpr char kIndexSuffix[] = ".safetensors.index.json";
constexpr int kMaxIndexDepth = 16;  // an index is two levels deep; metadata values may nest a little

// The index's tokens before the DOM is built: repeated keys (a weight_map naming one tensor twice,
// which a DOM silently collapses to one) and runaway nesting are refused.
struct IndexTokens : detail::JsonShapeTokens {
  explicit IndexTokens(const std::string& source) : where(source) {}
  const std::string& where;
  std::vector<std::set<std::string>> open_keys;  // the keys of each open object
  int depth = 0;

  bool open() {
    MOE_CHECK(++depth <= kMaxIndexDepth, where, ": index JSON nested deeper than ", kMaxIndexDepth, " levels");
    return true;
  }
  bool start_object(std::size_t) override {
    open_keys.emplace_back();
    return open();
  }
  bool end_object() override {
    open_keys.pop_back();
    --depth;
    return true;
  }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override {
    --depth;
    return true;
  }
  bool key(string_t& key) override {
    MOE_CHECK(open_keys.back().insert(key).second, where, ": the index repeats the key '", key, "'");
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    detail::throw_error(where, ": not valid JSON (", e.what(), ")");
  }
};

// A shard name the index may hold: a plain file name in the index's folder.
void check_shard_name(const std::string& shard, const std::string& tensor, const std::string& where) {
  MOE_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard.find('\\') == std::string::npos &&
                shard.find('\0') == std::string::npos && shard != "." && shard != ".." &&
                detail::ends_with(shard, ".safetensors"),
            where, ": tensor '", tensor, "' is mapped to '", shard, "', expected a file name ending in ",
            "\".safetensors\" in the index's folder");
}

}  // namespace

std::vector<std::string> ShardIndex::shard_files() const {
  std::set<std::string> files;
  for (const auto& kv : weight_map) files.insert(kv.second);
  return {files.begin(), files.end()};
}

bool is_index_path(const std::string& path) { return detail::ends_with(path, kIndexSuffix); }

ShardIndex read_index(const std::string& path) {
  struct stat st {};
  MOE_CHECK(::stat(path.c_str(), &st) == 0, path, ": cannot read the index (no such file)");
  MOE_CHECK(S_ISREG(st.st_mode), path, ": the index is not a regular file");
  MOE_CHECK(static_cast<uint64_t>(st.st_size) <= kMaxIndexBytes, path, ": the index holds ", st.st_size,
            " bytes, more than an index can (", kMaxIndexBytes, ")");
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), path, ": cannot open the index");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_index(text, path);
}

ShardIndex parse_index(const std::string& text, const std::string& path) {
  MOE_CHECK(text.size() <= kMaxIndexBytes, path, ": the index holds ", text.size(), " bytes, more than an index can (",
            kMaxIndexBytes, ")");
  MOE_CHECK(text.find('\0') == std::string::npos, path, ": the index holds a NUL byte");
  IndexTokens tokens(path);
  Json::sax_parse(text, &tokens);
  const Json root = Json::parse(text);
  MOE_CHECK(root.is_object(), path, ": expected a JSON object {\"metadata\": ..., \"weight_map\": ...}, got ",
            root.type_name());
  MOE_CHECK(root.contains("weight_map"), path, ": no \"weight_map\" (not a sharded checkpoint's index)");
  const Json& map = root["weight_map"];
  MOE_CHECK(map.is_object(), path, ": \"weight_map\" must be an object {tensor: shard file}, got ", map.type_name());
  MOE_CHECK(!root.contains("metadata") || root["metadata"].is_object(), path, ": \"metadata\" must be an object, got ",
            root["metadata"].type_name());
  ShardIndex index;
  for (const auto& item : map.items()) {
    MOE_CHECK(!item.key().empty(), path, ": the weight_map names a tensor with an empty name");
    MOE_CHECK(item.value().is_string(), path, ": tensor '", item.key(), "' is mapped to ", item.value().dump(),
              ", expected a shard file name");
    const std::string shard = item.value().get<std::string>();
    check_shard_name(shard, item.key(), path);
    index.weight_map.emplace(item.key(), shard);
  }
  Json other = root;
  other.erase("weight_map");
  index.other_json = other.dump();
  return index;
}

std::string format_index(const ShardIndex& index, int64_t total_size) {
  Json root = Json::parse(index.other_json, nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(root.is_object() && !root.contains("weight_map"), "index: other_json must be a JSON object without ",
            "a weight_map, got ", index.other_json);
  Json map = Json::object();
  for (const auto& [tensor, shard] : index.weight_map) {
    check_shard_name(shard, tensor, "index");
    map[tensor] = shard;
  }
  root["weight_map"] = std::move(map);
  if (total_size >= 0 && root.contains("metadata") && root["metadata"].is_object() &&
      root["metadata"].contains("total_size"))
    root["metadata"]["total_size"] = total_size;
  // json.dumps(index, indent=2, sort_keys=True) + "\n", as save_pretrained writes it (ASCII, \u escapes).
  return root.dump(2, ' ', /*ensure_ascii=*/true) + "\n";
}

void write_index(const std::string& path, const ShardIndex& index, int64_t total_size) {
  const std::string text = format_index(index, total_size);
  detail::write_atomically(path, [&](std::FILE* f) { return std::fwrite(text.data(), 1, text.size(), f) == text.size(); });
}

}  // namespace moe::safetensors
