// Configuration of the experts and of the expert layer (docs/semantics.md): everything that fixes
// buffer sizes is here, so that all device memory can be planned at construction and nothing is
// allocated per call.
#pragma once

#include <cstdint>

#include "moe/activation.h"
#include "moe/dispatcher_config.h"
#include "moe/dtype.h"
#include "moe/routing.h"

namespace moe {

enum class ProbsPlacement : uint8_t {
  kInActivation,  // act * p inside the experts (and the fc2 bias scaled by p); combine weights 1
  kAtCombine,     // experts unscaled; combine merges with the probs
};

enum class WeightLayout : uint8_t {
  kSingleGrouped,  // fc1.weight [E, fc1_out, H], fc2.weight [E, H, F], fc1.bias [E, fc1_out], ...
  kPerExpert,      // E separate tensors fc1.weight0 .. fc1.weight{E-1}, ...
};

enum class WgradMode : uint8_t {
  kWrite,       // gradients written to grad tensors (bf16 or fp32)
  kAccumulate,  // main_grad (fp32) += dW   ("gradient accumulation fusion")
};

// The four parameters of the expert MLP, in the order their gradients become final in a
// non-delayed backward (fc2 first).
enum class Param : uint8_t { kFc2Weight, kFc2Bias, kFc1Weight, kFc1Bias };
const char* param_name(Param p);  // "fc1.weight", ...

// Quantized compute of the experts (docs/layer.md, FP8). kBlock: every GEMM operand is quantized
// to FP8 E4M3 with block scaling (1x128 blocks for tokens, 128x128 for weights, fp32 scales, the
// recipe of TransformerEngine's Float8BlockScaling / DeepSeek-V3) and the FP8 grouped GEMMs run;
// h, the activation, the bias and all gradients between the GEMMs stay bf16. kBlockPow2: the same
// with every scale rounded down to a power of two (each block's amax then maps at or below the E4M3
// maximum; the scaling itself is exact) -- what TransformerEngine's Float8BlockScaling computes
// by default (unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1), so the two quantize every operand alike.
enum class Fp8Recipe : uint8_t { kNone, kBlock, kBlockPow2 };

// When the FP8 experts quantize their bf16 weights. kEveryForward: every forward (and recompute)
// does, so the copies always match the weights (a read of the weights and a write of two FP8 copies
// per forward). kOnRequest: only refresh_fp8_weights() does -- call it after every change of the
// weights (once per optimizer step, before the first micro-batch; it is graph-capturable), and the
// forwards in between reuse the copies. kFromMaster: FP8 primary weights -- the FP8 copies are the
// only weights the experts compute with; set_weights binds the fp32 master weights (e.g. the
// optimizer's, either layout) in place of bf16 ones, and refresh_fp8_weights() quantizes them
// straight from fp32 (no bf16 rounding between) after every optimizer step; no bf16 weight exists.
// The emulated MXFP8 / NVFP4 experts (EmulatedQuant) follow the same three modes.
enum class Fp8WeightRefresh : uint8_t { kEveryForward, kOnRequest, kFromMaster };

// Emulated compute in a Blackwell format (docs/layer.md, emulated MXFP8 / NVFP4). Hopper has no
// tensor-core path for MXFP8 or NVFP4, so every GEMM operand is quantized in the format -- bitwise
// the codes and scales of moe::quantize, round to nearest (no stochastic rounding of gradients, no
// random Hadamard transform) -- and its dequantized values (rounded to bf16) feed the bf16 grouped
// GEMMs: tokens (x_perm, act, dY, dh) with 1-D blocks along the GEMM's reduction, each expert's rows
// quantized as a matrix of their own (MXFP8 1x32 / 32x1; NVFP4 1x16 / 16x1 with one global amax per
// expert), weights with MXFP8 1x32 / 32x1 or NVFP4 16x16 blocks (one global amax per expert
// matrix). h, the activation, the bias and all gradients between the GEMMs stay bf16. The weight
// copies follow fp8_weight_refresh (every forward, on request, or from fp32 master weights:
// quantized primary weights).
enum class EmulatedQuant : uint8_t { kNone, kMXFP8, kNVFP4 };
const char* emulated_quant_name(EmulatedQuant q);  // "none", "mxfp8", "nvfp4"

// The experts alone (GroupedExperts): the expert MLP over rows already dispatched into ragged
// groups, x_perm [rows <= max_rows, H].
struct ExpertsConfig {
  int64_t hidden = 0;    // H
  int64_t ffn = 0;       // F
  int experts = 0;       // E
  int64_t max_rows = 0;  // R, the static bound on rows of x_perm
  ActivationParams activation;
  bool bias = false;
  ProbsPlacement probs = ProbsPlacement::kInActivation;  // kAtCombine: the experts never see probs
  WeightLayout layout = WeightLayout::kSingleGrouped;
  WgradMode wgrad = WgradMode::kWrite;
  DType wgrad_dtype = DType::kBF16;  // kWrite: bf16 or fp32
  bool delay_wgrad = false;
  DType dtype = DType::kBF16;  // activations and weights
  // fc1, its bias and the activation x prob in one kernel (docs/fused.md), same roundings as the
  // unfused path (grouped GEMM into h, bias, activation), which stays the reference.
  bool fuse_fc1 = false;
  // fc2 dgrad and the activation backward (dh, dprobs) in one kernel (docs/fused.md): dact never
  // reaches memory; same roundings of dh as the unfused path, which stays the reference.
  bool fuse_fc2_dgrad = false;
  // With fuse_fc2_dgrad and F > 256 the fused fc2 dgrad sums dprobs over blocks of 256 features in
  // a fixed order, from one partial sum per row and block (R x ceil(F / 256) floats). true: those
  // partials live in dx_perm's memory, which the backward writes only after they are summed,
  // instead of a workspace of the op's own -- then dx_perm must not overlap dY (backward) or dy /
  // dY_out (backward_gathered), which is checked. Bitwise the same results.
  bool dprobs_partials_in_dx_perm = false;
  // 0: the persistent GEMM kernels take every SM of the device. n > 0: at most n SMs, so that work
  // running beside the experts (the all-to-all of an overlapped expert-parallel pipeline) finds
  // SMs free instead of waiting for a GEMM to finish (rounded down to an even count of at least 2:
  // the kernels run clusters of 2 CTAs). Bitwise the same results.
  int max_sms = 0;
  // Each expert's weight matrices stored transposed: fc1.weight [E, H, fc1_out] and fc2.weight
  // [E, F, H] (per expert [H, fc1_out] and [F, H]), their gradients in the same shapes -- the
  // orientation of Hugging Face's transposed experts (GPT-OSS: gate_up_proj [E, H, 2F]). Read in
  // place by the grouped GEMMs (docs/gemm.md, transposed weights); the fused kernels read the
  // standard orientation only, so fuse_fc1 and fuse_fc2_dgrad must be off.
  bool transposed_weights = false;
  // FP8 compute (see Fp8Recipe). kBlock needs: H and F multiples of 16, max_rows a multiple of 16,
  // the unfused path (fuse_fc1 and fuse_fc2_dgrad off), the standard weight orientation (with
  // delay_wgrad a state also keeps the columnwise FP8 copies of dY and dh, (H + fc1_out) bytes a
  // row and their scales); every expert's rows must fill whole 128-row blocks -- start on a 128-row boundary and
  // end on one or at the end of x_perm (dispatch with A = 128): the FP8 weight gradients read
  // 128-token scale blocks (a group that does not is skipped and raises kErrUnalignedGroup, see
  // GroupedExperts::check_errors).
  Fp8Recipe fp8 = Fp8Recipe::kNone;
  Fp8WeightRefresh fp8_weight_refresh = Fp8WeightRefresh::kEveryForward;
  // Emulated MXFP8 / NVFP4 compute (see EmulatedQuant): needs hidden and ffn multiples of the block
  // (32 for MXFP8, 16 for NVFP4), the unfused path, the standard weight orientation, no fp8.
  EmulatedQuant emulated = EmulatedQuant::kNone;
  // Windows of rows (docs/state.md, token chunks): the forwards stop after the activation (Y is an
  // empty view) and the backwards compute no dx_perm; GroupedExperts::fc2_rows and fc1_dgrad_rows
  // compute those two products for windows of each group's rows instead, the same bits per row.
  // bf16 only (no fp8, no emulated format), no bias.
  bool row_windows = false;

