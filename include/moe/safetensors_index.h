// Sharded safetensors checkpoints: the index that Hugging Face's save_pretrained writes beside the
// shards when a model is larger than one file (`model.safetensors.index.json`):
//
//   {"metadata": {"total_parameters": N, "total_size": B}, "weight_map": {"<tensor>": "<shard file>", ...}}
//
// Each shard is an ordinary safetensors file in the index's folder. The index is untrusted input:
// read_index() validates it whole (valid JSON without repeated keys, a weight_map of strings, shard
// names that are plain file names ending in ".safetensors" -- no folder, so nothing outside the
// index's folder is ever opened) and names the file in every error.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moe::safetensors {

// Largest index file read (real indexes of 1,000-shard models are a few MiB).
constexpr uint64_t kMaxIndexBytes = 100ull << 20;

struct ShardIndex {
  // Everything of the index but its weight_map ("metadata" and any other member), as JSON text,
  // carried over when the index is written back.
  std::string other_json = "{}";
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name

  // The distinct shard file names, sorted.
  std::vector<std::string> shard_files() const;
};

// Whether `path` names an index ("*.safetensors.index.json").
bool is_index_path(const std::string& path);

// Validates and reads an index held in `text`; `source` names it in errors.
ShardIndex parse_index(const std::string& text, const std::string& source = "index");
// Reads and validates the index at `path`.
ShardIndex read_index(const std::string& path);

// The text write_index writes.
std::string format_index(const ShardIndex& index, int64_t total_size = -1);

// Writes `index` to `path` (atomically, as safetensors files are written), in the form
// save_pretrained writes: members and weight_map keys sorted, two-space indent, a final newline.
// `total_size`: when the index's "metadata" holds a "total_size", it becomes this value (the bytes
// of all the shards' tensors); -1 leaves it as it is.
void write_index(const std::string& path, const ShardIndex& index, int64_t total_size = -1);

}  // namespace moe::safetensors
