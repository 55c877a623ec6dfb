#include "moe/grouped_mlp_config.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#include "moe/error.h"

namespace moe {

const char* param_name(Param p) {
  switch (p) {
    case Param::kFc1Weight: return "fc1.weight";
    case Param::kFc1Bias: return "fc1.bias";
    case Param::kFc2Weight: return "fc2.weight";
    case Param::kFc2Bias: return "fc2.bias";
  }
  return "unknown";
}

const char* emulated_quant_name(EmulatedQuant q) {
  switch (q) {
    case EmulatedQuant::kNone: return "none";
    case EmulatedQuant::kMXFP8: return "mxfp8";
    case EmulatedQuant::kNVFP4: return "nvfp4";
  }
  return "unknown";
}

int64_t GroupedMlpConfig::row_bound() const {
  const int64_t r = resolve_row_bound(dispatch, routing_form, max_tokens, topk, experts);
  // The FP8 weight gradients read columnwise token copies whose rows are multiples of 16 tokens.
  return fp8 == Fp8Recipe::kNone ? r : (r + 15) / 16 * 16;
}

namespace {
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();  // row indices are int32 on the device
// The widest row a kernel indexes (the activation's gated rows hold 2 F features); far past any model,
// and small enough that rows x width cannot wrap in the workspace arithmetic.
constexpr int64_t kMaxWidth = int64_t{1} << 29;
constexpr int kMaxGemmExperts = 65535;           // the grouped GEMM's groups
constexpr int kMaxDispatchExperts = 1024;        // the dispatcher's per-warp tables (GroupedMlp)
constexpr int64_t kMaxQuantizedRows = int64_t{65535} * 128;  // the quantize kernels' grid of 128-row tiles

// Checks shared by the layer and the experts (field names as in both configs).
void validate_expert_fields(int64_t hidden, int64_t ffn, int experts, const ActivationParams& activation, DType dtype,
                            DType wgrad_dtype) {
  // BF16 GEMM operands need 16-byte aligned rows: K and N multiples of 8.
  MOE_CHECK(hidden > 0 && hidden % 8 == 0 && hidden <= kMaxWidth, "config 'hidden': expected a positive multiple ",
            "of 8 up to 2^29, got ", hidden);
  MOE_CHECK(ffn > 0 && ffn % 8 == 0 && ffn <= kMaxWidth, "config 'ffn': expected a positive multiple of 8 up to ",
            "2^29, got ", ffn);
  MOE_CHECK(experts > 0 && experts <= kMaxGemmExperts, "config 'experts': expected 1..", kMaxGemmExperts, ", got ",
            experts);
  validate_activation(activation, ffn);
  MOE_CHECK(dtype == DType::kBF16, "config 'dtype': expected bf16, got ", dtype_name(dtype));
  MOE_CHECK(wgrad_dtype == DType::kBF16 || wgrad_dtype == DType::kFP32,
            "config 'wgrad_dtype': expected bf16 or fp32, got ", dtype_name(wgrad_dtype));
}

// The enumerations both configs carry (a value outside them would select no code path).
void validate_modes(ProbsPlacement probs, WeightLayout layout, WgradMode wgrad) {
  MOE_CHECK(probs == ProbsPlacement::kInActivation || probs == ProbsPlacement::kAtCombine,
            "config 'probs': unknown value ", int(probs));
  MOE_CHECK(layout == WeightLayout::kSingleGrouped || layout == WeightLayout::kPerExpert,
            "config 'layout': unknown value ", int(layout));
  MOE_CHECK(wgrad == WgradMode::kWrite || wgrad == WgradMode::kAccumulate, "config 'wgrad': unknown value ",
            int(wgrad));
}

// The fused kernels load weight tiles in the standard orientation ([E, fc1_out, H], [E, H, F]).
void validate_transposed(bool transposed, bool fuse_fc1, bool fuse_fc2_dgrad) {
  MOE_CHECK(!(transposed && fuse_fc1), "config 'transposed_weights': the fused fc1 reads weights in the ",
            "[E, fc1_out, H] orientation only; set fuse_fc1 = false");
  MOE_CHECK(!(transposed && fuse_fc2_dgrad), "config 'transposed_weights': the fused fc2 dgrad reads weights in ",
            "the [E, H, F] orientation only; set fuse_fc2_dgrad = false");
}
// The FP8 recipe's requirements (ExpertsConfig::fp8).
void validate_fp8(Fp8Recipe fp8, EmulatedQuant emulated, Fp8WeightRefresh refresh, int64_t hidden, int64_t ffn,
                  bool fuse_fc1, bool fuse_fc2_dgrad, bool transposed) {
  MOE_CHECK(refresh == Fp8WeightRefresh::kEveryForward || refresh == Fp8WeightRefresh::kOnRequest ||
                refresh == Fp8WeightRefresh::kFromMaster,
            "config 'fp8_weight_refresh': unknown value ", int(refresh));
  MOE_CHECK(fp8 != Fp8Recipe::kNone || emulated != EmulatedQuant::kNone || refresh != Fp8WeightRefresh::kFromMaster,
            "config 'fp8_weight_refresh': from master (quantized primary weights) needs quantized experts (config ",
            "'fp8' or 'emulated')");
  if (fp8 == Fp8Recipe::kNone) return;
  MOE_CHECK(fp8 == Fp8Recipe::kBlock || fp8 == Fp8Recipe::kBlockPow2, "config 'fp8': unknown recipe ", int(fp8));
  MOE_CHECK(hidden % 16 == 0 && ffn % 16 == 0, "config 'fp8': FP8 operands need hidden and ffn multiples of 16 ",
            "(16-byte rows), got ", hidden, " and ", ffn);
  MOE_CHECK(!fuse_fc1 && !fuse_fc2_dgrad, "config 'fp8': the FP8 experts run the unfused path; set fuse_fc1 and ",
            "fuse_fc2_dgrad to false");
  MOE_CHECK(!transposed, "config 'fp8': the FP8 experts read weights in the standard orientation; set ",
            "transposed_weights to false");
}
// The emulated recipes' requirements (ExpertsConfig::emulated).
void validate_emulated(EmulatedQuant q, Fp8Recipe fp8, int64_t hidden, int64_t ffn, bool fuse_fc1,
                       bool fuse_fc2_dgrad, bool transposed) {
  if (q == EmulatedQuant::kNone) return;
  MOE_CHECK(q == EmulatedQuant::kMXFP8 || q == EmulatedQuant::kNVFP4, "config 'emulated': unknown value ", int(q));
  const char* name = emulated_quant_name(q);
  const int64_t b = q == EmulatedQuant::kMXFP8 ? 32 : 16;
  MOE_CHECK(fp8 == Fp8Recipe::kNone, "config 'emulated': ", name, " emulation and fp8 exclude each other");
  MOE_CHECK(hidden % b == 0 && ffn % b == 0, "config 'emulated': ", name, " needs hidden and ffn multiples of ", b,
            " (whole blocks along every reduction), got ", hidden, " and ", ffn);
  MOE_CHECK(!fuse_fc1 && !fuse_fc2_dgrad, "config 'emulated': the emulated experts run the unfused path; set ",
            "fuse_fc1 and fuse_fc2_dgrad to false");
  MOE_CHECK(!transposed, "config 'emulated': the emulated experts read weights in the standard orientation; set ",
            "transposed_weights to false");
}
}  // namespace

void ExpertsConfig::validate() const {
  validate_expert_fields(hidden, ffn, experts, activation, dtype, wgrad_dtype);
  validate_modes(probs, layout, wgrad);
  MOE_CHECK(max_rows >= 0 && max_rows < (int64_t(1) << 31), "config 'max_rows': expected 0..2^31-1, got ",
            max_rows);
  MOE_CHECK((fp8 == Fp8Recipe::kNone && emulated == EmulatedQuant::kNone) || max_rows <= kMaxQuantizedRows,
            "config 'max_rows': the quantized experts' quantize kernels take at most 65535 x 128 rows, got ",
            max_rows);
  MOE_CHECK(max_sms >= 0, "config 'max_sms': expected 0 (every SM) or a positive count, got ", max_sms);
  validate_transposed(transposed_weights, fuse_fc1, fuse_fc2_dgrad);
  validate_fp8(fp8, emulated, fp8_weight_refresh, hidden, ffn, fuse_fc1, fuse_fc2_dgrad, transposed_weights);
  validate_emulated(emulated, fp8, hidden, ffn, fuse_fc1, fuse_fc2_dgrad, transposed_weights);
  MOE_CHECK(!dprobs_partials_in_dx_perm || (fuse_fc2_dgrad && probs == ProbsPlacement::kInActivation),
            "config 'dprobs_partials_in_dx_perm': needs fuse_fc2_dgrad and the probs in the activation (only the ",
            "fused fc2 dgrad computes dprobs from partial sums)");
  MOE_CHECK(fp8 == Fp8Recipe::kNone || max_rows % 16 == 0, "config 'max_rows': the FP8 weight gradients read the ",
            "tokens' columnwise copies, whose rows need a multiple of 16 tokens; got ", max_rows);
  MOE_CHECK(!row_windows || (dtype == DType::kBF16 && fp8 == Fp8Recipe::kNone && emulated == EmulatedQuant::kNone &&
                             !bias),
            "config 'row_windows': windows of rows are offered for bf16 experts without fp8, emulated formats or ",
            "bias");
}

ExpertsConfig GroupedMlpConfig::experts_config() const {
  ExpertsConfig e;
  e.hidden = hidden;
  e.ffn = ffn;
  e.experts = experts;
  e.max_rows = row_bound();
  e.activation = activation;
  e.bias = bias;
  e.probs = probs;
  e.layout = layout;
  e.wgrad = wgrad;
  e.wgrad_dtype = wgrad_dtype;
  e.delay_wgrad = delay_wgrad;
  e.dtype = dtype;
  e.fuse_fc1 = fuse_fc1;
  e.fuse_fc2_dgrad = fuse_fc2_dgrad;
  // The layer's fused backward passes no dY_out (dY_perm never exists) exactly when there is no bias,
  // no delayed weight gradient and no saved x_perm: then dx_perm overlaps nothing the fused fc2 dgrad
  // reads or writes, and the layer needs no dprobs partial workspace.
  e.dprobs_partials_in_dx_perm =
      fuse_fc2_dgrad && probs == ProbsPlacement::kInActivation && !bias && !delay_wgrad && !save_x_perm;
  e.max_sms = max_sms;
  e.transposed_weights = transposed_weights;
  e.fp8 = fp8;
  e.fp8_weight_refresh = fp8_weight_refresh;
  e.emulated = emulated;
  e.row_windows = token_chunks > 1;
  return e;
}

DispatcherConfig GroupedMlpConfig::dispatcher_config() const {
  DispatcherConfig d;
  d.max_tokens = max_tokens;
  d.num_experts = experts;
  d.topk = topk;
  d.hidden = hidden;
  d.form = routing_form;
  d.options = dispatch;
  d.options.row_bound = row_bound();
  d.row_dtype = dtype;
  return d;
}

void GroupedMlpConfig::validate() const {
  validate_expert_fields(hidden, ffn, experts, activation, dtype, wgrad_dtype);
  validate_modes(probs, layout, wgrad);
  MOE_CHECK(experts <= kMaxDispatchExperts, "config 'experts': the layer's dispatcher takes 1..",
            kMaxDispatchExperts, " experts, got ", experts);
  MOE_CHECK(routing_form == RoutingForm::kTopK || routing_form == RoutingForm::kMap,
            "config 'routing_form': unknown value ", int(routing_form));
  MOE_CHECK(topk > 0 && (routing_form == RoutingForm::kMap || topk <= experts),
            "config 'topk': expected 1..experts (", experts, "), got ", topk);
  // Bounded by division, so that max_tokens x slots cannot wrap into a small row bound.
  const int slots = routing_form == RoutingForm::kMap ? experts : topk;
  MOE_CHECK(max_tokens >= 0 && max_tokens <= kMaxRows / slots, "config 'max_tokens': expected 0..",
            kMaxRows / slots, " (max_tokens x ", slots, " slots must fit the int32 row indices), got ", max_tokens);
  validate_dispatch_options(dispatch);
  MOE_CHECK(!(recompute && delay_wgrad), "config 'recompute': activation recompute is not combinable with ",
            "delay_wgrad (the delayed weight gradients need the saved activations)");
  validate_transposed(transposed_weights, fuse_fc1, fuse_fc2_dgrad);
  validate_fp8(fp8, emulated, fp8_weight_refresh, hidden, ffn, fuse_fc1, fuse_fc2_dgrad, transposed_weights);
  validate_emulated(emulated, fp8, hidden, ffn, fuse_fc1, fuse_fc2_dgrad, transposed_weights);
  MOE_CHECK(fp8 == Fp8Recipe::kNone || (dispatch.align > 0 && dispatch.align % 128 == 0), "config 'fp8': the FP8 ",
            "weight gradients need each expert's rows to fill whole 128-row blocks; set dispatch.align to 128 or 256 ",
            "(got ", dispatch.align, ")");
  MOE_CHECK(save_x_perm || fuse_fc1, "config 'save_x_perm': false needs fuse_fc1 (the fused kernels gather the ",
            "rows of x)");
  MOE_CHECK(max_sms >= 0, "config 'max_sms': expected 0 (every SM) or a positive count, got ", max_sms);
  MOE_CHECK(token_chunks >= 1 && token_chunks <= 64, "config 'token_chunks': expected 1..64, got ", token_chunks);
  if (token_chunks > 1) {
    MOE_CHECK(probs == ProbsPlacement::kInActivation, "config 'token_chunks': needs the probs in the activation (a ",
              "combine merging probs reads the whole Y again in backward)");
    MOE_CHECK(dtype == DType::kBF16 && fp8 == Fp8Recipe::kNone && emulated == EmulatedQuant::kNone,
              "config 'token_chunks': needs bf16 experts without fp8 or an emulated format");
    MOE_CHECK(!bias, "config 'token_chunks': not offered with bias yet");
    MOE_CHECK(fuse_fc2_dgrad && (!save_x_perm || delay_wgrad), "config 'token_chunks': needs the fused fc2 dgrad ",
              "gathering dy with no dY_perm in the workspace (fuse_fc2_dgrad, and save_x_perm = false or ",
              "delay_wgrad)");
  }
  const int64_t R = row_bound();  // throws for map form without an explicit bound
  MOE_CHECK((fp8 == Fp8Recipe::kNone && emulated == EmulatedQuant::kNone) || R <= kMaxQuantizedRows,
            "config 'max_tokens': the quantized experts' quantize kernels take at most 65535 x 128 rows, and ",
            "max_tokens = ", max_tokens, " gives a row bound of ", R);
}

int64_t GroupedMlpConfig::chunk_row_bound() const {
  const int64_t R = row_bound();
  const int slots = routing_form == RoutingForm::kMap ? experts : topk;
  const int64_t tokens = std::max<int64_t>(1, (max_tokens + token_chunks - 1) / token_chunks);  // as chunk_tokens
  return std::min(R, tokens * slots);
}

}  // namespace moe
