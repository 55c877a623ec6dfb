// moe::GroupedExperts: the expert MLP over dispatched rows, composed from the grouped GEMM,
// activation and bias kernels. This file checks arguments, plans memory and orders the stages;
// the math lives in the kernels it calls.
//
// Forward:  fc1 (+b1) -> act x p -> fc2 (+b2 p)     (fc1 to act x p in one kernel with fuse_fc1)
//           (FP8: forward_gathered / backward_gathered quantize the rows of x / dy gathered through
//           the row map: no x_perm or dY_perm in bf16)
// Backward: [fc2 wgrad] -> fc2 dgrad -> act bwd (+dp) -> fc1 dgrad -> [fc1 wgrad]
//           (weight gradients deferred to backward_dw in delayed mode; fc2 dgrad to act bwd in one
//           kernel with fuse_fc2_dgrad, which leaves act as it is: fc2's wgrad may run after it)
//
// Memory: the saved state holds h and act and refers to x_perm -- or, filled by forward_gathered
// without x_perm_out, to x and the row map, from which the fc1 weight gradient gathers its rows
// (fused/wgrad_gathered.h). The activation backward writes dh over h (in place: h is not read
// again), where backward_dw finds it in delayed mode;
// the op's workspace holds what one backward needs only while it runs: dact
// (delayed: act must survive until backward_dw; otherwise dact overwrites act once fc2's wgrad
// has read it; FP8 writes it into act's workspace, its weight gradient reading act's quantized
// copy), the bias-gradient workspace and the GEMM call workspace.
// With fuse_fc2_dgrad (not delayed) the state holds h only: act lives in the workspace, where the
// forward's fc2 reads it and the fused fc2 dgrad writes it again from h (the same fp32 math and
// rounding, so bitwise the forward's act) for fc2's weight gradient -- R x F x 2 bytes less per
// micro-batch in flight.
#include "moe/grouped_experts.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "device/pointer_table.h"
#include "device/state_check.h"
#include "fused/fc1_activation.h"
#include "fused/fc2_dgrad_activation.h"
#include "fused/wgrad_gathered.h"
#include "layer/bound_ranges.h"
#include "layer/emulated_experts.h"
#include "layer/fp8_experts.h"
#include "moe/activation_ops.h"
#include "moe/bias_ops.h"
#include "moe/error.h"
#include "moe/error_word.h"
#include "moe/grouped_gemm.h"

namespace moe {

namespace {

constexpr std::array<Param, 4> kHookOrder = {Param::kFc2Weight, Param::kFc2Bias, Param::kFc1Weight, Param::kFc1Bias};

// The views of one parameter in a layout, checked.
void check_param_views(const std::vector<TensorView>& views, const char* name, int64_t E, WeightLayout layout,
                       const std::vector<int64_t>& expert_shape, DType dtype) {
  if (layout == WeightLayout::kSingleGrouped) {
    MOE_CHECK(views.size() == 1, "argument '", name, "': single-grouped layout expects 1 tensor, got ", views.size());
    std::vector<int64_t> s{E};
    s.insert(s.end(), expert_shape.begin(), expert_shape.end());
    check_device_tensor(views[0], name, dtype, s);
  } else {
    MOE_CHECK(static_cast<int64_t>(views.size()) == E, "argument '", name, "': per-expert layout expects ", E,
              " tensors, got ", views.size());
    for (const TensorView& v : views) check_device_tensor(v, name, dtype, expert_shape);
  }
}

// Gradients may be bound in either layout, independently of the weights' layout (e.g. one grouped
// gradient buffer for per-expert weights): a single view with the extra leading E dimension is
// single grouped.
WeightLayout layout_of(const std::vector<TensorView>& views, size_t expert_ndim, int experts) {
  return views.size() == 1 && experts >= 1 && views[0].ndim == static_cast<int>(expert_ndim) + 1
             ? WeightLayout::kSingleGrouped
             : WeightLayout::kPerExpert;
}

TensorView bf16_view(void* p, int64_t rows, int64_t cols) {
  return TensorView(p, DType::kBF16, {rows, cols}, Device::kCUDA);
}

// Marks header 1 of a state whose fc1 weight gradient gathers the rows of x.
constexpr int32_t kGatheredHeader = 1;

// Saved state layout. Header 0: pointer = x_perm, reserved = group offsets, probs_perm, dY (delayed;
// 0 after an FP8 backward_gathered, which keeps dY's quantized copies instead);
// header 1 (gathered fc1 weight gradient): kind = 1, pointer = x, tokens = its rows, reserved =
// row_slots, slots.
struct StateBuffers {
  uint16_t *h = nullptr, *act = nullptr;  // h becomes dh in backward
  Fp8ExpertsRecipe::SavedCopies fp8;      // FP8 recipe: the columnwise copies of x_perm, act (and dY, dh)
};

}  // namespace

struct GroupedExperts::Impl {
  ExpertsConfig cfg;
  uint64_t serial = next_op_serial();
  int64_t R = 0;
  GroupedGemm gemm;
  std::unique_ptr<Fp8ExpertsRecipe> fp8;  // config.fp8 != kNone
  std::unique_ptr<EmulatedExpertsRecipe> emu;  // config.emulated != kNone
  ErrorWord errors;                       // FP8 weight gradients: groups off the 128-row grid
  std::array<std::vector<Hook>, 4> hooks;

  // Bound parameters and gradients; binding counts weight bindings (a forward records it).
  bool have_weights = false, have_grads = false;
  uint64_t binding = 0;
  uint64_t fp8_refreshed = 0;  // the binding the FP8 weight copies were last made (or loaded) for
  ExpertMatrices w1, w2, dw1, dw2;
  ExpertRows b1, b2, db1, db2;
  std::vector<BoundRange> weight_ranges;  // their bytes: no gradient bound over a weight
  // Device tables of per-expert bias row pointers (b1, b2, db1, db2): a new table per binding, the
  // old one freed (cudaFree waits for kernels in flight), never rewritten in place.
  std::shared_ptr<void> bias_tables[4];

  // Workspace.
  DeviceBuffer block;
  size_t block_bytes = 0, state_bytes = 0;
  uint16_t* dact_ws = nullptr;
  uint16_t* act_ws = nullptr;  // act, when the state does not keep it (saves_act() false)
  // Fused fc2 dgrad with F > 256: dprobs partial sums per feature block (unless they live in dx_perm).
  float* dpp_partial_ws = nullptr;
  int feature_blocks = 1;  // of the fused fc2 dgrad
  uint8_t* bias_ws = nullptr;
  size_t bias_ws_bytes = 0;
  uint8_t* gemm_ws = nullptr;
  size_t gemm_ws_bytes = 0;
  int* tile_counter = nullptr;  // the gathered weight gradients' tile queue (zeroed once, left zero)
  int sm_count = 0;

  // FP8 experts: the engine's workspace also holds the weight scales restated per 64 rows, for the
  // 192-wide fprop-form tiles (GroupedGemm's max_weight_dim: the largest weight dimension).
  explicit Impl(const ExpertsConfig& c)
      : cfg((c.validate(), c)), R(c.max_rows),
        gemm(c.experts, c.max_rows, c.max_sms,
             c.fp8 != Fp8Recipe::kNone ? std::max({c.fc1_out(), c.hidden, c.ffn}) : 0) {
    if (cfg.fuse_fc1) {
      const std::string why = fused::fc1_activation_unsupported(cfg.experts, cfg.hidden, cfg.ffn, cfg.activation);
      MOE_CHECK(why.empty(), "config 'fuse_fc1': ", why);
      MOE_CHECK(cfg.dtype == DType::kBF16, "config 'fuse_fc1': the fused fc1 takes bf16 activations and weights");
    }
    if (cfg.fuse_fc2_dgrad) {
      const std::string why = fused::fc2_dgrad_activation_unsupported(cfg.experts, cfg.hidden, cfg.ffn, cfg.activation);
      MOE_CHECK(why.empty(), "config 'fuse_fc2_dgrad': ", why);
      MOE_CHECK(cfg.dtype == DType::kBF16, "config 'fuse_fc2_dgrad': the fused fc2 dgrad takes bf16 activations and ",
                "weights");
      feature_blocks = fused::fc2_dgrad_feature_blocks(cfg.ffn);
      // A row of dx_perm (H bf16) holds the row's partial sums (one float per feature block).
      MOE_CHECK(!cfg.dprobs_partials_in_dx_perm || 2 * cfg.hidden >= 4 * feature_blocks,
                "config 'dprobs_partials_in_dx_perm': a row of dx_perm (hidden = ", cfg.hidden, ") is too short for ",
                feature_blocks, " partial sums");
    }
    sm_count = gemm.sm_count();  // the fused kernels' persistent grids: the same SMs as the GEMMs'
    gemm_ws_bytes = gemm.workspace_bytes();
    if (cfg.fp8 != Fp8Recipe::kNone) fp8 = std::make_unique<Fp8ExpertsRecipe>(cfg);
    if (cfg.emulated != EmulatedQuant::kNone) emu = std::make_unique<EmulatedExpertsRecipe>(cfg);
    plan_workspace(nullptr);
    block = cuda_malloc_allocator().allocate(block_bytes);
    plan_workspace(static_cast<char*>(block.get()));
    MOE_CUDA_CHECK(cudaMemset(tile_counter, 0, sizeof(int)));
    state_layout(nullptr, &state_bytes);
  }

