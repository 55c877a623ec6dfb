// `moe-engine bench`: the main job. Times the expert layer (forward, backward, total; eager and
// CUDA-graph captured) on named or custom shapes (docs/shapes.md) after checking a sample of tokens
// against the CPU reference, and reports TFLOP/s (the convention of docs/semantics.md) and the
// extra device memory; optionally draws the graph-captured TFLOP/s as a PNG bar chart.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <sys/stat.h>

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include "moe/activation.h"
#include "moe/error.h"
#include "support/bar_chart.h"
#include "support/bench_util.h"
#include "support/cli_checks.h"
#include "support/layer_bench.h"

namespace moe::tools {
namespace {

struct BenchArgs {
  std::vector<std::string> shapes;
  std::string png;
  bool list = false;
  bool all = false;
  bool json = false;
  bool no_check = false;
  std::string x_perm = "auto";
  bool fp8 = false;
  std::string fp8_weights = "every-forward";
  bool fp8_weights_given = false;
  std::string wgrad = "write";
  bool frozen = false;
  std::string emulate = "none";
  std::string fc1 = "auto";
  std::string dgrad = "auto";
  int token_chunks = 1;
  double skew = 0.0;
  int align = 0;
  int repeats = 20;
  std::string activation = "swiglu";
};

// The fused fc1 beats the unfused path on the H100 for F <= 1024 (fine-grained experts, where the
// saved permute and activation passes weigh most) and is no slower at F = 2048; at F = 14336 the
// CUTLASS GEMM is faster (see docs/fused.md). The PyTorch module's default mirrors this
// (bindings/torch/moe_engine/module.py).
bool uses_fused_fc1(const std::string& mode, const bench::Shape& s) {
  return mode == "fused" || (mode == "auto" && s.F <= 2048);
}

// Without x_perm (the fused fc1 only) a micro-batch in flight keeps R x H x 2 bytes less. With the
// fused fc2 dgrad that then follows, the layer is as fast as with x_perm up to F = 1024 and within
// 1-2% at F = 2048 (the forward writes no x_perm, which pays for the fc1 weight gradient's gather);
// at F = 14336 the gather costs far more (see docs/fused.md). The PyTorch module's default mirrors this.
bool saves_x_perm(const std::string& mode, bool fused_fc1, const bench::Shape& s) {
  if (!fused_fc1) return true;
  return mode == "saved" || (mode == "auto" && s.F > 2048);
}

// The fused fc2 dgrad keeps a state without act (R x F x 2 bytes less per micro-batch). It costs no
// time at F = 256, and without x_perm at every F measured (up to 2048): there (no bias, which the
// bench has none of) the fc2 weight gradient gathers dy as well, so no pass builds dY_perm. With
// x_perm saved at larger F it is slower (see docs/fused.md). The PyTorch module's default mirrors this.
bool uses_fused_fc2_dgrad(const std::string& mode, const bench::Shape& s, bool save_x_perm) {
  return mode == "fused" || (mode == "auto" && (s.F <= 256 || !save_x_perm));
}

double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; }

// Graph-captured TFLOP/s of every shape run: forward, backward, total.
void write_chart(const std::string& path, const std::string& title, const std::vector<bench::Shape>& shapes,
                 const std::vector<std::vector<double>>& tflops_per_shape) {
  bench::BarChart chart;
  chart.title = title;
  chart.unit = "TFLOP/s";
  chart.series = {"graph forward", "graph backward", "graph total"};
  for (const auto& s : shapes) chart.groups.push_back(s.name);
  chart.values = tflops_per_shape;
  bench::write_png(path, bench::render_bar_chart(chart));
}

// --png is written at the end of the run: refuse a path that cannot be written before it starts,
// without leaving an empty file there if the run then fails (a link there stays as it is).
void check_png_writable(const std::string& path) {
  struct stat st {};
  const bool existed = ::stat(path.c_str(), &st) == 0;  // through a link: the file it names
  MOE_CHECK(!existed || S_ISREG(st.st_mode), "argument 'png': '", path, "' exists and is not a regular file");
  {
    std::ofstream probe(path, std::ios::app);
    MOE_CHECK(probe.good(), "argument 'png': cannot open '", path, "' for writing");
  }
  if (!existed) {
    if (char* created = ::realpath(path.c_str(), nullptr)) {
      std::remove(created);
      std::free(created);
    }
  }
}

// The options of one shape: the fused kernels where the command line and the shape ask for them.
bench::LayerBenchOptions shape_options(const BenchArgs& a, bench::LayerBenchOptions o, bool unfused,
                                       const bench::Shape& s) {
  o.fuse_fc1 = !unfused && uses_fused_fc1(a.fc1, s);
  o.save_x_perm = saves_x_perm(a.x_perm, o.fuse_fc1, s);
  o.fuse_fc2_dgrad = !unfused && uses_fused_fc2_dgrad(a.dgrad, s, o.save_x_perm);
  o.token_chunks = a.token_chunks;
  return o;
}

void run_bench(const BenchArgs& a) {
  if (a.list) {
    std::cout << bench::shape_table();
    return;
  }
  // Shapes are parsed before looking for a GPU, so a typo is reported as such everywhere.
  std::vector<bench::Shape> shapes;
  if (a.all) {
    shapes = bench::named_shapes();
  } else if (a.shapes.empty()) {
    shapes.push_back(bench::shape_by_name("qwen3-30b-a3b-ep8"));
  } else {
    for (const auto& n : a.shapes) shapes.push_back(bench::parse_shape(n));
  }
  bench::LayerBenchOptions o;
  o.skew = a.skew;
  o.align = a.align;
  o.check = !a.no_check;
  o.repeats = a.repeats;
  o.activation = activation_from_name(a.activation);
  o.wgrad = a.wgrad == "accumulate" ? WgradMode::kAccumulate : WgradMode::kWrite;
  o.frozen = a.frozen;
  if (a.fp8) {
    // The FP8 experts run the unfused path on 128-aligned expert rows (ExpertsConfig::fp8).
    o.fp8 = Fp8Recipe::kBlock;
    o.fp8_weight_refresh =
        a.fp8_weights == "on-request" ? Fp8WeightRefresh::kOnRequest : Fp8WeightRefresh::kEveryForward;
    if (o.align == 0) o.align = 128;
  }
  const bool emulated = a.emulate != "none";
  MOE_CHECK(!a.fp8_weights_given || a.fp8 || emulated, "argument 'fp8-weights': applies to --fp8 or --emulate");
  if (emulated) {
    MOE_CHECK(!a.fp8, "argument 'emulate': --fp8 and --emulate exclude each other");
    o.emulated = a.emulate == "mxfp8" ? EmulatedQuant::kMXFP8 : EmulatedQuant::kNVFP4;
    o.fp8_weight_refresh =
        a.fp8_weights == "on-request" ? Fp8WeightRefresh::kOnRequest : Fp8WeightRefresh::kEveryForward;
    if (o.align == 0) o.align = o.emulated == EmulatedQuant::kMXFP8 ? 32 : 16;  // whole blocks per expert
  }
  const bool unfused = a.fp8 || emulated;
  const std::string precision =
      a.fp8 ? std::string("FP8 block-scaled experts") : emulated ? "emulated " + a.emulate + " experts" : "bf16";

  // Every shape's layer configuration is checked before looking for a GPU, so a shape or option the
  // layer refuses is reported as such everywhere (and before the CPU builds its routing).
  for (const auto& s : shapes) bench::layer_bench_config(s, shape_options(a, o, unfused, s)).validate();
  if (!a.png.empty()) check_png_writable(a.png);  // now rather than after a long run
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::cerr << "moe-engine bench: no CUDA GPU available (this command needs one)\n";
    std::exit(2);
  }
  const std::string device = bench::device_description();
  if (!a.json) {
    std::printf("moe-engine bench on %s: %s, %s, probs in the activation, A=%d, routing skew %.2f, fc1 %s%s\n",
                device.c_str(),
                (precision + (!unfused                       ? ""
                              : a.fp8_weights == "on-request" ? " (weights quantized once, outside the runs)"
                                                              : " (weights quantized in every forward)"))
                    .c_str(),
                a.activation.c_str(), o.align, a.skew, unfused ? "unfused" : a.fc1.c_str(),
                o.wgrad == WgradMode::kAccumulate ? ", weight gradients added into fp32 main_grad" : "");
    std::printf("TFLOP/s: forward 6TkHF, backward %s, total %s (padding rows not counted); "
                "times are medians of %d runs (min-max)\n\n",
                a.frozen ? "6TkHF (frozen experts: the two input-gradient GEMMs)" : "12TkHF",
                a.frozen ? "12TkHF" : "18TkHF", a.repeats);
    std::printf("%-18s | %-26s | %-26s | %-26s | %-21s | %8s | %-7s | %s\n", "shape", "graph fwd ms (TFLOP/s)",
                "graph bwd ms (TFLOP/s)", "graph total ms (TFLOP/s)", "eager total ms (TF/s)", "extra GiB", "fc1",
                "check");
  }
  bool all_ok = true;
  std::vector<std::vector<double>> chart_values;  // per shape: graph fwd, bwd, total TFLOP/s
  for (const auto& s : shapes) {
    o = shape_options(a, o, unfused, s);
    std::string fc1_name = a.fp8 ? "fp8" : emulated ? a.emulate : !o.fuse_fc1 ? "unfused" : o.save_x_perm ? "fused" : "fused-g";
    if (o.fuse_fc2_dgrad) fc1_name += "+d";
    if (o.token_chunks > 1) fc1_name += "/" + std::to_string(o.token_chunks);
    if (o.frozen) fc1_name += " frozen";
    bench::LayerBenchResult r = bench::run_layer_bench(s, o);
    const double ff = r.flops_fwd();
    // The backward's FLOPs: both GEMMs of each layer (12TkHF), or only the input gradients' (frozen).
    const double bf = o.frozen ? ff : 2 * ff;
    const double g_bwd = r.fwd_bwd_graph.median_ms - r.fwd_graph.median_ms;
    const double e_bwd = r.fwd_bwd_eager.median_ms - r.fwd_eager.median_ms;
    all_ok = all_ok && r.check.passed();
    chart_values.push_back({tflops(ff, r.fwd_graph.median_ms), tflops(bf, g_bwd),
                            tflops(ff + bf, r.fwd_bwd_graph.median_ms)});
    if (a.json) {
      nlohmann::json j = {
          {"shape", s.name}, {"T", s.T}, {"H", s.H}, {"F", s.F}, {"E", s.E}, {"k", s.k}, {"device", device},
          {"skew", r.skew}, {"align", o.align}, {"activation", a.activation}, {"fc1", o.fuse_fc1 ? "fused" : "unfused"}, {"fp8", a.fp8}, {"emulate", a.emulate}, {"x_perm", o.save_x_perm ? "saved" : "gathered"},
          {"fc2_dgrad", o.fuse_fc2_dgrad ? "fused" : "unfused"}, {"token_chunks", o.token_chunks},
          {"wgrad", a.wgrad}, {"frozen", a.frozen},
          {"graph", {{"fwd_ms", r.fwd_graph.median_ms}, {"bwd_ms", g_bwd}, {"total_ms", r.fwd_bwd_graph.median_ms},
                     {"fwd_tflops", tflops(ff, r.fwd_graph.median_ms)}, {"bwd_tflops", tflops(bf, g_bwd)},
                     {"total_tflops", tflops(ff + bf, r.fwd_bwd_graph.median_ms)},
                     {"total_ms_min", r.fwd_bwd_graph.min_ms}, {"total_ms_max", r.fwd_bwd_graph.max_ms}}},
          {"eager", {{"fwd_ms", r.fwd_eager.median_ms}, {"bwd_ms", e_bwd}, {"total_ms", r.fwd_bwd_eager.median_ms},
                     {"fwd_tflops", tflops(ff, r.fwd_eager.median_ms)}, {"bwd_tflops", tflops(bf, e_bwd)},
                     {"total_tflops", tflops(ff + bf, r.fwd_bwd_eager.median_ms)}}},
          {"extra_gib", r.extra_gib},
          {"check", {{"ran", r.check.ran}, {"passed", r.check.passed()}, {"y_rel_err", r.check.y_rel_err},
                     {"dx_rel_err", r.check.dx_rel_err}, {"dprobs_rel_err", r.check.dprobs_rel_err},
                     {"tolerance", r.check.tolerance}}}};
      std::cout << j.dump() << std::endl;
    } else {
      char check[96];
      if (r.check.ran)
        std::snprintf(check, sizeof check, "%s (y %.1e, dx %.1e, dp %.1e)", r.check.passed() ? "ok" : "FAILED",
                      r.check.y_rel_err, r.check.dx_rel_err, r.check.dprobs_rel_err);
      else
        std::snprintf(check, sizeof check, "skipped");
      std::printf("%-18s | %7.3f (%5.0f) %5.3f-%5.3f | %7.3f (%5.0f)             | %7.3f (%5.0f) %5.3f-%5.3f | "
                  "%8.3f (%5.0f)      | %8.2f | %-7s | %s\n",
                  s.name, r.fwd_graph.median_ms, tflops(ff, r.fwd_graph.median_ms), r.fwd_graph.min_ms,
                  r.fwd_graph.max_ms, g_bwd, tflops(bf, g_bwd), r.fwd_bwd_graph.median_ms,
                  tflops(ff + bf, r.fwd_bwd_graph.median_ms), r.fwd_bwd_graph.min_ms, r.fwd_bwd_graph.max_ms,
                  r.fwd_bwd_eager.median_ms, tflops(ff + bf, r.fwd_bwd_eager.median_ms), r.extra_gib,
                  fc1_name.c_str(), check);
      std::fflush(stdout);
    }
  }
  if (!a.png.empty()) {
    write_chart(a.png, "moe-engine bench, " + device + ", " + precision + " " + a.activation, shapes, chart_values);
    if (!a.json) std::printf("\nchart: %s\n", a.png.c_str());
  }
  MOE_CHECK(all_ok, "moe-engine bench: a sampled result differs from the CPU reference (see the check column)");
}

