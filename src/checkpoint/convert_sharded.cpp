// Conversion of sharded checkpoints (convert_sharded_checkpoint in include/moe/checkpoint_convert.h):
// every shard memory-mapped, the expert layers found over all of them, then each output shard
// converted and written in turn, the index last.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>


#include "checkpoint/dequantize.h"
#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"
#include "moe/safetensors_index.h"

namespace moe {

namespace {

namespace fs = std::filesystem;

// The index a folder holds: exactly one "*.safetensors.index.json".
std::string index_in_folder(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (safetensors::is_index_path(entry.path().filename().string())) found.push_back(entry.path().string());
  MOE_CHECK(!ec, dir, ": cannot list the folder (", ec.message(), ")");
  MOE_CHECK(found.size() == 1, dir, ": ", found.empty() ? "holds no" : "holds more than one",
            " *.safetensors.index.json (give the index file, or a single .safetensors file)");
  return found[0];
}

bool is_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

struct Shard {
  std::string file;  // name in the folder
  StateDict tensors;
  Metadata metadata;
};

bool is_quant_entry(const std::string& key) {
  const std::string quant = kQuantMetadataPrefix;
  return key.compare(0, quant.size(), quant) == 0;
}

// The quantized parameters' __metadata__ entries of all shards as one list (a layer's entries may sit
// in any shard); one that two shards give different values is an error. Other entries are each
// shard's own.
Metadata merged_metadata(const std::vector<Shard>& shards) {
  Metadata all;
  std::map<std::string, std::pair<std::string, std::string>> seen;  // key -> (value, shard)
  for (const Shard& s : shards)
    for (const auto& [key, value] : s.metadata) {
      if (!is_quant_entry(key)) continue;
      auto it = seen.find(key);
      if (it == seen.end()) {
        seen.emplace(key, std::pair{value, s.file});
        all.emplace_back(key, value);
      } else {
        MOE_CHECK(it->second.first == value, "__metadata__ '", key, "' differs between the shards ",
                  it->second.second, " and ", s.file);
      }
    }
  return all;
}

// Whether any part of parameter `key` (grouped "<key>", or per expert "<key>0"; its data or a companion:
// a columnwise-only weight has no "<key>") is among `tensors`.
bool holds_param(const StateDict& tensors, const std::string& key) {
  for (QuantPart part : kQuantParts)
    if (tensors.count(quant_part_key(key, part)) || tensors.count(quant_part_key(key + "0", part))) return true;
  return false;
}

// An output shard's __metadata__: the input shard's entries in their order, except that the quantized
// parameters' entries ("moe.quant.<key>", after the conversion) go with their parameter's data --
// kept or added where the shard holds it, dropped where it does not (a layer converted into another
// shard, or into Hugging Face naming).
Metadata metadata_for(const Metadata& own, const Metadata& declared, const StateDict& tensors) {
  const size_t quant = std::string(kQuantMetadataPrefix).size();
  Metadata out;
  std::set<std::string> placed;
  for (const auto& [k, v] : own) {
    if (!is_quant_entry(k)) {
      out.emplace_back(k, v);
    } else if (const std::string* now = safetensors::find_metadata(declared, k);
               now && holds_param(tensors, k.substr(quant))) {
      out.emplace_back(k, *now);
      placed.insert(k);
    }
  }
  for (const auto& [k, v] : declared)  // every entry of `declared` is a moe.quant one (merged_metadata)
    if (!placed.count(k) && holds_param(tensors, k.substr(quant))) out.emplace_back(k, v);
  return out;
}

}  // namespace

bool is_sharded_checkpoint(const std::string& in) {
  return safetensors::is_index_path(in) || is_folder(in);
}

std::vector<std::string> convert_sharded_checkpoint(const std::string& in, const std::string& out,
                                                    const ConvertOptions& options,
                                                    const safetensors::ProgressFn& progress) {
  const ConvertOptions o = families_from_config(options, in);
  const std::string index_path = is_folder(in) ? index_in_folder(in) : in;
  const safetensors::ShardIndex index = safetensors::read_index(index_path);
  const fs::path folder = fs::path(index_path).parent_path().empty() ? fs::path(".") : fs::path(index_path).parent_path();
  MOE_CHECK(!index.weight_map.empty(), index_path, ": the weight_map maps no tensor");

  // Every shard read (memory-mapped) and checked against the index, before anything is written.
  std::vector<Shard> shards;
  std::map<std::string, size_t> shard_of_file;
  StateDict all;  // borrowed views of every shard's tensors
  uint64_t total_bytes = 0;
  for (const std::string& file : index.shard_files()) {
    Shard s{file, {}, {}};
    s.tensors = load_safetensors((folder / file).string(), &s.metadata);
    for (const auto& [key, t] : s.tensors) {
      auto it = index.weight_map.find(key);
      MOE_CHECK(it != index.weight_map.end() && it->second == file, (folder / file).string(), ": tensor '", key,
                "' is ", it == index.weight_map.end() ? "not in the index" : "mapped to " + it->second + " by the index");
      all.emplace(key, t);
      total_bytes += static_cast<uint64_t>(t.nbytes());
    }
    shard_of_file[file] = shards.size();
    shards.push_back(std::move(s));
  }
  for (const auto& [key, file] : index.weight_map)
    MOE_CHECK(all.count(key), index_path, ": maps tensor '", key, "' to ", file, ", which does not hold it");

  // Every expert layer, selected or not, is gathered whole into one shard -- the one holding the first
  // of its input keys -- so that each shard's conversion sees complete layers only.
  const Metadata metadata = merged_metadata(shards);
  const auto layers = expert_layer_keys(all, o, metadata);
  for (const std::string& prefix : o.prefixes)
    MOE_CHECK(layers.count(prefix), "argument 'prefixes': no expert layer in ", o.from.name(), " naming under '",
              prefix, "'");
  auto selected = [&](const std::string& prefix) {
    return o.prefixes.empty() || std::find(o.prefixes.begin(), o.prefixes.end(), prefix) != o.prefixes.end();
  };
  std::map<std::string, std::string> layer_of_key;
  std::map<size_t, std::vector<std::string>> layers_of_shard;
  for (const auto& [prefix, keys] : layers) {
    for (const std::string& k : keys) layer_of_key[k] = prefix;
    const std::string first = *std::min_element(keys.begin(), keys.end());
    layers_of_shard[shard_of_file.at(index.weight_map.at(first))].push_back(prefix);
  }

  // Dequantizing, every FP8 weight outside the expert layers is decoded in its own shard: its block
  // scales are brought there from whichever shard holds them. All of them are checked here, before
  // anything is written.
  std::map<std::string, size_t> scale_to_shard;
  std::set<std::string> layer_keys;
  for (const auto& kv : layer_of_key) layer_keys.insert(kv.first);
  if (o.dequantize) {
    for (const std::string& k : detail::fp8_block_weights(all, layer_keys, metadata)) {
      const std::string scale = k + kFp8ScaleSuffix;
      detail::check_fp8_block_scales(k, all.at(k), all.at(scale));
      const size_t weight_shard = shard_of_file.at(index.weight_map.at(k));
      if (shard_of_file.at(index.weight_map.at(scale)) != weight_shard) scale_to_shard[scale] = weight_shard;
    }
  }

  // The output folder, once the input is known to convert: created if absent, never the input's (its
  // shards are read while the new ones are written).
  std::error_code ec;
  MOE_CHECK(fs::path(out).extension() != ".safetensors" || is_folder(out), out, ": a sharded checkpoint is ",
            "written into a folder of shards, and this names a .safetensors file; give a folder");
  if (!fs::exists(out, ec)) {
    MOE_CHECK(fs::create_directory(out, ec), out, ": cannot create the output folder (", ec.message(), ")");
  }
  MOE_CHECK(is_folder(out), out, ": a sharded checkpoint is written into a folder, and this is not one");
  MOE_CHECK(!fs::equivalent(out, folder, ec), out, ": is the input's folder; write the converted shards elsewhere");

  // An index left in the folder by an earlier conversion goes first: until this one writes its own,
  // the folder holds no index (the shards it may still hold belong to no checkpoint).
  const std::string index_out = (fs::path(out) / fs::path(index_path).filename()).string();
  MOE_CHECK(!fs::exists(index_out, ec) || fs::remove(index_out, ec), index_out, ": cannot remove the index an ",
            "earlier conversion left (", ec.message(), ")");

  safetensors::ShardIndex written;
  written.other_json = index.other_json;
  uint64_t done = 0;
  int64_t size = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    Shard& s = shards[i];
    // Progress counts input bytes (the total known up front): this shard's own, spread over its write.
    uint64_t input_bytes = 0;
    for (const auto& kv : s.tensors) input_bytes += static_cast<uint64_t>(kv.second.nbytes());
    const uint64_t before = done;
    done += input_bytes;
    StateDict sd;
    for (const auto& [key, t] : s.tensors)
      if (!layer_of_key.count(key) && !scale_to_shard.count(key)) sd.emplace(key, t);
    for (const auto& [scale, shard] : scale_to_shard)
      if (shard == i) sd.emplace(scale, all.at(scale));
    ConvertOptions shard_options = o;
    shard_options.prefixes.clear();
    for (const std::string& prefix : layers_of_shard[i]) {
      for (const std::string& k : layers.at(prefix)) sd.emplace(k, all.at(k));
      if (selected(prefix)) shard_options.prefixes.push_back(prefix);
    }
    Metadata converted = metadata;
    if (!shard_options.prefixes.empty()) {
      convert_state_dict(sd, shard_options, converted);
    } else if (o.dequantize) {  // no layer to convert here: its other FP8 tensors all the same
      detail::dequantize_fp8_block_tensors(sd, *o.dequantize, layer_keys, metadata);
    }
    s.tensors.clear();  // the input's views of this shard are no longer needed
    if (sd.empty()) {
      if (progress) progress(done, total_bytes);
      continue;
    }
    const Metadata shard_metadata = metadata_for(s.metadata, converted, sd);
    uint64_t shard_bytes = 0;
    for (const auto& [key, t] : sd) {
      // A converted layer's new key may be the name of a tensor another shard holds (the single-file
      // conversion refuses the same collision within its dict).
      auto in = index.weight_map.find(key);
      MOE_CHECK(written.weight_map.emplace(key, s.file).second &&
                    (in == index.weight_map.end() || in->second == s.file || layer_of_key.count(key)),
                "convert: output tensor '", key, "' of ", s.file, " collides with a tensor of ",
                in != index.weight_map.end() && in->second != s.file ? in->second : written.weight_map.at(key));
      shard_bytes += static_cast<uint64_t>(t.nbytes());
    }
    size += static_cast<int64_t>(shard_bytes);
    save_safetensors((fs::path(out) / s.file).string(), sd, shard_metadata, [&](uint64_t d, uint64_t all_out) {
      // Written bytes differ from read ones where a layer moved in or out, or gained a columnwise copy.
      if (progress)
        progress(before + (all_out == 0 ? input_bytes
                                          : static_cast<uint64_t>(static_cast<long double>(d) * input_bytes / all_out)),
                 total_bytes);
    });
  }
  safetensors::write_index(index_out, written, size);
  std::vector<std::string> converted;
  for (const auto& kv : layers)
    if (selected(kv.first)) converted.push_back(kv.first);
  return converted;
}

}  // namespace moe
