// moe::GroupedExperts -- the experts alone: fc1 (+bias) -> activation (x prob) -> fc2 (+bias)
// over rows that some token dispatcher already placed in ragged expert groups, forward and
// backward, CUDA-graph-safe (docs/semantics.md: expert MLP, state and graph safety).
//
//   forward:  (x_perm [rows, H], group_offsets int32 [E + 1], probs_perm fp32 [rows]) -> Y [rows, H]
//   backward: dY [rows, H] -> dx_perm [rows, H], d_probs_perm fp32 [rows] (+ weight gradients)
//
// Group e is rows [g[e], g[e + 1]) of x_perm; rows past g[E] are neither read nor written. Any
// dispatcher composes with it: the local moe::Dispatcher (moe::GroupedMlp is exactly that
// composition), or an expert-parallel all-to-all.
//
// The op holds configuration, bound parameters and workspaces sized at construction. What a
// backward needs lives in a caller-owned SavedState (new_state(), reusable once consumed):
// activations h and act (h becomes dh in backward). The inputs x_perm, group_offsets and
// probs_perm, and in delayed mode dY, are saved *by reference*: the caller keeps them alive and
// unchanged until the backward (backward_dw in delayed mode) of that state has been enqueued.
// Calls of one GroupedExperts object must be ordered (one stream, or synchronised), because its
// backward workspaces are shared by all states; different objects may run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "moe/grouped_mlp_config.h"
#include "moe/quantize.h"
#include "moe/saved_state.h"
#include "moe/tensor.h"

namespace moe {

// Device views of the four parameters (or of their gradients), in the config's layout:
//   kSingleGrouped: one view each: fc1 [E, fc1_out, H], fc1_bias [E, fc1_out], fc2 [E, H, F], fc2_bias [E, H]
//   kPerExpert:     E views each:  fc1 [fc1_out, H],    fc1_bias [fc1_out],    fc2 [H, F],    fc2_bias [H]
// Biases are empty when config.bias is false. With FP8 primary weights
// (fp8_weight_refresh = kFromMaster) fc1 / fc2 are the fp32 master weights. Gradients: dtype wgrad_dtype (kWrite) or fp32
// main_grad (kAccumulate), each parameter's in either layout (independent of the weights' layout:
// one view with the leading E dimension is single grouped, E views are per expert).
struct ExpertTensors {
  std::vector<TensorView> fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

// What a backward computes. kSkip is for frozen experts (fine-tuning the layers around them, LoRA
// adapters outside the experts): only the input gradients -- dx_perm (the layer: dx) and the probs'
// gradient -- bitwise those of a full backward, with no weight or bias gradient GEMM, no gradient
// tensors needed (set_grads may never have been called), no hooks, and the state consumed. Refused
// with config.delay_wgrad, whose backward_dw owes the weight gradients.
enum class WeightGrads { kCompute, kSkip };

class GroupedExperts {
 public:
  using Hook = std::function<void(Param)>;

  explicit GroupedExperts(const ExpertsConfig& config);
  ~GroupedExperts();
  GroupedExperts(const GroupedExperts&) = delete;
  GroupedExperts& operator=(const GroupedExperts&) = delete;

  const ExpertsConfig& config() const;

  // Binds parameter and gradient memory (pointers only: the data may change between calls, the
  // addresses must not once a graph has been captured). Binding per-expert tensors uploads a
  // pointer table synchronously: never inside a captured region. A forward records the weight
  // binding it used; its backward refuses to run against a different one. set_grads refuses gradient
  // memory that overlaps a bound weight or another gradient (the backward would write over what it
  // still reads); weights may be bound over memory of earlier gradients (freed since, or rebound).
  void set_weights(const ExpertTensors& weights);
  // The same weights at new addresses -- gathered again between forwards and their backwards, as
  // FSDP does when it reshards after the forward: bound like set_weights but within the current
  // binding, so the backwards of earlier forwards run against them. The caller vouches that the
  // values are the ones those forwards used.
  void rebind_weights(const ExpertTensors& weights);
  void set_grads(const ExpertTensors& grads);
  // Called once per backward (or backward_dw) when that parameter's gradient is final, on the
  // host while the work is being enqueued (so a reducer can enqueue its reduce-scatter after it).
  void register_hook(Param param, Hook hook);

  // Weight-binding generation (0: no weights bound yet; each set_weights increments it) and whether
  // gradient tensors are bound -- what a composing op checks before it enqueues anything.
  uint64_t weight_binding() const;
  bool grads_bound() const;

  // A saved state: device bytes and host headers; new_state() allocates one.
  size_t state_bytes() const;
  // Header 0: the state's status and the inputs read again by address; header 1: x and the row
  // map of a state filled by forward_gathered without x_perm_out.
  static constexpr int kStateHeaders = 2;
  SavedState new_state(DeviceAllocator& allocator = cuda_malloc_allocator()) const;