  bool probs_in_act() const { return cfg.probs == ProbsPlacement::kInActivation; }
  // Whether a state keeps act: the unfused backward writes dact over it (or, delayed, backward_dw
  // reads it after the forward's act workspace may have been reused); the fused fc2 dgrad
  // recomputes it from h.
  // With FP8 the weight gradient reads act's columnwise copy instead.
  bool saves_act() const { return !fp8 && (!cfg.fuse_fc2_dgrad || cfg.delay_wgrad); }
  bool accumulate() const { return cfg.wgrad == WgradMode::kAccumulate; }

  void plan_workspace(char* base) {
    const int64_t H = cfg.hidden, F = cfg.ffn, F1 = cfg.fc1_out();
    DeviceArena a(base);
    // FP8 writes dact into act's workspace (its weight gradient reads act's quantized copy).
    if (cfg.delay_wgrad && !cfg.fuse_fc2_dgrad && !fp8) dact_ws = a.take<uint16_t>(R * F);
    if (!saves_act()) act_ws = a.take<uint16_t>(R * F);
    if (probs_in_act() && feature_blocks > 1 && !cfg.dprobs_partials_in_dx_perm)
      dpp_partial_ws = a.take<float>(R * feature_blocks);
    if (cfg.bias) {
      bias_ws_bytes = std::max(bias_grad_workspace_bytes(R, cfg.experts, H), bias_grad_workspace_bytes(R, cfg.experts, F1));
      bias_ws = a.take<uint8_t>(static_cast<int64_t>(bias_ws_bytes));
    }
    gemm_ws = a.take<uint8_t>(static_cast<int64_t>(gemm_ws_bytes));
    tile_counter = a.take<int>(1);
    if (fp8) fp8->plan_workspace(a);
    if (emu) emu->plan_workspace(a);
    block_bytes = a.used();
  }

  StateBuffers state_layout(char* base, size_t* bytes = nullptr) const {
    const int64_t F = cfg.ffn, F1 = cfg.fc1_out();
    DeviceArena a(base);
    StateBuffers b;
    b.h = a.take<uint16_t>(R * F1);
    b.act = saves_act() ? a.take<uint16_t>(R * F) : act_ws;
    if (fp8) b.fp8 = fp8->plan_state(a);
    if (bytes) *bytes = a.used();
    return b;
  }

  TensorView gemm_workspace() const {
    return TensorView(gemm_ws, DType::kUInt8, {static_cast<int64_t>(gemm_ws_bytes)}, Device::kCUDA);
  }
  TensorView bias_workspace() const {
    return TensorView(bias_ws, DType::kUInt8, {static_cast<int64_t>(bias_ws_bytes)}, Device::kCUDA);
  }

  // The expert matrices of a weight (or its gradient), in the configured orientation.
  ExpertMatrices matrices(const std::vector<TensorView>& views, WeightLayout layout, const char* name) const {
    ExpertMatrices m = layout == WeightLayout::kSingleGrouped ? ExpertMatrices::grouped(views[0], name)
                                                              : ExpertMatrices::per_expert(views, name);
    return cfg.transposed_weights ? m.as_transposed() : m;
  }
  // The stored shape of one expert's matrix W_e [rows, cols]: transposed when so configured.
  std::vector<int64_t> stored(int64_t rows, int64_t cols) const {
    return cfg.transposed_weights ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{rows, cols};
  }
  // Bias rows; per-expert layout uploads the E row pointers into table slot `slot` (synchronously:
  // this happens when parameters are bound, never inside forward/backward).
  ExpertRows rows(const std::vector<TensorView>& views, WeightLayout layout, int slot) {
    if (layout == WeightLayout::kSingleGrouped) return ExpertRows::single_grouped(views[0]);
    std::vector<const void*> ptrs;
    for (const TensorView& t : views) ptrs.push_back(t.data);
    bias_tables[slot] = upload_pointer_table(ptrs);
    return ExpertRows::per_expert(static_cast<void* const*>(bias_tables[slot].get()), views[0].dtype, cfg.experts,
                                  views[0].shape[views[0].ndim - 1]);
  }

  void check_bias_views(const std::vector<TensorView>& views, const char* name, WeightLayout layout, int64_t n,
                        DType dtype) const {
    if (!cfg.bias) {
      MOE_CHECK(views.empty(), "argument '", name, "': the experts have no biases (config.bias = false)");
      return;
    }
    check_param_views(views, name, cfg.experts, layout, {n}, dtype);
  }

  // FP8 or emulated: the quantized weight copies a forward uses -- made now (kEveryForward), or
  // checked to be current.
  bool quantized_weights() const { return fp8 || emu; }
  void quantize_weights(cudaStream_t s) const {
    if (fp8) fp8->quantize_weights(s);
    if (emu) emu->quantize_weights(s);
  }
  void fp8_weights(cudaStream_t s, const char* call) {
    if (!quantized_weights()) return;
    if (cfg.fp8_weight_refresh == Fp8WeightRefresh::kEveryForward) {
      quantize_weights(s);
      fp8_refreshed = binding;
      return;
    }
    MOE_CHECK(fp8_refreshed == binding, call, ": the quantized weight copies were not made since the last ",
              "set_weights (config.fp8_weight_refresh = on request / from master: call refresh_fp8_weights after ",
              "every change of the weights)");
  }
  // dx [rows, K] = dy [rows, N] W (fc 1 or 2); emulated: the quantized dy times the dequantized
  // columnwise weight copy.
  void dgrad(int fc, const TensorView& dy, const TensorView& g, const TensorView& dx, cudaStream_t s) const {
    if (emu)
      emu->dgrad(fc, gemm, emu->tokens(dy, g, /*columnwise=*/false, 0, s), g, dx, gemm_workspace(), s);
    else
      gemm.dgrad(dy, fc == 1 ? w1 : w2, g, dx, gemm_workspace(), s);
  }
  // fc (1 or 2)'s weight gradient dW = dy^T x over each expert's rows; emulated: from both operands'
  // columnwise quantizations.
  void wgrad(int fc, const TensorView& dy, const TensorView& x, const TensorView& g, cudaStream_t s) const {
    const ExpertMatrices& dw = fc == 1 ? dw1 : dw2;
    if (emu)
      gemm.wgrad(emu->tokens(dy, g, /*columnwise=*/true, 0, s), emu->tokens(x, g, /*columnwise=*/true, 1, s), g, dw,
                 accumulate(), gemm_workspace(), s);
    else
      gemm.wgrad(dy, x, g, dw, accumulate(), gemm_workspace(), s);
  }

  void fire_hooks(Param p) {
    if (!cfg.bias && (p == Param::kFc1Bias || p == Param::kFc2Bias)) return;
    for (auto& hook : hooks[static_cast<int>(p)]) hook(p);
  }

  // Inputs of a forward, checked; returns rows.
  int64_t check_inputs(const TensorView& x_perm, const TensorView& group_offsets, const TensorView& probs_perm,
                       const char* call) const {
    MOE_CHECK(have_weights, call, ": no weights bound (call set_weights first)");
    MOE_CHECK(x_perm.ndim == 2 && x_perm.shape[1] == cfg.hidden, "argument 'x_perm': expected shape [rows, ",
              cfg.hidden, "], got ", x_perm.shape_string());
    const int64_t rows = x_perm.shape[0];
    MOE_CHECK(rows <= R, "argument 'x_perm': ", rows, " rows exceed config.max_rows = ", R);
    MOE_CHECK(!fp8 || rows % 16 == 0, "argument 'x_perm': the FP8 experts need rows in multiples of 16 (the ",
              "weight gradients' columnwise copies), got ", rows);
    check_device_tensor(x_perm, "x_perm", cfg.dtype, {rows, cfg.hidden});
    check_device_tensor(group_offsets, "group_offsets", DType::kInt32, {int64_t(cfg.experts) + 1}, 4);
    if (probs_in_act())
      check_device_tensor(probs_perm, "probs_perm", DType::kFP32, {rows}, 4);
    else
      MOE_CHECK(probs_perm.data == nullptr, "argument 'probs_perm': the experts do not apply probs ",
                "(config.probs = at combine); pass an empty view");
    return rows;
  }

