// families_from_config (include/moe/checkpoint_convert.h): the Hugging Face family of an "hf" side from
// the model_type of the config.json beside the checkpoint.
#include <filesystem>
#include <fstream>
#include <iterator>


#include <nlohmann/json.hpp>

#include "moe/checkpoint_convert.h"
#include "moe/error.h"

namespace moe {

namespace {

// config.json in the folder `in` names, or in the folder of the file it names.
std::string config_beside(const std::string& in) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir = fs::is_directory(in, ec) ? fs::path(in) : fs::path(in).parent_path();
  return ((dir.empty() ? fs::path(".") : dir) / "config.json").string();
}

HfFamily family_of(const std::string& config) {
  std::ifstream file(config, std::ios::binary);
  MOE_CHECK(file.good(), config, ": cannot read it, and 'hf' takes the family from its model_type (give ",
            "hf:<family> instead)");
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  MOE_CHECK(j.is_object() && j.contains("model_type") && j["model_type"].is_string(), config,
            ": not a Hugging Face config with a \"model_type\" string (give hf:<family> instead)");
  const std::string what = config + " model_type";
  return hf_family_from_name(j["model_type"].get<std::string>(), what.c_str());
}

}  // namespace

ConvertOptions families_from_config(const ConvertOptions& options, const std::string& in) {
  ConvertOptions o = options;
  for (CheckpointFormat* side : {&o.from, &o.to}) {
    if (!side->family_from_config) continue;
    side->family = family_of(config_beside(in));
    side->family_from_config = false;
  }
  return o;
}

}  // namespace moe
