// moe::GroupedGemm -- the three products of the experts over ragged token groups
// (docs/semantics.md: expert MLP, graph safety):
//
//   fprop  Y_e  = X_e  W_e^T     X [R, K], W_e [N, K], Y [R, N]      (fp32 accumulation)
//   dgrad  dX_e = dY_e W_e       dY [R, N], dX [R, K]
//   wgrad  dW_e = dY_e^T X_e     dW_e [N, K] written, or accumulated into an fp32 main_grad
//
// Group e is rows [g[e], g[e+1]) of the token-side matrices, g = `group_offsets`, a device int32
// [E + 1] array (g[0] = 0, non-decreasing). Rows past g[E] are not touched. Groups may be empty:
// fprop/dgrad then write nothing for them, wgrad writes a zero dW_e (or leaves main_grad as is).
//
// The engine holds configuration only. Everything one launch writes besides its output -- the
// per-group argument arrays that a small device prep kernel fills from the device offsets, and
// CUTLASS's workspace -- lives in a per-call `workspace` the caller passes (workspace_bytes()), so
// several layers and streams can share one engine: two launches race only if they share a
// workspace. Calls make no allocation, no synchronisation and no host read of device data; a
// captured CUDA graph replayed with new group sizes gives the same bits as an eager call.
//
// A call is described by a GemmProblem: the product, its operands and dtypes, and the epilogue.
// Kernels are registered by what they can do (product, operand and output dtypes, epilogue), and
// the tile configuration is chosen from the static shape (N, K) only -- never from device data --
// so eager and captured runs always pick the same kernel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "moe/quant_format.h"
#include "moe/tensor.h"

namespace moe {

// The E matrices [rows, cols] (row-major, contiguous) of one expert parameter or of its gradient,
// in either weight layout (docs/semantics.md, weight layouts). Both layouts feed the same kernels
// through the same device pointer array, so their results are bitwise identical.
class ExpertMatrices {
 public:
  ExpertMatrices() = default;
  // Every matrix's address must be a multiple of `alignment` bytes: 16 for the operands and outputs
  // of the GEMMs (TMA), 4 for the fp32 scales of FP8 weights (GemmProblem::w_scale), which are read
  // element by element and whose matrices are often not multiples of 16 bytes.
  //
  // Single grouped layout: one contiguous [E, rows, cols] device view.
  static ExpertMatrices grouped(const TensorView& t, const char* name = "weights", int alignment = 16);
  // Per-expert layout: E contiguous [rows, cols] device views of one dtype. Their addresses are
  // copied once into a device table owned by the result (a synchronous upload: do this when the
  // parameters are bound, not inside a captured region).
  static ExpertMatrices per_expert(const std::vector<TensorView>& ts, const char* name = "weights",
                                   int alignment = 16);

  // The same storage read as transposes: the stored [rows, cols] matrices are W_e^T, so W_e is
  // [cols, rows] (Hugging Face's transposed experts). The grouped GEMMs read them in place.
  ExpertMatrices as_transposed() const;

  int experts() const { return experts_; }
  int64_t rows() const { return rows_; }  // of W_e (the stored matrices' cols when transposed)
  int64_t cols() const { return cols_; }
  bool transposed() const { return transposed_; }
  DType dtype() const { return dtype_; }
  int alignment() const { return alignment_; }  // bytes every matrix's address is a multiple of
  bool is_grouped() const { return table_ == nullptr; }
  // Single grouped: base address and distance between experts in bytes. Per expert: device table.
  void* base() const { return base_; }
  int64_t expert_stride_bytes() const { return stride_bytes_; }
  const void* const* device_table() const { return table_; }