  // A forward's Y: [rows, H], or an empty view with windows of rows (fc2_rows computes fc2 then).
  void check_Y(const TensorView& Y, int64_t rows) const {
    if (cfg.row_windows)
      MOE_CHECK(Y.data == nullptr, "argument 'Y': with config.row_windows the forward stops after the activation ",
                "(fc2_rows computes fc2 window by window); pass an empty view");
    else
      check_device_tensor(Y, "Y", cfg.dtype, {rows, cfg.hidden});
  }

  // fc1 (+b1) and the activation into the state's buffers.
  void activations(const TensorView& x_perm, const TensorView& g, const TensorView& pp, const StateBuffers& b,
                   int64_t rows, cudaStream_t s) const {
    if (cfg.fuse_fc1) return fused_activations(x_perm.data, nullptr, 1, g, pp, b, rows, s);
    const int64_t F = cfg.ffn, F1 = cfg.fc1_out();
    if (fp8) {
      fp8->quantize(x_perm, /*rowwise=*/true, b.fp8.x_col, b.fp8.x_col_scale, s);
      return fc1_from_quantized(g, b, rows, s);
    }
    if (emu) {
      emu->fprop(1, gemm, emu->tokens(x_perm, g, /*columnwise=*/false, 0, s), g, bf16_view(b.h, rows, F1),
                 gemm_workspace(), s);
    } else {
      gemm.fprop(x_perm, w1, g, bf16_view(b.h, rows, F1), gemm_workspace(), s);
    }
    if (cfg.bias) bias_add(bf16_view(b.h, rows, F1), b1, TensorView(), g, s);
    activation_forward(cfg.activation, bf16_view(b.h, rows, F1), pp, g, bf16_view(b.act, rows, F), s);
  }
  // FP8, after x_perm's copies were made (quantized from x_perm, or gathered from x): fc1 (+b1) into
  // h. act is computed where it is quantized (fc2_forward, recompute), never stored.
  void fc1_from_quantized(const TensorView& g, const StateBuffers& b, int64_t rows, cudaStream_t s) const {
    const TensorView h = bf16_view(b.h, rows, cfg.fc1_out());
    fp8->fprop(1, gemm, gemm_workspace(), g, h, s);
    if (cfg.bias) bias_add(h, b1, TensorView(), g, s);
  }

  // fc2 of a forward: Y = act W2^T (+ b2 p). FP8: act's two copies in one pass over h (act itself is
  // not stored), the rowwise one for this product and the columnwise one saved for fc2's weight
  // gradient.
  void fc2_forward(const StateBuffers& b, const TensorView& g, const TensorView& pp, const TensorView& Y, int64_t rows,
                   cudaStream_t s) const {
    const TensorView act = bf16_view(b.act, rows, cfg.ffn);
    if (fp8) {
      fp8->quantize_activation(cfg.activation, bf16_view(b.h, rows, cfg.fc1_out()), pp, g, /*rowwise=*/true,
                               b.fp8.act_col, b.fp8.act_col_scale, s);
      fp8->fprop(2, gemm, gemm_workspace(), g, Y, s);
    } else if (emu) {
      emu->fprop(2, gemm, emu->tokens(act, g, /*columnwise=*/false, 0, s), g, Y, gemm_workspace(), s);
    } else {
      gemm.fprop(act, w2, g, Y, gemm_workspace(), s);
    }
    if (cfg.bias) bias_add(Y, b2, pp, g, s);
  }

  // The same in one kernel; A rows from `a` directly (row_slots null) or gathered through row_slots.
  void fused_activations(const void* a, const int32_t* row_slots, int slots, const TensorView& g, const TensorView& pp,
                         const StateBuffers& b, int64_t rows, cudaStream_t s, void* a_out = nullptr) const {
    fused::Fc1ActivationArgs f;
    f.a = a;
    f.a_out = a_out;
    f.row_slots = row_slots;
    f.slots = slots;
    f.group_offsets = g.ptr<const int32_t>();
    f.experts = cfg.experts;
    f.R = rows;
    f.H = static_cast<int>(cfg.hidden);
    f.F = static_cast<int>(cfg.ffn);
    f.w1_base = w1.base();
    f.w1_stride_bytes = w1.expert_stride_bytes();
    f.w1_table = w1.device_table();
    if (cfg.bias) {
      f.b1_base = b1.stacked;
      f.b1_table = b1.table;
    }
    f.probs = pp.data != nullptr ? pp.ptr<const float>() : nullptr;
    f.activation = cfg.activation;
    f.h = b.h;
    f.act = b.act;
    f.sm_count = sm_count;
    fused::launch_fc1_activation(f, s);
  }

  // x_perm: the rows the fc1 weight gradient reads; or, when `gathered` is given, none, and the
  // gradient gathers them from x through the row map.
  struct Gathered {
    TensorView x, row_slots;
    int slots = 1;
  };
  void fill_header(const SavedState& st, const TensorView& x_perm, const TensorView& g, const TensorView& pp,
                   int64_t rows, const Gathered* gathered = nullptr) const {
    mark_filled(st, serial, StateKind::kExperts, rows);
    StateHeader& h = st.header(0);
    h.binding = binding;
    h.pointer = reinterpret_cast<uint64_t>(x_perm.data);
    h.reserved[0] = reinterpret_cast<uint64_t>(g.data);
    h.reserved[1] = reinterpret_cast<uint64_t>(pp.data);
    set_gathered(st, gathered);
  }
  static void set_gathered(const SavedState& st, const Gathered* gathered) {
    StateHeader& x = st.header(1);
    x = StateHeader{};
    if (gathered == nullptr) return;
    x.kind = kGatheredHeader;
    x.pointer = reinterpret_cast<uint64_t>(gathered->x.data);
    x.tokens = gathered->x.shape[0];
    x.reserved[0] = reinterpret_cast<uint64_t>(gathered->row_slots.data);
    x.reserved[1] = static_cast<uint64_t>(gathered->slots);
  }

  // The saved inputs of a filled state, as views.
  struct Saved {
    int64_t rows;
    TensorView x_perm, g, pp;
    bool gathered = false;
    Gathered from_x;
    StateBuffers b;
  };
  Saved saved(const SavedState& st) const {
    const StateHeader& h = st.header(0);
    Saved v;
    v.rows = h.tokens;
    v.x_perm = bf16_view(reinterpret_cast<void*>(h.pointer), v.rows, cfg.hidden);
    const StateHeader& x = st.header(1);
    v.gathered = x.kind == kGatheredHeader;
    if (v.gathered) {
      v.from_x.x = bf16_view(reinterpret_cast<void*>(x.pointer), x.tokens, cfg.hidden);
      v.from_x.row_slots =
          TensorView(reinterpret_cast<void*>(x.reserved[0]), DType::kInt32, {v.rows}, Device::kCUDA);
      v.from_x.slots = static_cast<int>(x.reserved[1]);
    }
    v.g = TensorView(reinterpret_cast<void*>(h.reserved[0]), DType::kInt32, {int64_t(cfg.experts) + 1},
                     Device::kCUDA);
    v.pp = probs_in_act() ? TensorView(reinterpret_cast<void*>(h.reserved[1]), DType::kFP32, {v.rows}, Device::kCUDA)
                          : TensorView();
    v.b = state_layout(static_cast<char*>(st.device()));
    return v;
  }

  void check_x_perm(const Saved& v, const char* call) const {
    // FP8 backwards read the saved FP8 copy of x_perm instead.
    MOE_CHECK(v.x_perm.data != nullptr || v.gathered || v.rows == 0 || fp8, "argument 'state' of ", call,
              ": it refers to neither x_perm nor x (relocate() or relocate_gathered() it first)");
  }