void setup_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand("bench", "Benchmark the expert layer on named or custom shapes (needs a GPU)");
  sub->add_flag("--list", args->list, "Print the named shapes (T, H, F, E, k) and exit (no GPU needed)");
  CLI::Option* shape = sub->add_option(
      "--shape", args->shapes,
      "Shape(s) to run: a name from --list, or T,H,F,E,k for your own model (tokens, hidden size, expert FFN "
      "size, experts on this GPU, top-k), reported as TxHxFxExk (default: qwen3-30b-a3b-ep8)");
  sub->add_flag("--all", args->all, "Every named shape")->excludes(shape);
  sub->add_flag("--json", args->json, "One JSON line per shape instead of a table");
  sub->add_option("--skew", args->skew, "Routing skew: 0 balanced, >0 Zipf-like expert popularity")
      ->check(cli::finite_number())
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--align", args->align, "Per-expert row alignment A (0, 16, 32, 64, 128, 256)")
      ->transform(cli::decimal_integer())
      ->check(CLI::IsMember({0, 16, 32, 64, 128, 256}));
  sub->add_option("--repeats", args->repeats, "Timed repeats per measurement (median reported)")
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(3, 1000));
  sub->add_option("--activation", args->activation, "swiglu, geglu, clamped-swiglu or squared-relu");
  sub->add_option("--png", args->png, "Also draw the graph-captured forward / backward / total TFLOP/s of each "
                                     "shape as a bar chart into this PNG file");
  sub->add_option("--fc1", args->fc1, "fused (gather + fc1 + bias + activation x prob in one kernel), unfused "
                  "(separate kernels, the reference path) or auto (fused where it was measured no slower: F <= 2048)")
      ->check(CLI::IsMember({"auto", "fused", "unfused"}));
  sub->add_option("--x-perm", args->x_perm, "With the fused fc1: saved (keep x_perm for the fc1 weight gradient), "
                  "gathered (keep none: the fc1 weight gradient gathers the rows of x; less memory; shown as fc1 "
                  "'fused-g') or auto (gathered where the fused fc1 is the default: F <= 2048)")
      ->check(CLI::IsMember({"auto", "saved", "gathered"}));
  sub->add_flag_callback("--no-x-perm", [args] { args->x_perm = "gathered"; }, "The same as --x-perm gathered");
  sub->add_option("--dgrad", args->dgrad, "fused (fc2 dgrad gathering dy + activation backward + dprobs in one "
                  "kernel; shown as '+d' in the fc1 column), unfused (separate kernels, the reference path) or auto (fused "
                  "where it costs no time: F <= 256, or without x_perm)")
      ->check(CLI::IsMember({"auto", "fused", "unfused"}));
  sub->add_option("--token-chunks", args->token_chunks, "fc2 + combine and fc1 dgrad + dx sum in this many pieces "
                  "of consecutive tokens: the layer's R x H workspace holds one piece (needs the fused fc2 dgrad "
                  "without x_perm, no bias, bf16; shown as '/N' in the fc1 column)")
      ->transform(cli::decimal_integer())
      ->check(CLI::Range(1, 64));
  sub->add_flag("--fp8", args->fp8, "FP8 block-scaled experts (E4M3 GEMM operands, 1x128 / 128x128 scales; the "
                "unfused path, A = 128 unless --align says otherwise; shown as 'fp8' in the fc1 column)");
  sub->add_option("--emulate", args->emulate, "Emulated Blackwell formats: mxfp8 or nvfp4 GEMM operands "
                  "(quantized exactly, dequantized to bf16 for the bf16 GEMMs; the unfused path, A = 32 / 16 unless "
                  "--align says otherwise) or none")
      ->check(CLI::IsMember({"none", "mxfp8", "nvfp4"}));
  CLI::Option* fp8_weights = sub->add_option("--fp8-weights", args->fp8_weights, "With --fp8 or --emulate: when the weights are quantized -- every-forward "
                  "(inside each timed forward) or on-request (once after binding, as in a step of several "
                  "micro-batches)")
      ->check(CLI::IsMember({"every-forward", "on-request"}));
  sub->add_option("--wgrad", args->wgrad, "Weight gradients written in bf16 (write) or added into fp32 main_grad "
                  "buffers (accumulate: Megatron-LM's gradient-accumulation fusion; their memory counts as extra)")
      ->check(CLI::IsMember({"write", "accumulate"}));
  sub->add_flag("--frozen", args->frozen, "Frozen experts: the backward computes dx and dprobs only (no weight "
                "gradient, as when only the layers around the experts train; shown as 'frozen' in the fc1 column)");
  sub->add_flag("--no-check", args->no_check, "Skip the sampled comparison with the CPU reference");
  sub->callback([args, fp8_weights] {
    args->fp8_weights_given = fp8_weights->count() > 0;
    run_bench(*args);
  });
}

}  // namespace

MOE_REGISTER_COMMAND(setup_bench);

}  // namespace moe::tools