  // x_perm bf16 [rows, H] (rows <= max_rows), group_offsets int32 [E + 1], probs_perm fp32 [rows]
  // (probs in the activation; an empty view otherwise) -> Y bf16 [rows, H]. `state` must be empty
  // or consumed; it is filled for the backward.
  void forward(const TensorView& x_perm, const TensorView& group_offsets, const TensorView& probs_perm,
               const TensorView& Y, const SavedState& state, cudaStream_t stream);
  // The layer's forward (config.fuse_fc1 only): the rows of x_perm are gathered from x inside the
  // fused fc1 -- row r is x[row_slots[r] / slots], zeros where row_slots[r] < 0 (a dispatch plan's
  // row map, rows = its R; every entry must be -1 or below T * slots for x [T, H]) -- with no
  // separate permute pass. The kernel writes the rows of the groups to x_perm_out [rows, H] on the
  // way (rows past group_offsets[E] are left as they are, where Dispatcher::permute writes zeros;
  // nothing reads them), which the state then saves by reference like forward's x_perm. With an
  // empty x_perm_out no x_perm ever exists: the state saves x and row_slots by reference instead
  // (they must stay unchanged until the backward, or backward_dw in delayed mode, has run), and the
  // fc1 weight gradient gathers the rows of x itself. With config.fp8 (instead of fuse_fc1) the
  // gathered rows are quantized straight into the FP8 copies of x_perm (bitwise forward's), no
  // x_perm exists (x_perm_out must be empty) and the state keeps no reference to x. A map entry
  // outside [-1, T * slots) reads as a zero row and raises kErrBadRowMap in the error word.
  void forward_gathered(const TensorView& x, const TensorView& row_slots, int slots, const TensorView& group_offsets,
                        const TensorView& probs_perm, const TensorView& Y, const TensorView& x_perm_out,
                        const SavedState& state, cudaStream_t stream);
  // Fills `state` like forward (bitwise the same activations) without computing Y: the recompute
  // step of activation checkpointing.
  void recompute(const TensorView& x_perm, const TensorView& group_offsets, const TensorView& probs_perm,
                 const SavedState& state, cudaStream_t stream);

  // dY bf16 [rows, H] -> dx_perm bf16 [rows, H] and d_probs_perm fp32 [rows] (probs in the
  // activation; an empty view otherwise), weight gradients too unless delay_wgrad or weight_grads =
  // kSkip (frozen experts, see WeightGrads). Without
  // delay_wgrad, dx_perm may be the very buffer of dY (dY is fully read before dx_perm is written),
  // except with config.dprobs_partials_in_dx_perm (and F > 256): then dx_perm must not overlap dY
  // (nor dy or dY_out in backward_gathered) and its rows past group_offsets[E] are left unspecified.
  void backward(const TensorView& dY, const TensorView& dx_perm, const TensorView& d_probs_perm,
                const SavedState& state, cudaStream_t stream, WeightGrads weight_grads = WeightGrads::kCompute);
  // The layer's backward (config.fuse_fc2_dgrad, probs in the activation): the dY rows are gathered
  // from dy [T, H] inside the fused fc2 dgrad -- row r is dy[row_slots[r] / slots], zeros where
  // row_slots[r] < 0, the row map of forward_gathered -- with no separate pass building dY. The
  // kernel writes them to dY_out [rows, H] on the way, where the fc2 weight and bias gradients (and
  // backward_dw) read them; dY_out may be empty only without bias and delay_wgrad: then no dY_perm
  // ever exists and the fc2 weight gradient gathers the rows of dy too. With config.fp8 (instead of
  // fuse_fc2_dgrad; without bias) the gathered rows are quantized straight into dY's FP8 copies
  // (bitwise backward's; with delay_wgrad the state keeps them for backward_dw) and dY_out must be
  // empty. Otherwise as backward.
  void backward_gathered(const TensorView& dy, const TensorView& row_slots, int slots, const TensorView& dY_out,
                         const TensorView& dx_perm, const TensorView& d_probs_perm, const SavedState& state,
                         cudaStream_t stream, WeightGrads weight_grads = WeightGrads::kCompute);
  // Delayed mode: fc2's weight gradients, then fc1's, each parameter's hooks once it is final.
  void backward_dw(const SavedState& state, cudaStream_t stream);