  // dW_e = Y_e^T X_e with the rows of X gathered through a row map (fused/wgrad_gathered.h): Y the
  // contiguous [rows, M] operand, X the token-major rows; stored [N, M] when x_major.
  void wgrad_gathered(const void* y, int64_t M, const Gathered& x, const ExpertMatrices& dw, bool x_major,
                      const Saved& v, cudaStream_t s) const;
  // Where the fused fc2 dgrad keeps its dprobs partial sums in this call: the op's workspace, or
  // dx_perm's memory (config.dprobs_partials_in_dx_perm), which must not overlap `reads` (the dY or
  // dy the kernel reads) or `writes` (dY_out).
  float* dprobs_partials(const TensorView& dx_perm, const TensorView& reads, const TensorView& writes,
                         const char* call) const;
  // act is recomputed on the way only where fc2's weight gradient will read it (`recompute_act`).
  void fused_dgrad(const void* dY, const int32_t* row_slots, int slots, void* dY_out, float* dprobs_partial,
                   const Saved& v, const TensorView& dpp, bool recompute_act, cudaStream_t s) const;
  // The backward's checks shared by backward and backward_gathered; returns the saved inputs.
  Saved check_backward(const SavedState& state, const TensorView& dx_perm, const TensorView& dpp,
                       WeightGrads weight_grads, const char* call) const;
  // fc2_rows (fprop from act) and fc1_dgrad_rows (dgrad from dh): the state checked for `statuses`.
  void run_windows(GemmOp op, const SavedState& state, std::initializer_list<StateStatus> statuses,
                   const TensorView& row_begin, const TensorView& offsets, const TensorView& out, const char* call,
                   cudaStream_t s);
  // fc1's weight gradient from dh (written over h), the state consumed, the hooks.
  void finish_fc1(const SavedState& state, const Saved& v, cudaStream_t s);
  // After fc2's gradients: fc1 dgrad, then (unless delayed or skipped) fc1's weight gradients and the hooks.
  void finish_backward(const SavedState& state, const Saved& v, const TensorView& dY, const TensorView& dx_perm,
                       WeightGrads weight_grads, cudaStream_t s);
  void relocate_inputs(const SavedState& state, const TensorView& group_offsets, const TensorView& probs_perm,
                       const TensorView* dY) const;
  // FP8: where the backward writes the columnwise copies of dY and dh and the weight gradients read
  // them: the recipe's transient workspace, or with delayed weight gradients the state (backward_dw
  // runs after other micro-batches' backwards).
  struct ColCopy {
    uint8_t* data = nullptr;
    float* scale = nullptr;
  };
  ColCopy dy_col(const Saved& v) const {
    return cfg.delay_wgrad ? ColCopy{v.b.fp8.dy_col, v.b.fp8.dy_col_scale}
                           : ColCopy{fp8->col_workspace(), fp8->col_workspace_scale()};
  }
  ColCopy dh_col(const Saved& v) const {
    return cfg.delay_wgrad ? ColCopy{v.b.fp8.dh_col, v.b.fp8.dh_col_scale}
                           : ColCopy{fp8->col_workspace(), fp8->col_workspace_scale()};
  }
  // FP8: from dY's columnwise copy (the backward quantized it) and act's saved one.
  void wgrad_fc2(const TensorView& dY, const Saved& v, cudaStream_t s) {
    if (fp8) {
      const ColCopy col = dy_col(v);
      fp8->wgrad(gemm, gemm_workspace(), v.g, v.rows, col.data, col.scale, cfg.hidden, v.b.fp8.act_col,
                 v.b.fp8.act_col_scale, cfg.ffn, dw2, accumulate(), errors.device_ptr(), s);
    } else {
      wgrad(2, dY, bf16_view(v.b.act, v.rows, cfg.ffn), v.g, s);
    }
    if (cfg.bias) bias_grad(dY, v.pp, v.g, db2, accumulate(), bias_workspace(), s);
  }
  // FP8, after dY's copies were made (quantized from dY, or gathered from dy): the fc2 dgrad into
  // act's workspace (the weight gradient reads act's saved columnwise copy), fc2's weight
  // gradients unless delayed or skipped (dY bf16 for the bias gradient only: empty without bias),
  // the activation backward: without the fc1 bias straight into dh's FP8 copies (dh itself is never
  // written), otherwise dh over h, quantized by finish_backward.
  void fp8_fc2_backward(const TensorView& dY, const Saved& v, const TensorView& dpp, WeightGrads weight_grads,
                        cudaStream_t s) {
    const int64_t rows = v.rows, F = cfg.ffn, F1 = cfg.fc1_out();
    fp8->dgrad(2, gemm, gemm_workspace(), v.g, bf16_view(v.b.act, rows, F), s);
    if (weight_grads == WeightGrads::kCompute && !cfg.delay_wgrad) wgrad_fc2(dY, v, s);
    const TensorView dprobs = probs_in_act() ? dpp : TensorView();
    if (fp8->fused_activation_grad()) {
      const ColCopy dh = dh_col(v);
      fp8->quantize_activation_grad(cfg.activation, bf16_view(v.b.h, rows, F1), v.pp, bf16_view(v.b.act, rows, F),
                                    v.g, dprobs, dh.data, dh.scale, s);
    } else {
      activation_backward(cfg.activation, bf16_view(v.b.h, rows, F1), v.pp, bf16_view(v.b.act, rows, F), v.g,
                          bf16_view(v.b.h, rows, F1), dprobs, s);
    }
  }
  // dprobs += <dY row, b2[e]>: the fc2 bias is scaled by the prob too.
  void bias_dprobs_of(const TensorView& dY, const Saved& v, const TensorView& dpp, cudaStream_t s) const {
    bias_dprobs(dY, b2, v.g, dpp, /*accumulate=*/true, s);
  }
  // FP8: from dh's columnwise copy (the backward quantized it) and x_perm's saved one.
  void wgrad_fc1(const TensorView& dh, const Saved& v, cudaStream_t s) {
    if (fp8) {
      const ColCopy col = dh_col(v);
      fp8->wgrad(gemm, gemm_workspace(), v.g, v.rows, col.data, col.scale, cfg.fc1_out(), v.b.fp8.x_col,
                 v.b.fp8.x_col_scale, cfg.hidden, dw1, accumulate(), errors.device_ptr(), s);
    } else if (v.gathered) {
      wgrad_gathered(dh.data, cfg.fc1_out(), v.from_x, dw1, /*x_major=*/false, v, s);
    } else {
      wgrad(1, dh, v.x_perm, v.g, s);
    }
    if (cfg.bias) bias_grad(dh, TensorView(), v.g, db1, accumulate(), bias_workspace(), s);
  }
};

void GroupedExperts::Impl::wgrad_gathered(const void* y, int64_t M, const Gathered& x, const ExpertMatrices& dw,
                                          bool x_major, const Saved& v, cudaStream_t s) const {
  MOE_CHECK(!dw.transposed(), "gathered weight gradient: transposed weight gradients are not supported");
  fused::WgradGatheredArgs a;
  a.dy = y;
  a.x = x.x.data;
  a.row_slots = x.row_slots.ptr<const int32_t>();
  a.slots = x.slots;
  a.group_offsets = v.g.ptr<const int32_t>();
  a.experts = cfg.experts;
  a.R = v.rows;
  a.M = static_cast<int>(M);
  a.N = static_cast<int>(cfg.hidden);
  a.dw_base = dw.base();
  a.dw_stride_bytes = dw.expert_stride_bytes();
  a.dw_table = const_cast<void* const*>(dw.device_table());
  a.dw_fp32 = dw.dtype() == DType::kFP32;
  a.accumulate = accumulate();
  a.x_major = x_major;
  a.sm_count = sm_count;  // cached at construction (the fused kernels, which gathered rows need)
  a.tile_counter = tile_counter;
  fused::launch_wgrad_gathered(a, s);
}

float* GroupedExperts::Impl::dprobs_partials(const TensorView& dx_perm, const TensorView& reads,
                                             const TensorView& writes, const char* call) const {
  if (!cfg.dprobs_partials_in_dx_perm) return dpp_partial_ws;
  if (feature_blocks == 1) return nullptr;  // F <= 256: one block, no partial sums
  const char* why = ": argument 'dx_perm': with config.dprobs_partials_in_dx_perm it holds the dprobs partial sums "
                    "while the fused fc2 dgrad runs, so it must not overlap ";
  MOE_CHECK(!bytes_overlap(dx_perm, reads), call, why, "the gradient the kernel reads");
  MOE_CHECK(!bytes_overlap(dx_perm, writes), call, why, "dY_out");
  MOE_CHECK(reinterpret_cast<uintptr_t>(dx_perm.data) % alignof(float) == 0, call, ": argument 'dx_perm': with ",
            "config.dprobs_partials_in_dx_perm it holds float partial sums, so it must be 4-byte aligned");
  return dx_perm.ptr<float>();
}

void GroupedExperts::Impl::fused_dgrad(const void* dY, const int32_t* row_slots, int slots, void* dY_out,
                                       float* dprobs_partial, const Saved& v, const TensorView& dpp,
                                       bool recompute_act, cudaStream_t s) const {
  fused::Fc2DgradActivationArgs f;
  f.dy = dY;
  f.row_slots = row_slots;
  f.slots = slots;
  f.dy_out = dY_out;
  f.group_offsets = v.g.ptr<const int32_t>();
  f.experts = cfg.experts;
  f.R = v.rows;
  f.H = static_cast<int>(cfg.hidden);
  f.F = static_cast<int>(cfg.ffn);
  f.w2 = w2.base();
  f.w2_table = w2.device_table();
  f.probs = v.pp.data != nullptr ? v.pp.ptr<const float>() : nullptr;
  f.activation = cfg.activation;
  f.h = v.b.h;
  f.act_out = saves_act() || !recompute_act ? nullptr : v.b.act;  // recomputed for fc2's weight gradient
  f.dprobs = dpp.data != nullptr ? dpp.ptr<float>() : nullptr;
  f.dprobs_partial = dprobs_partial;
  f.sm_count = sm_count;
  fused::launch_fc2_dgrad_activation(f, s);
}

GroupedExperts::GroupedExperts(const ExpertsConfig& config) : impl_(std::make_unique<Impl>(config)) {}
GroupedExperts::~GroupedExperts() = default;

const ExpertsConfig& GroupedExperts::config() const { return impl_->cfg; }
uint64_t GroupedExperts::weight_binding() const { return impl_->have_weights ? impl_->binding : 0; }
bool GroupedExperts::grads_bound() const { return impl_->have_grads; }
size_t GroupedExperts::state_bytes() const { return impl_->state_bytes; }
size_t GroupedExperts::workspace_bytes() const { return impl_->block_bytes; }
uint32_t* GroupedExperts::device_error_word() const { return impl_->errors.device_ptr(); }
void GroupedExperts::refresh_fp8_weights(cudaStream_t stream) {
  Impl& m = *impl_;
  MOE_CHECK(m.quantized_weights(), "GroupedExperts::refresh_fp8_weights: the experts do not quantize their ",
            "weights (config.fp8 or config.emulated)");
  MOE_CHECK(m.have_weights, "GroupedExperts::refresh_fp8_weights: no weights bound (call set_weights first)");
  m.quantize_weights(stream);
  m.fp8_refreshed = m.binding;
}

void GroupedExperts::accept_fp8_weights(cudaStream_t stream) {
  Impl& m = *impl_;
  MOE_CHECK(m.quantized_weights(), "GroupedExperts::accept_fp8_weights: the experts do not quantize their weights ",
            "(config.fp8 or config.emulated)");
  MOE_CHECK(m.cfg.fp8_weight_refresh != Fp8WeightRefresh::kEveryForward, "GroupedExperts::accept_fp8_weights: ",
            "with config.fp8_weight_refresh = every forward each forward quantizes the bound weights again");
  MOE_CHECK(m.have_weights, "GroupedExperts::accept_fp8_weights: no weights bound (call set_weights first)");
  if (m.emu) m.emu->dequantize_weights(stream);
  m.fp8_refreshed = m.binding;
}

bool GroupedExperts::fp8_weights_current() const {
  const Impl& m = *impl_;
  return m.quantized_weights() && m.have_weights && m.fp8_refreshed == m.binding;
}

QuantizedTensor GroupedExperts::fp8_weights(Param param) const {
  const Impl& m = *impl_;
  MOE_CHECK(m.quantized_weights(), "GroupedExperts::fp8_weights: the experts do not quantize their weights ",
            "(config.fp8 or config.emulated)");
  MOE_CHECK(param == Param::kFc1Weight || param == Param::kFc2Weight,
            "argument 'param': expected kFc1Weight or kFc2Weight (the biases stay bf16)");
  const int fc = param == Param::kFc1Weight ? 1 : 2;
  return m.fp8 ? m.fp8->weight_copies(fc) : m.emu->weight_codes(fc);
}

QuantConfig GroupedExperts::fp8_weights_format() const {
  const Impl& m = *impl_;
  MOE_CHECK(m.quantized_weights(), "GroupedExperts::fp8_weights_format: the experts do not quantize their weights ",
            "(config.fp8 or config.emulated)");
  return m.emu ? m.emu->weight_config() : m.fp8->weight_config();
}
void GroupedExperts::check_errors(cudaStream_t stream) { impl_->errors.check(stream); }
uint32_t GroupedExperts::fetch_and_clear_errors(cudaStream_t stream) { return impl_->errors.fetch_and_clear(stream); }

SavedState GroupedExperts::new_state(DeviceAllocator& allocator) const {
  return SavedState::allocate(impl_->state_bytes, kStateHeaders, allocator);
}

void GroupedExperts::set_weights(const ExpertTensors& w) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  const WeightLayout L = c.layout;
  const DType wt = c.fp8_weight_refresh == Fp8WeightRefresh::kFromMaster ? DType::kFP32 : c.dtype;
  check_param_views(w.fc1_weight, "fc1.weight", c.experts, L, m.stored(c.fc1_out(), c.hidden), wt);
  check_param_views(w.fc2_weight, "fc2.weight", c.experts, L, m.stored(c.hidden, c.ffn), wt);
  m.check_bias_views(w.fc1_bias, "fc1.bias", L, c.fc1_out(), c.dtype);
  m.check_bias_views(w.fc2_bias, "fc2.bias", L, c.hidden, c.dtype);
  // Checked against the gradients when they are bound (set_grads), not here: gradient memory bound
  // for an earlier backward may since have been freed and taken by these weights (PyTorch binds fresh
  // gradient buffers for each backward; parameters gathered anew each step, as ZeRO-3 / FSDP do).
  m.weight_ranges = expert_tensor_ranges(w, /*grads=*/false);
  // FP8 primary weights: fc1 / fc2 weights are the fp32 master weights, read only by the refresh.
  m.w1 = m.matrices(w.fc1_weight, L, "fc1.weight");
  m.w2 = m.matrices(w.fc2_weight, L, "fc2.weight");
  if (m.fp8) m.fp8->bind_weights(w.fc1_weight, w.fc2_weight);
  if (m.emu) m.emu->bind_weights(w.fc1_weight, w.fc2_weight);
  if (c.bias) {
    m.b1 = m.rows(w.fc1_bias, L, 0);
    m.b2 = m.rows(w.fc2_bias, L, 1);
  }
  m.have_weights = true;
  ++m.binding;
}