 private:
  int experts_ = 0;
  int64_t rows_ = 0, cols_ = 0;
  bool transposed_ = false;
  int alignment_ = 16;
  DType dtype_ = DType::kBF16;
  void* base_ = nullptr;
  int64_t stride_bytes_ = 0;
  const void* const* table_ = nullptr;  // device [E] pointers (per-expert layout), owned below
  std::shared_ptr<void> table_owner_;
};

enum class GemmOp : uint8_t { kFprop, kDgrad, kWgrad };
const char* gemm_op_name(GemmOp op);  // "fprop", "dgrad", "wgrad"

// What the kernel does with its result.
enum class GemmEpilogue : uint8_t {
  kStore,       // D = result, in D's dtype
  kAccumulate,  // D (fp32) += result: wgrad into a main_grad ("gradient accumulation fusion")
};

// One grouped product. Operand dtypes are those of the views: bf16 operands write bf16 (or fp32 /
// accumulate for wgrad); FP8 E4M3 operands with block scaling (docs/gemm.md, FP8) write bf16 (fprop,
// dgrad) or bf16 / fp32 / accumulate (wgrad). FP8 tensor cores read both operands along the reduction, so
// FP8 products take the quantized copies (moe/quantize.h, FP8 block) that are contiguous along it,
// every scale an fp32 scale_inv:
//   fprop  a = X rowwise 1x128 [rows, K], a_scale [rows, ceil(K/128)] (kRowMajor) or, with
//          a_scale_layout = kMNMajor, [ceil(K/128), round_up(rows, 4)] (quantize's kMNMajor: each
//          128-row tile's scales of a block are one contiguous run, copied by the TMA engine
//          where the groups start on multiples of 4 rows -- faster; docs/gemm.md);
//          w = W rowwise 128x128 [E][N, K], w_scale [E][ceil(N/128), ceil(K/128)] (kRowMajor)
//   dgrad  a = dY rowwise 1x128 [rows, N], a_scale [rows, ceil(N/128)] (kRowMajor) or kMNMajor as
//          for fprop;
//          w = the weights' columnwise 128x128 copy W^T [E][K, N] viewed as_transposed(), w_scale
//          its scales [E][ceil(K/128), ceil(N/128)] viewed as_transposed() too
//   wgrad  a = dY columnwise 1x128 (dY^T) [N, rows], a_scale [ceil(rows/128), N] (kMNMajor);
//          b = X columnwise 1x128 (X^T) [K, rows], b_scale [ceil(rows/128), K] (kMNMajor);
//          every group must fill whole 128-token blocks -- start on a block boundary, end on one or
//          at the end of the rows (pad the dispatch to A = 128): a group that does not is skipped
//          like an empty one (zero-filled in write mode) and raises kErrUnalignedGroup in error_word
// Every FP8 dimension (N, K, and rows for wgrad) must be a multiple of 16 (16-byte TMA rows).
struct GemmProblem {
  GemmOp op = GemmOp::kFprop;
  TensorView a;              // fprop: X [rows, K]; dgrad and wgrad: dY [rows, N]
  TensorView b;              // wgrad: X [rows, K]; unused otherwise
  ExpertMatrices w;          // fprop, dgrad: the weights W_e [N, K]; wgrad: the output dW_e [N, K]
                             // (either may be stored transposed, [K, N]: ExpertMatrices::as_transposed)
  TensorView d;              // fprop: Y [rows, N]; dgrad: dX [rows, K]; unused by wgrad
  TensorView group_offsets;  // int32 [E + 1], device
  TensorView a_scale;        // FP8 only (see above)
  // FP8 fprop / dgrad: a_scale's layout, kRowMajor or kMNMajor (wgrad's is always the latter and
  // does not read this field).
  ScaleLayout a_scale_layout = ScaleLayout::kRowMajor;
  TensorView b_scale;        // FP8 wgrad only
  ExpertMatrices w_scale;    // FP8 fprop and dgrad only, oriented as w (made with alignment 4 or 16)
  GemmEpilogue epilogue = GemmEpilogue::kStore;
  // Optional, bf16 fprop and dgrad only: int32 [E], device. Group e reads its rows of `a` from row
  // a_row_begin[e] on instead of group_offsets[e] -- a window of each group's rows, e.g. one chunk
  // of tokens of every expert -- and still writes rows [group_offsets[e], group_offsets[e + 1]) of
  // `d`, so `a` may hold more rows than `d`. A window that starts below 0 or runs past a's rows is
  // clamped to them and raises kErrBadGroupOffsets in error_word. Each output row gets the same
  // bits as in a call without windows (the tile configuration depends on N and K only).
  TensorView a_row_begin;
  // Optional device error word (moe::ErrorWord): offsets that are not 0-based, decrease or run past
  // the rows raise kErrBadGroupOffsets (the groups are clamped either way, never read out of bounds).
  uint32_t* error_word = nullptr;
};

class GroupedGemm {
 public:
  // Static bounds: at most `max_experts` groups per call, token-side matrices of at most
  // `max_rows` rows (R). Holds no device memory. max_sms > 0: the persistent kernels use at most
  // that many SMs, rounded down to an even count of at least 2 (clusters of 2 CTAs); 0: all of the
  // device's. max_weight_dim > 0: the largest N or K of the expert matrices of any call; the
  // workspace then also holds the per-call copy of the FP8 weight scales that the 192-wide FP8
  // configurations read (restated per 64 rows). 0: those configurations are not run.
  GroupedGemm(int max_experts, int64_t max_rows, int max_sms = 0, int64_t max_weight_dim = 0);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  // Device bytes of one call's workspace for up to `experts` groups (default: max_experts).
  size_t workspace_bytes(int experts = 0) const;
  // SMs the persistent kernels' grids use (max_sms resolved against the device).
  int sm_count() const;

