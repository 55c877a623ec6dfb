// moe-engine convert: expert checkpoints between per-expert, single-grouped and Hugging Face files.
//
//   moe-engine convert --from hf:mixtral --to grouped model.safetensors grouped.safetensors
//   moe-engine convert --from grouped --to hf:mixtral grouped.safetensors model.safetensors
//   moe-engine convert --from hf:qwen3_moe --to grouped Qwen3-30B-A3B/ grouped/   (a sharded checkpoint)
//   moe-engine convert --from hf --to grouped Qwen3-30B-A3B/ grouped/              (family from its config.json)
//   moe-engine convert --from hf:deepseek --to hf:deepseek --dequantize bf16 DeepSeek-V3/ bf16/   (FP8 -> bf16)
//
// Only the experts' tensors change (see include/moe/checkpoint_convert.h); the rest of the file
// and its metadata are carried over byte for byte, so hf -> grouped -> hf reproduces the file
// (--dequantize also writes the other FP8 tensors unquantized).
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "command.h"
#include "moe/checkpoint_convert.h"
#include "moe/error.h"
#include "progress_bar.h"
#include "support/cli_checks.h"

namespace moe::tools {

namespace {

struct ConvertArgs {
  std::string from, to, in, out;
  int experts = 0;
  int glu_interleave = -1, from_glu = -1, to_glu = -1;
  std::vector<std::string> layers;
  std::string dequantize;  // "", "bf16" or "fp32"
  bool progress = false, no_progress = false, quiet = false;
};

// Files at least this big get a progress bar on a terminal without asking.
constexpr uint64_t kLargeFile = 64ull << 20;

// The library's errors name ConvertOptions' fields; the user passed this command's options. Each
// "argument 'field'" of a field set by an option named otherwise becomes that option's name.
std::string in_option_names(std::string message) {
  static const std::pair<const char*, const char*> kOptionOf[] = {
      {"from_glu_interleave", "from-glu-interleave"}, {"to_glu_interleave", "to-glu-interleave"}, {"prefixes", "layer"}};
  for (const auto& [field, option] : kOptionOf) {
    const std::string from = std::string("argument '") + field + "'", to = std::string("argument '") + option + "'";
    for (size_t at = message.find(from); at != std::string::npos; at = message.find(from, at + to.size()))
      message.replace(at, from.size(), to);
  }
  return message;
}

void run_convert(const ConvertArgs& a) {
  ConvertOptions o;
  o.from = CheckpointFormat::parse(a.from, "from");
  o.to = CheckpointFormat::parse(a.to, "to");
  o.experts = a.experts;
  // --glu-interleave sets the sides in our naming; --from- / --to-glu-interleave one side each (the
  // library refuses one given for a Hugging Face side, whose fc1 layout is the family's).
  MOE_CHECK(a.glu_interleave <= 0 || o.from.ours() || o.to.ours(), "argument 'glu-interleave': applies to a ",
            "per-expert or grouped side, and both sides are Hugging Face files");
  const int both = a.glu_interleave < 0 ? 0 : a.glu_interleave;
  o.from_glu_interleave = a.from_glu >= 0 ? a.from_glu : o.from.ours() ? both : 0;
  o.to_glu_interleave = a.to_glu >= 0 ? a.to_glu : o.to.ours() ? both : 0;
  o.prefixes = a.layers;
  if (!a.dequantize.empty()) o.dequantize = a.dequantize == "bf16" ? DType::kBF16 : DType::kFP32;

  std::unique_ptr<ProgressBar> shown;
  auto progress = [&](uint64_t done, uint64_t total) {
    if (!shown) {
      const bool on = !a.no_progress && (a.progress || (stderr_is_terminal() && total >= kLargeFile));
      shown = std::make_unique<ProgressBar>("writing " + a.out, on);
    }
    shown->update(done, total);
  };
  std::vector<std::string> layers;
  try {
    o = families_from_config(o, a.in);  // "hf": the model_type of the config.json beside the input
    layers = convert_checkpoint(a.in, a.out, o, progress);
  } catch (const Error& e) {
    throw Error(in_option_names(e.what()));
  }
  shown.reset();  // end the bar's line before the summary
  if (!a.quiet) {
    std::cout << "converted " << layers.size() << " expert layer" << (layers.size() == 1 ? "" : "s") << " ("
              << o.from.name() << " -> " << o.to.name() << ") into " << a.out << "\n";
    for (const std::string& l : layers) std::cout << "  " << (l.empty() ? "(no prefix)" : l) << "\n";
  }
}

void setup_convert(CLI::App& app) {
  auto args = std::make_shared<ConvertArgs>();
  CLI::App* sub = app.add_subcommand(
      "convert", "Convert expert weights between per-expert, single-grouped and Hugging Face safetensors files");
  std::string formats = "per-expert, grouped or hf:{";
  for (const auto& f : hf_family_names()) formats += f + (f == hf_family_names().back() ? "}" : "|");
  formats += " (or hf:<model_type> of a model in one of their namings, e.g. hf:glm4_moe; or hf alone: the "
             "model_type of the config.json beside the input)";
  sub->add_option("--from", args->from, "Input format: " + formats)->required();
  sub->add_option("--to", args->to, "Output format: " + formats)->required();
  sub->add_option("input", args->in,
                  "Input .safetensors file, or a sharded checkpoint: its *.safetensors.index.json or the folder "
                  "holding it")
      ->required()
      ->check(CLI::ExistingPath);
  sub->add_option("output", args->out,
                  "Output .safetensors file (written atomically), or for a sharded input the folder to write the "
                  "shards and the index into (created if absent)")
      ->required();
  sub->add_option("--experts", args->experts,
                  "Experts per layer (default: read from the keys; needed for 2-D stacked tensors)")
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  CLI::Option* both_glu = sub->add_option("--glu-interleave", args->glu_interleave,
                  "GLU interleave size of fc1's rows on our side(s) (0 = [gate | linear])")
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  sub->add_option("--from-glu-interleave", args->from_glu, "GLU interleave of an input in our naming")
      ->excludes(both_glu)
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  sub->add_option("--to-glu-interleave", args->to_glu, "GLU interleave of an output in our naming")
      ->excludes(both_glu)
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(0, std::numeric_limits<int>::max()));
  sub->add_option("--layer", args->layers, "Convert only the layer with this key prefix (repeatable)");
  sub->add_option("--dequantize", args->dequantize,
                  "Write quantized weights (the converted expert layers', and every FP8 tensor with 128x128 block "
                  "scales beside them, e.g. DeepSeek-V3's attention) as the values they decode to, in this dtype")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  sub->add_flag("--progress", args->progress, "Show a progress bar on stderr even when it is not a terminal");
  sub->add_flag("--no-progress", args->no_progress, "Never show a progress bar");
  sub->add_flag("-q,--quiet", args->quiet, "Print nothing on success");
  sub->callback([args] { run_convert(*args); });
}

}  // namespace

MOE_REGISTER_COMMAND(setup_convert);

}  // namespace moe::tools