void GroupedExperts::rebind_weights(const ExpertTensors& w) {
  Impl& m = *impl_;
  MOE_CHECK(m.have_weights, "GroupedExperts::rebind_weights: no weights bound yet (call set_weights first)");
  const uint64_t binding = m.binding;
  set_weights(w);
  // The same binding: states filled by earlier forwards stay valid, and the FP8 copies made for it
  // stay current (the values are the same).
  m.binding = binding;
}

void GroupedExperts::set_grads(const ExpertTensors& g) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  const DType t = c.wgrad == WgradMode::kAccumulate ? DType::kFP32 : c.wgrad_dtype;
  const int E = c.experts;
  const WeightLayout L1 = layout_of(g.fc1_weight, 2, E), L2 = layout_of(g.fc2_weight, 2, E);
  const WeightLayout Lb1 = layout_of(g.fc1_bias, 1, E), Lb2 = layout_of(g.fc2_bias, 1, E);
  check_param_views(g.fc1_weight, "fc1.weight grad", E, L1, m.stored(c.fc1_out(), c.hidden), t);
  check_param_views(g.fc2_weight, "fc2.weight grad", E, L2, m.stored(c.hidden, c.ffn), t);
  m.check_bias_views(g.fc1_bias, "fc1.bias grad", Lb1, c.fc1_out(), t);
  m.check_bias_views(g.fc2_bias, "fc2.bias grad", Lb2, c.hidden, t);
  check_gradients_apart(expert_tensor_ranges(g, /*grads=*/true), m.weight_ranges, "GroupedExperts::set_grads");
  m.dw1 = m.matrices(g.fc1_weight, L1, "fc1.weight grad");
  m.dw2 = m.matrices(g.fc2_weight, L2, "fc2.weight grad");
  if (c.bias) {
    m.db1 = m.rows(g.fc1_bias, Lb1, 2);
    m.db2 = m.rows(g.fc2_bias, Lb2, 3);
  }
  m.have_grads = true;
}

void GroupedExperts::register_hook(Param param, Hook hook) {
  MOE_CHECK(static_cast<bool>(hook), "argument 'hook': expected a callable");
  impl_->hooks[static_cast<int>(param)].push_back(std::move(hook));
}

void GroupedExperts::forward(const TensorView& x_perm, const TensorView& g, const TensorView& pp, const TensorView& Y,
                             const SavedState& state, cudaStream_t s) {
  Impl& m = *impl_;
  const int64_t rows = m.check_inputs(x_perm, g, pp, "GroupedExperts::forward");
  m.check_Y(Y, rows);
  // The state keeps x_perm by address for the backward's fc1 weight gradient (the FP8 experts keep
  // quantized copies instead): a Y written over it would change what that gradient reads.
  MOE_CHECK(m.fp8 || rows == 0 || !bytes_overlap(Y, x_perm), "argument 'Y': overlaps x_perm, which the state ",
            "keeps for the backward's weight gradient");
  check_state_fillable(state, "state", m.state_bytes, kStateHeaders, "GroupedExperts::forward");
  const StateBuffers b = m.state_layout(static_cast<char*>(state.device()));
  m.fp8_weights(s, "GroupedExperts::forward");
  m.activations(x_perm, g, pp, b, rows, s);
  if (!m.cfg.row_windows) m.fc2_forward(b, g, pp, Y, rows, s);
  m.fill_header(state, x_perm, g, pp, rows);
}