  // Enqueues the product on `stream`. workspace: device uint8 of at least workspace_bytes(E)
  // bytes, 256-byte aligned, not used by any other launch in flight.
  void run(const GemmProblem& problem, const TensorView& workspace, cudaStream_t stream) const;

  // Shorthands for run():
  // x bf16 [R, K], w bf16 experts [N, K] -> y bf16 [R, N]. group_offsets int32 [E + 1], E = w.experts().
  void fprop(const TensorView& x, const ExpertMatrices& w, const TensorView& group_offsets, const TensorView& y,
             const TensorView& workspace, cudaStream_t stream) const;
  // dy bf16 [R, N], w bf16 experts [N, K] -> dx bf16 [R, K].
  void dgrad(const TensorView& dy, const ExpertMatrices& w, const TensorView& group_offsets, const TensorView& dx,
             const TensorView& workspace, cudaStream_t stream) const;
  // dy bf16 [R, N], x bf16 [R, K] -> dw experts [N, K]: bf16 or fp32 written, or (accumulate) fp32
  // main_grad += dY_e^T X_e.
  void wgrad(const TensorView& dy, const TensorView& x, const TensorView& group_offsets, const ExpertMatrices& dw,
             bool accumulate, const TensorView& workspace, cudaStream_t stream) const;

  // The tile configuration used for this op and shape on bf16 operands (wgrad: out_dtype of dw,
  // and whether it is added into a main_grad, which needs fp32) -- the shape heuristic's unless
  // forced -- as "name/M" or "name/N" (the scheduler's tile order inside a group), and the names of
  // every compiled configuration of that op. For benchmarks and tests.
  std::string chosen_config(GemmOp op, int64_t N, int64_t K, DType out_dtype = DType::kBF16,
                            bool accumulate = false) const;
  // operands: kBF16 or kFP8E4M3 (FP8 dgrad runs the fprop-form kernels: list and force them as fprop).
  static std::vector<std::string> configs(GemmOp op, DType out_dtype = DType::kBF16, DType operands = DType::kBF16);
  // Forces a configuration by name ("" = back to the heuristic, with tile_run 1), the tile order
  // inside a group (false: along M) and the consecutive cluster tiles a CTA takes per visit of the
  // persistent schedule (1: round-robin; the heuristic takes 4 for short reductions). Configuration of the engine, for
  // benchmarks and tests; throws on an unknown name. Products on transposed expert matrices run the
  // other op's kernel (fprop <-> dgrad) and take that op's forced configuration; chosen_config
  // reports the standard orientation's choice ("name/M", "name/N", with "/runR" when R > 1).
  void force_config(GemmOp op, const std::string& name, bool raster_along_n = false, int tile_run = 1);

  int max_experts() const;
  int64_t max_rows() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