  int64_t fc1_out() const { return fc1_out_features(activation.kind, ffn); }
  void validate() const;  // throws moe::Error naming the bad field
};

struct GroupedMlpConfig {
  int64_t hidden = 0;      // H
  int64_t ffn = 0;         // F
  int experts = 0;         // E (held by this GPU)
  int topk = 0;            // k (top-k form; the bound on experts per token in map form)
  int64_t max_tokens = 0;  // T_max
  RoutingForm routing_form = RoutingForm::kTopK;
  DispatchOptions dispatch;  // alignment, pre-padded input, row bound R

  ActivationParams activation;
  bool bias = false;
  ProbsPlacement probs = ProbsPlacement::kInActivation;

  WeightLayout layout = WeightLayout::kSingleGrouped;
  WgradMode wgrad = WgradMode::kWrite;
  DType wgrad_dtype = DType::kBF16;  // kWrite: bf16 or fp32
  bool delay_wgrad = false;
  DType dtype = DType::kBF16;  // activations and weights
  // Activation recompute: a forward saves only the caller's x and the dispatch plan; backward
  // permutes x again and recomputes fc1 and the activation (bitwise the same gradients). The
  // caller keeps x alive and unchanged until backward. Not combinable with delay_wgrad.
  bool recompute = false;
  // The fused fc1 (see ExpertsConfig::fuse_fc1), which here also gathers the rows of x through the
  // dispatch map: no separate permute pass (the kernel writes x_perm for the backward while its
  // tensor cores work). Same results, same saved state and contract as the unfused path.
  bool fuse_fc1 = false;
  // false (needs fuse_fc1): no x_perm at all -- the fc1 weight gradient gathers the rows of x as the
  // forward did, so a state keeps the caller's x by address (unchanged until backward, or
  // backward_dw in delayed mode) instead of an [R, H] copy: R * H * 2 bytes less per micro-batch in
  // flight. Same results (docs/fused.md has the measurements).
  bool save_x_perm = true;
  // The fused fc2 dgrad (see ExpertsConfig::fuse_fc2_dgrad), which here also gathers the rows of dy
  // through the dispatch map (probs in the activation): no separate pass builds dY_perm. Without
  // bias, delay_wgrad or saved x_perm, dY_perm never exists: the fc2 weight gradient gathers dy too.
  bool fuse_fc2_dgrad = false;
  int max_sms = 0;  // see ExpertsConfig::max_sms
  bool transposed_weights = false;  // see ExpertsConfig::transposed_weights
  // FP8 compute of the experts (see ExpertsConfig::fp8): needs dispatch.align = 128 or 256 (each
  // expert's rows fill whole 128-row blocks); the row bound is rounded up to a multiple of 16.
  Fp8Recipe fp8 = Fp8Recipe::kNone;
  Fp8WeightRefresh fp8_weight_refresh = Fp8WeightRefresh::kEveryForward;
  // Emulated MXFP8 / NVFP4 compute (see ExpertsConfig::emulated). dispatch.align = 32 (MXFP8) or
  // 16 (NVFP4) gives every expert whole columnwise blocks, as Blackwell's grouped GEMMs need;
  // other alignments quantize each expert's last block as a partial one.
  EmulatedQuant emulated = EmulatedQuant::kNone;
  // Token chunks (docs/state.md). 1: the experts' output for every routed row -- Y in the forward,
  // dx_perm in the backward, [R, H] each -- exists at once in the layer's workspace. n > 1: both are
  // made and consumed in n pieces of consecutive tokens (fc2, then the combine of the piece's tokens;
  // the fc1 dgrad, then the sum of the piece's tokens' rows), so the workspace holds one piece:
  // about (n - 1) / n of R x H x 2 bytes less, for n launches of fc2 and of the fc1 dgrad instead of
  // one and more partly filled GEMM tiles. Bitwise the same results. Needs the probs in the
  // activation, bf16 experts (no fp8, no emulated format), no bias and the fused fc2 dgrad
  // gathering dy (fuse_fc2_dgrad, with save_x_perm = false or delay_wgrad).
  int token_chunks = 1;

  int64_t fc1_out() const { return fc1_out_features(activation.kind, ffn); }
  int64_t row_bound() const;  // R resolved from dispatch options
  // Rows of one token chunk's packed windows: min(R, ceil(max_tokens / token_chunks) x slots).
  int64_t chunk_row_bound() const;
  ExpertsConfig experts_config() const;  // the experts part, max_rows = row_bound()
  DispatcherConfig dispatcher_config() const;  // the dispatch part, row_bound = row_bound()
  void validate() const;      // throws moe::Error naming the bad field
};

}  // namespace moe