void GroupedExperts::forward_gathered(const TensorView& x, const TensorView& row_slots, int slots,
                                      const TensorView& g, const TensorView& pp, const TensorView& Y,
                                      const TensorView& x_perm_out, const SavedState& state, cudaStream_t s) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  MOE_CHECK(c.fuse_fc1 || m.fp8, "GroupedExperts::forward_gathered: needs config.fuse_fc1 (the fused fc1 gathers ",
            "the rows) or config.fp8 (the quantize of x gathers them)");
  MOE_CHECK(m.have_weights, "GroupedExperts::forward_gathered: no weights bound (call set_weights first)");
  MOE_CHECK(x.ndim == 2 && x.shape[1] == c.hidden, "argument 'x': expected shape [T, ", c.hidden, "], got ",
            x.shape_string());
  check_device_tensor(x, "x", c.dtype, {x.shape[0], c.hidden});
  MOE_CHECK(slots >= 1, "argument 'slots': expected >= 1, got ", slots);
  MOE_CHECK(row_slots.ndim == 1, "argument 'row_slots': expected one dimension, got shape ", row_slots.shape_string());
  const int64_t rows = row_slots.shape[0];
  MOE_CHECK(rows <= m.R, "argument 'row_slots': ", rows, " rows exceed config.max_rows = ", m.R);
  check_device_tensor(row_slots, "row_slots", DType::kInt32, {rows}, 4);
  MOE_CHECK(!m.fp8 || rows % 16 == 0, "argument 'row_slots': the FP8 experts need rows in multiples of 16 (the ",
            "weight gradients' columnwise copies), got ", rows);
  check_device_tensor(g, "group_offsets", DType::kInt32, {int64_t(c.experts) + 1}, 4);
  if (m.probs_in_act())
    check_device_tensor(pp, "probs_perm", DType::kFP32, {rows}, 4);
  else
    MOE_CHECK(pp.data == nullptr, "argument 'probs_perm': the experts do not apply probs ",
              "(config.probs = at combine); pass an empty view");
  m.check_Y(Y, rows);
  MOE_CHECK(!m.fp8 || x_perm_out.data == nullptr, "argument 'x_perm_out': with config.fp8 no x_perm is written ",
            "(the FP8 copies of x_perm are quantized from the rows of x directly); pass an empty view");
  if (x_perm_out.data != nullptr) {
    check_device_tensor(x_perm_out, "x_perm_out", c.dtype, {rows, c.hidden});
    MOE_CHECK(x_perm_out.data != x.data && x_perm_out.data != Y.data, "argument 'x_perm_out': must not be the ",
              "buffer of x or Y (the kernel gathers from x while it writes x_perm_out)");
  } else if (!m.fp8) {
    MOE_CHECK(Y.data == nullptr || Y.data != x.data || rows == 0, "argument 'Y': without x_perm_out the backward gathers the rows of x ",
              "again, so Y must not overwrite x");
  }
  check_state_fillable(state, "state", m.state_bytes, kStateHeaders, "GroupedExperts::forward_gathered");
  const StateBuffers b = m.state_layout(static_cast<char*>(state.device()));
  m.fp8_weights(s, "GroupedExperts::forward_gathered");
  if (m.fp8) {
    m.fp8->quantize_gathered(x, row_slots, slots, /*rowwise=*/true, b.fp8.x_col, b.fp8.x_col_scale,
                             m.errors.device_ptr(), s);
    m.fc1_from_quantized(g, b, rows, s);
  } else {
    m.fused_activations(x.data, row_slots.ptr<const int32_t>(), slots, g, pp, b, rows, s, x_perm_out.data);
  }
  if (!c.row_windows) m.fc2_forward(b, g, pp, Y, rows, s);
  // Without x_perm_out, the fc1 weight gradient gathers the rows of x (FP8: it reads the saved copy,
  // and the state refers to neither).
  const Impl::Gathered from_x{x, row_slots, slots};
  m.fill_header(state, x_perm_out, g, pp, rows, x_perm_out.data == nullptr && !m.fp8 ? &from_x : nullptr);
}

void GroupedExperts::recompute(const TensorView& x_perm, const TensorView& g, const TensorView& pp,
                               const SavedState& state, cudaStream_t s) {
  Impl& m = *impl_;
  const int64_t rows = m.check_inputs(x_perm, g, pp, "GroupedExperts::recompute");
  check_state_capacity(state, "state", m.state_bytes, kStateHeaders);
  // A state in flight may only be refilled by the op that filled it (recompute of its own forward).
  if (state.status() != StateStatus::kEmpty && state.status() != StateStatus::kConsumed)
    check_state(state, "state", m.serial, StateKind::kExperts, {StateStatus::kFilled}, "GroupedExperts::recompute");
  const StateBuffers b = m.state_layout(static_cast<char*>(state.device()));
  m.fp8_weights(s, "GroupedExperts::recompute");
  m.activations(x_perm, g, pp, b, rows, s);
  if (m.fp8)  // only the columnwise copy: a recompute runs no fc2 product
    m.fp8->quantize_activation(m.cfg.activation, bf16_view(b.h, rows, m.cfg.fc1_out()), pp, g, /*rowwise=*/false,
                               b.fp8.act_col, b.fp8.act_col_scale, s);
  m.fill_header(state, x_perm, g, pp, rows);
}

GroupedExperts::Impl::Saved GroupedExperts::Impl::check_backward(const SavedState& state, const TensorView& dx_perm,
                                                                  const TensorView& dpp, WeightGrads weight_grads,
                                                                  const char* call) const {
  check_state_capacity(state, "state", state_bytes, kStateHeaders);
  check_state(state, "state", serial, StateKind::kExperts, {StateStatus::kFilled}, call);
  MOE_CHECK(state.header(0).binding == binding, "argument 'state' of ", call, ": the weights were rebound since its ",
            "forward (set_weights between a forward and its backward)");
  MOE_CHECK(weight_grads == WeightGrads::kCompute || !cfg.delay_wgrad, "argument 'weight_grads' of ", call,
            ": kSkip is refused with config.delay_wgrad (backward_dw owes the weight gradients)");
  MOE_CHECK(cfg.delay_wgrad || weight_grads == WeightGrads::kSkip || have_grads, call,
            ": no gradient tensors bound (call set_grads first)");
  const Saved v = saved(state);
  check_x_perm(v, call);
  const int64_t rows = v.rows;
  if (!cfg.row_windows) {
    check_device_tensor(dx_perm, "dx_perm", cfg.dtype, {rows, cfg.hidden});
  } else if (dx_perm.data != nullptr) {  // scratch only: the dprobs partial sums, if they live there
    MOE_CHECK(dx_perm.ndim == 2 && dx_perm.shape[1] == cfg.hidden, "argument 'dx_perm': expected shape [rows', ",
              cfg.hidden, "], got ", dx_perm.shape_string());
    check_device_tensor(dx_perm, "dx_perm", cfg.dtype, {dx_perm.shape[0], cfg.hidden});
  }
  MOE_CHECK(!cfg.row_windows || !cfg.dprobs_partials_in_dx_perm || feature_blocks == 1 ||
                dx_perm.nbytes() >= rows * feature_blocks * static_cast<int64_t>(sizeof(float)),
            "argument 'dx_perm': with config.row_windows and dprobs_partials_in_dx_perm it is the scratch of ", rows,
            " x ", feature_blocks, " dprobs partial sums, which it is too small for (", dx_perm.shape_string(), ")");
  if (probs_in_act())
    check_device_tensor(dpp, "d_probs_perm", DType::kFP32, {rows}, 4);
  else
    MOE_CHECK(dpp.data == nullptr, "argument 'd_probs_perm': the experts do not apply probs (config.probs = at ",
              "combine); pass an empty view");
  MOE_CHECK(dx_perm.data == nullptr || dx_perm.data != v.x_perm.data || rows == 0, "argument 'dx_perm': the fc1 ",
            "weight gradient reads the saved x_perm after dx_perm is written, so dx_perm must not be the buffer of ",
            "x_perm");
  MOE_CHECK(!v.gathered || dx_perm.data == nullptr || dx_perm.data != v.from_x.x.data || rows == 0,
            "argument 'dx_perm': the fc1 weight ",
            "gradient gathers the saved x after dx_perm is written, so dx_perm must not be the buffer of x");
  return v;
}