  // Windows of rows (config.row_windows; docs/state.md, token chunks). The forwards then take an
  // empty Y and stop after the activation, and the backwards compute no dx_perm: their dx_perm is
  // scratch for the fused fc2 dgrad's dprobs partial sums (config.dprobs_partials_in_dx_perm; at
  // least rows x ceil(F / 256) floats) or an empty view. These two compute fc2 and the fc1 dgrad for
  // a window of each group's rows -- rows [row_begin[e], row_begin[e] + n_e) of group e, n_e =
  // offsets[e + 1] - offsets[e] -- into rows [offsets[e], offsets[e + 1]) of `out` [>= offsets[E],
  // H], the same bits as those rows of the whole product. row_begin int32 [E] and offsets int32
  // [E + 1] (offsets[0] = 0) are device views (Dispatcher::chunk_windows makes them per token chunk).
  // fc2_rows: Y from a filled state's act. A state that does not keep act (the fused fc2 dgrad
  // without delay_wgrad recomputes it) finds it in the op's workspace, so call fc2_rows between the
  // forward and the next call of this op.
  void fc2_rows(const SavedState& state, const TensorView& row_begin, const TensorView& offsets,
                const TensorView& out, cudaStream_t stream);
  // fc1_dgrad_rows: dx_perm from the dh a backward left in the state, until the state is filled
  // again. Without delay_wgrad the backward leaves fc1's weight gradients and every hook to
  // finish_row_windows, which the caller makes after its fc1_dgrad_rows calls (so that, as without
  // windows, every read of the weights is enqueued before a hook runs); with delay_wgrad
  // backward_dw does that work as always. After a backward with WeightGrads::kSkip there is no such
  // work: the state is consumed, and finish_row_windows is refused.
  void fc1_dgrad_rows(const SavedState& state, const TensorView& row_begin, const TensorView& offsets,
                      const TensorView& out, cudaStream_t stream);
  void finish_row_windows(const SavedState& state, cudaStream_t stream);

  // The inputs a filled state reads again by address (x_perm, group_offsets, probs_perm; dY once a
  // delayed backward ran -- except an FP8 backward_gathered, which kept dY's quantized copies in the
  // state instead -- else pass nullptr) now live elsewhere -- e.g. the caller offloaded them to
  // the host and restored them, or the state's own memory moved: point the state at them. Same
  // shapes as at forward; the data must be unchanged. With config.fp8, x_perm may be an empty view
  // (the FP8 backward reads the state's own FP8 copy of it).
  void relocate(const SavedState& state, const TensorView& x_perm, const TensorView& group_offsets,
                const TensorView& probs_perm, const TensorView* dY = nullptr) const;
  // The same for a state whose fc1 weight gradient gathers the rows of x (forward_gathered without
  // x_perm_out): x [T, H] and the row map row_slots [rows] with its slots per token.
  void relocate_gathered(const SavedState& state, const TensorView& x, const TensorView& row_slots, int slots,
                         const TensorView& group_offsets, const TensorView& probs_perm,
                         const TensorView* dY = nullptr) const;

  // Device memory held by the op (backward workspaces, GEMM call workspace, bias workspace; with
  // FP8 or the emulated formats, the quantized weight copies and the token copies).
  size_t workspace_bytes() const;

  // FP8 or the emulated MXFP8 / NVFP4 (config.fp8_weight_refresh = kOnRequest or kFromMaster):
  // quantizes the bound weights (bf16, or the fp32 master weights) into the copies the following
  // forwards and backwards use.
  // Graph-capturable. Call it after every change of the weights; a forward refuses to run when no
  // refresh followed the last set_weights.
  void refresh_fp8_weights(cudaStream_t stream);
  // FP8 or emulated: device views of the quantized copies of fc1.weight or fc2.weight (param
  // kFc1Weight / kFc2Weight), single grouped: rowwise data [E, N, K] and columnwise [E, K, N] with
  // their scale tensors (and NVFP4's global amax [E]) in the format fp8_weights_format() states --
  // FP8: 128x128 blocks, fp32 scale_inv [E, ceil(N/128), ceil(K/128)] and transposed; MXFP8: 1x32 /
  // 32x1 blocks, E8M0 scales; NVFP4: 16x16 blocks, E4M3 scales -- the format of moe::quantize,
  // row-major scales. For checkpoints of quantized weights: the views are writable (the op's
  // workspace), to write loaded bytes into them instead of a refresh (then accept_fp8_weights).
  QuantizedTensor fp8_weights(Param param) const;
  QuantConfig fp8_weights_format() const;
  // Whether the copies were made (a refresh, a forward with kEveryForward, or accepted after a
  // load) since the last set_weights. With kEveryForward they hold the weights as of the last
  // forward.
  bool fp8_weights_current() const;
  // The copies were written through fp8_weights() (e.g. load_fp8_expert_weights): they count as
  // refreshed for the weights bound now (emulated formats: their bf16 dequantizations, which the
  // GEMMs read, are made from them on `stream`). Needs fp8_weight_refresh = kOnRequest or
  // kFromMaster.
  // `stream`: the stream that wrote the copies (or one ordered after it).
  void accept_fp8_weights(cudaStream_t stream);

  // Device error word (docs/semantics.md, errors): the FP8 weight gradients raise
  // kErrUnalignedGroup for an expert whose rows do not fill whole 128-row blocks (that expert's
  // gradient is skipped). check_errors and fetch_and_clear_errors sync `stream`: call them outside
  // graphs.
  uint32_t* device_error_word() const;
  void check_errors(cudaStream_t stream);
  uint32_t fetch_and_clear_errors(cudaStream_t stream);  // the bits raised so far, then cleared

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