void GroupedExperts::Impl::finish_backward(const SavedState& state, const Saved& v, const TensorView& dY,
                                           const TensorView& dx_perm, WeightGrads weight_grads, cudaStream_t s) {
  const bool wgrads = weight_grads == WeightGrads::kCompute;
  const TensorView dh = bf16_view(v.b.h, v.rows, cfg.fc1_out());  // written over h (not by FP8's fused path)
  if (fp8) {  // dh rowwise for the dgrad, columnwise for the weight gradient (below, or backward_dw)
    if (!fp8->fused_activation_grad()) {  // otherwise fp8_fc2_backward made them
      const ColCopy col = wgrads ? dh_col(v) : ColCopy{};
      fp8->quantize(dh, /*rowwise=*/true, col.data, col.scale, s);
    }
    fp8->dgrad(1, gemm, gemm_workspace(), v.g, dx_perm, s);
  } else if (!cfg.row_windows) {  // windows: fc1_dgrad_rows computes it
    dgrad(1, dh, v.g, dx_perm, s);
  }
  StateHeader& h = state.header(0);
  if (!wgrads) {  // frozen experts: no weight gradient, no hook (windows: fc1_dgrad_rows still reads dh)
    h.status = static_cast<int32_t>(StateStatus::kConsumed);
    return;
  }
  // Delayed: backward_dw runs fc1's weight gradient. Windows: finish_row_windows runs it and the
  // hooks after the caller's fc1_dgrad_rows, so every read of the weights is enqueued before a hook
  // runs, as without windows.
  if (cfg.delay_wgrad || cfg.row_windows) {
    if (cfg.delay_wgrad) h.reserved[2] = reinterpret_cast<uint64_t>(dY.data);
    h.status = static_cast<int32_t>(StateStatus::kAwaitingWgrad);
    return;
  }
  finish_fc1(state, v, s);
}

void GroupedExperts::Impl::finish_fc1(const SavedState& state, const Saved& v, cudaStream_t s) {
  wgrad_fc1(bf16_view(v.b.h, v.rows, cfg.fc1_out()), v, s);  // dh, written over h
  // h holds dh (FP8 with the fused activation backward: still h), act dact when unfused.
  state.header(0).status = static_cast<int32_t>(StateStatus::kConsumed);
  for (Param p : kHookOrder) fire_hooks(p);
}

void GroupedExperts::backward(const TensorView& dY, const TensorView& dx_perm, const TensorView& dpp,
                              const SavedState& state, cudaStream_t s, WeightGrads weight_grads) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  const Impl::Saved v = m.check_backward(state, dx_perm, dpp, weight_grads, "GroupedExperts::backward");
  // fc2's weight gradient runs here unless delayed (backward_dw) or skipped (frozen experts).
  const bool wgrad_now = !c.delay_wgrad && weight_grads == WeightGrads::kCompute;
  const int64_t rows = v.rows, H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  check_device_tensor(dY, "dY", c.dtype, {rows, H});
  MOE_CHECK(!c.delay_wgrad || dx_perm.data != dY.data, "argument 'dx_perm': with delay_wgrad, dY is read again by ",
            "backward_dw, so dx_perm must not be the buffer of dY");

  if (c.fuse_fc2_dgrad) {
    float* partials = m.dprobs_partials(dx_perm, dY, TensorView(), "GroupedExperts::backward");
    // Leaves act as it is, or writes it again for a weight gradient that reads it.
    m.fused_dgrad(dY.data, nullptr, 1, nullptr, partials, v, dpp, weight_grads == WeightGrads::kCompute, s);
    if (wgrad_now) m.wgrad_fc2(dY, v, s);
  } else if (m.fp8) {
    // The columnwise copy feeds the weight gradient only.
    const Impl::ColCopy col = weight_grads == WeightGrads::kCompute ? m.dy_col(v) : Impl::ColCopy{};
    m.fp8->quantize(dY, /*rowwise=*/true, col.data, col.scale, s);
    m.fp8_fc2_backward(dY, v, dpp, weight_grads, s);
  } else {
    if (wgrad_now) m.wgrad_fc2(dY, v, s);  // reads act before dact is written over it
    uint16_t* dact = c.delay_wgrad ? m.dact_ws : v.b.act;
    m.dgrad(2, dY, v.g, bf16_view(dact, rows, F), s);
    // In place: the activation backward reads each h element before writing its gradient.
    activation_backward(c.activation, bf16_view(v.b.h, rows, F1), v.pp, bf16_view(dact, rows, F), v.g,
                        bf16_view(v.b.h, rows, F1), m.probs_in_act() ? dpp : TensorView(), s);
  }
  if (m.probs_in_act() && c.bias) m.bias_dprobs_of(dY, v, dpp, s);
  m.finish_backward(state, v, dY, dx_perm, weight_grads, s);
}

void GroupedExperts::backward_gathered(const TensorView& dy, const TensorView& row_slots, int slots,
                                       const TensorView& dY_out, const TensorView& dx_perm, const TensorView& dpp,
                                       const SavedState& state, cudaStream_t s, WeightGrads weight_grads) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  constexpr const char* kCall = "GroupedExperts::backward_gathered";
  MOE_CHECK(c.fuse_fc2_dgrad || m.fp8, kCall, ": needs config.fuse_fc2_dgrad (the fused fc2 dgrad gathers the ",
            "rows) or config.fp8 (the quantize of dY gathers them)");
  MOE_CHECK(m.probs_in_act(), kCall, ": needs the probs in the activation (config.probs): with probs at the ",
            "combine the dY rows are scaled copies of dy");
  MOE_CHECK(!m.fp8 || !c.bias, kCall, ": with config.fp8 and bias the bias gradients read dY in bf16, which the ",
            "FP8 gathered backward never writes; use backward()");
  const Impl::Saved v = m.check_backward(state, dx_perm, dpp, weight_grads, kCall);
  const bool wgrads = weight_grads == WeightGrads::kCompute;
  const int64_t rows = v.rows, H = c.hidden;
  MOE_CHECK(dy.ndim == 2 && dy.shape[1] == H, "argument 'dy': expected shape [T, ", H, "], got ", dy.shape_string());
  check_device_tensor(dy, "dy", c.dtype, {dy.shape[0], H});
  MOE_CHECK(slots >= 1, "argument 'slots': expected >= 1, got ", slots);
  check_device_tensor(row_slots, "row_slots", DType::kInt32, {rows}, 4);
  MOE_CHECK(dx_perm.data == nullptr || dx_perm.data != dy.data || rows == 0,
            "argument 'dx_perm': must not be the buffer of dy");
  MOE_CHECK(!m.fp8 || dY_out.data == nullptr, "argument 'dY_out': with config.fp8 no dY rows are written (dY's ",
            "FP8 copies are quantized from the rows of dy directly); pass an empty view");
  if (dY_out.data != nullptr) {
    check_device_tensor(dY_out, "dY_out", c.dtype, {rows, H});
    MOE_CHECK(dY_out.data != dy.data, "argument 'dY_out': must not be the buffer of dy (the kernel gathers from dy ",
              "while it writes dY_out)");
    MOE_CHECK(!c.delay_wgrad || dx_perm.data != dY_out.data || rows == 0, "argument 'dx_perm': with delay_wgrad, ",
              "dY_out is read again by backward_dw, so dx_perm must not be its buffer");
  } else {
    // FP8 with delay_wgrad keeps dY's quantized copies in the state instead of its rows.
    MOE_CHECK(!c.bias && (!c.delay_wgrad || m.fp8), "argument 'dY_out': needed with ",
              c.bias ? "bias" : "delay_wgrad", " (the gradients read the dY rows again); only without both may it be ",
              "empty");
  }

  if (m.fp8) {
    const Impl::ColCopy col = wgrads ? m.dy_col(v) : Impl::ColCopy{};
    m.fp8->quantize_gathered(dy, row_slots, slots, /*rowwise=*/true, col.data, col.scale, m.errors.device_ptr(), s);
    m.fp8_fc2_backward(TensorView(), v, dpp, weight_grads, s);
    return m.finish_backward(state, v, dY_out, dx_perm, weight_grads, s);
  }
  float* partials = m.dprobs_partials(dx_perm, dy, dY_out, kCall);
  m.fused_dgrad(dy.data, row_slots.ptr<const int32_t>(), slots, dY_out.data, partials, v, dpp, wgrads, s);
  if (dY_out.data != nullptr) {
    if (c.bias) m.bias_dprobs_of(dY_out, v, dpp, s);
    if (!c.delay_wgrad && wgrads) m.wgrad_fc2(dY_out, v, s);
  } else if (wgrads) {
    // dW2_e = dY_perm_e^T act_e with the dY rows gathered from dy: X = dy (N = H), act the
    // contiguous operand (M = F), stored X-major ([H, F]).
    m.wgrad_gathered(v.b.act, c.ffn, Impl::Gathered{dy, row_slots, slots}, m.dw2, /*x_major=*/true, v, s);
  }
  m.finish_backward(state, v, dY_out, dx_perm, weight_grads, s);
}

void GroupedExperts::Impl::run_windows(GemmOp op, const SavedState& state, std::initializer_list<StateStatus> statuses,
                                       const TensorView& row_begin, const TensorView& offsets, const TensorView& out,
                                       const char* call, cudaStream_t s) {
  MOE_CHECK(cfg.row_windows, call, ": only for config.row_windows = true");
  check_state_capacity(state, "state", state_bytes, kStateHeaders);
  check_state(state, "state", serial, StateKind::kExperts, statuses, call);
  MOE_CHECK(state.header(0).binding == binding, "argument 'state' of ", call, ": the weights were rebound since its ",
            "forward (set_weights between a forward and this call)");
  const Saved v = saved(state);
  check_device_tensor(row_begin, "row_begin", DType::kInt32, {int64_t(cfg.experts)}, 4);
  check_device_tensor(offsets, "offsets", DType::kInt32, {int64_t(cfg.experts) + 1}, 4);
  MOE_CHECK(out.ndim == 2 && out.shape[1] == cfg.hidden, "argument 'out': expected shape [rows', ", cfg.hidden,
            "], got ", out.shape_string());
  check_device_tensor(out, "out", cfg.dtype, {out.shape[0], cfg.hidden});
  MOE_CHECK(out.shape[0] <= R, "argument 'out': ", out.shape[0], " rows exceed config.max_rows = ", R);
  GemmProblem p;
  p.op = op;
  // fc2: act [rows, F] -> Y; the fc1 dgrad: dh [rows, fc1_out] (written over h) -> dx_perm.
  p.a = op == GemmOp::kFprop ? bf16_view(v.b.act, v.rows, cfg.ffn) : bf16_view(v.b.h, v.rows, cfg.fc1_out());
  p.w = op == GemmOp::kFprop ? w2 : w1;
  p.d = out;
  p.group_offsets = offsets;
  p.a_row_begin = row_begin;
  p.error_word = errors.device_ptr();
  gemm.run(p, gemm_workspace(), s);
}

void GroupedExperts::fc2_rows(const SavedState& state, const TensorView& row_begin, const TensorView& offsets,
                              const TensorView& out, cudaStream_t s) {
  impl_->run_windows(GemmOp::kFprop, state, {StateStatus::kFilled}, row_begin, offsets, out,
                     "GroupedExperts::fc2_rows", s);
}

void GroupedExperts::fc1_dgrad_rows(const SavedState& state, const TensorView& row_begin, const TensorView& offsets,
                                    const TensorView& out, cudaStream_t s) {
  impl_->run_windows(GemmOp::kDgrad, state, {StateStatus::kConsumed, StateStatus::kAwaitingWgrad}, row_begin,
                     offsets, out, "GroupedExperts::fc1_dgrad_rows", s);
}

void GroupedExperts::finish_row_windows(const SavedState& state, cudaStream_t s) {
  Impl& m = *impl_;
  constexpr const char* kCall = "GroupedExperts::finish_row_windows";
  MOE_CHECK(m.cfg.row_windows && !m.cfg.delay_wgrad, kCall, ": only for config.row_windows without delay_wgrad");
  check_state_capacity(state, "state", m.state_bytes, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kExperts, {StateStatus::kAwaitingWgrad}, kCall);
  MOE_CHECK(m.have_grads, kCall, ": no gradient tensors bound (call set_grads first)");
  m.finish_fc1(state, m.saved(state), s);
}

void GroupedExperts::backward_dw(const SavedState& state, cudaStream_t s) {
  Impl& m = *impl_;
  MOE_CHECK(m.cfg.delay_wgrad, "GroupedExperts::backward_dw: only for config.delay_wgrad = true");
  check_state_capacity(state, "state", m.state_bytes, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kExperts, {StateStatus::kAwaitingWgrad},
              "GroupedExperts::backward_dw");
  MOE_CHECK(m.have_grads, "GroupedExperts::backward_dw: no gradient tensors bound (call set_grads first)");
  const Impl::Saved v = m.saved(state);
  m.check_x_perm(v, "GroupedExperts::backward_dw");
  const TensorView dY = bf16_view(reinterpret_cast<void*>(state.header(0).reserved[2]), v.rows, m.cfg.hidden);
  m.wgrad_fc2(dY, v, s);
  m.fire_hooks(Param::kFc2Weight);
  m.fire_hooks(Param::kFc2Bias);
  m.wgrad_fc1(bf16_view(v.b.h, v.rows, m.cfg.fc1_out()), v, s);  // dh, written over h by backward
  m.fire_hooks(Param::kFc1Weight);
  m.fire_hooks(Param::kFc1Bias);
  state.header(0).status = static_cast<int32_t>(StateStatus::kConsumed);
}

// Header 0's addresses of the group offsets, probs and (delayed) dY, checked against the state
// (whose kind and status the caller checked).
void GroupedExperts::Impl::relocate_inputs(const SavedState& state, const TensorView& group_offsets,
                                           const TensorView& probs_perm, const TensorView* dY) const {
  StateHeader& h = state.header(0);
  const int64_t rows = h.tokens;
  check_device_tensor(group_offsets, "group_offsets", DType::kInt32, {int64_t(cfg.experts) + 1}, 4);
  if (probs_in_act()) check_device_tensor(probs_perm, "probs_perm", DType::kFP32, {rows}, 4);
  // backward_dw reads dY again for the bf16 weight gradients and the fc2 bias gradient; FP8 without
  // bias reads only the quantized copies its backward kept, so dY is optional there.
  const bool awaiting = h.status == static_cast<int32_t>(StateStatus::kAwaitingWgrad);
  const bool needs_dY = awaiting && (!fp8 || cfg.bias);
  MOE_CHECK(needs_dY ? dY != nullptr : awaiting || dY == nullptr, "argument 'dY': expected ",
            needs_dY ? "the dY of the delayed backward" : "none", " (the state is ", state_status_name(state.status()),
            ")");
  if (dY) check_device_tensor(*dY, "dY", cfg.dtype, {rows, cfg.hidden});
  h.reserved[0] = reinterpret_cast<uint64_t>(group_offsets.data);
  h.reserved[1] = probs_in_act() ? reinterpret_cast<uint64_t>(probs_perm.data) : 0;
  if (dY) h.reserved[2] = reinterpret_cast<uint64_t>(dY->data);
}

void GroupedExperts::relocate(const SavedState& state, const TensorView& x_perm, const TensorView& group_offsets,
                              const TensorView& probs_perm, const TensorView* dY) const {
  const Impl& m = *impl_;
  check_state_capacity(state, "state", m.state_bytes, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kExperts, {StateStatus::kFilled, StateStatus::kAwaitingWgrad},
              "GroupedExperts::relocate");
  // The FP8 backward reads the saved FP8 copy of x_perm: x_perm may be an empty view there.
  if (!m.fp8 || x_perm.data != nullptr)
    check_device_tensor(x_perm, "x_perm", m.cfg.dtype, {state.header(0).tokens, m.cfg.hidden});
  m.relocate_inputs(state, group_offsets, probs_perm, dY);
  state.header(0).pointer = reinterpret_cast<uint64_t>(x_perm.data);
  Impl::set_gathered(state, nullptr);
}

void GroupedExperts::relocate_gathered(const SavedState& state, const TensorView& x, const TensorView& row_slots,
                                       int slots, const TensorView& group_offsets, const TensorView& probs_perm,
                                       const TensorView* dY) const {
  const Impl& m = *impl_;
  check_state_capacity(state, "state", m.state_bytes, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kExperts, {StateStatus::kFilled, StateStatus::kAwaitingWgrad},
              "GroupedExperts::relocate_gathered");
  // The gathered weight gradient writes the standard orientation only (and forward_gathered, which
  // needs the fused fc1, is refused with transposed weights).
  MOE_CHECK(!m.cfg.transposed_weights, "GroupedExperts::relocate_gathered: config 'transposed_weights' keeps ",
            "x_perm for the fc1 weight gradient (use relocate())");
  const int64_t rows = state.header(0).tokens;
  MOE_CHECK(x.ndim == 2 && x.shape[1] == m.cfg.hidden, "argument 'x': expected shape [T, ", m.cfg.hidden, "], got ",
            x.shape_string());
  check_device_tensor(x, "x", m.cfg.dtype, {x.shape[0], m.cfg.hidden});
  MOE_CHECK(slots >= 1, "argument 'slots': expected >= 1, got ", slots);
  check_device_tensor(row_slots, "row_slots", DType::kInt32, {rows}, 4);
  m.relocate_inputs(state, group_offsets, probs_perm, dY);
  state.header(0).pointer = 0;
  const Impl::Gathered from_x{x, row_slots, slots};
  Impl::set_gathered(state, &from_x);
}

}  // namespace moe
