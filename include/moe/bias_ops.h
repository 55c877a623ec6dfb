// Per-expert bias kernels of the expert layer (docs/semantics.md, Expert MLP): add the bias rows of
// each row's expert to a grouped [R, N] matrix (fc1: h += b1_e; fc2 with probs in the activation:
// Y += p * b2_e), and the backward: bias gradients db_e = sum over the expert's rows of (p *) dY,
// and the prob's gradient through the scaled bias, dprobs[r] = <dY[r, :], b2_e>.
//
// The expert of row r is the e with group_offsets[e] <= r < group_offsets[e + 1] (int32 [E + 1],
// on the device); rows at or past min(group_offsets[E], R) are neither read nor written. Every call
// is graph-safe: no host read, no sync, no allocation (bias_grad takes a caller-owned workspace).
// Reductions use a fixed order and no float atomics: results are bitwise reproducible.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/dtype.h"
#include "moe/tensor.h"

namespace moe {

// The E rows of a per-expert parameter (or of its gradient) on the device, in either weight layout
// (docs/semantics.md, Weight layouts). Single grouped: one [E, N] block; per expert: a device array
// of E pointers, each to N contiguous elements, 16-byte aligned. The kernels differ only in how
// they find row e, so both layouts give bitwise-identical results.
struct ExpertRows {
  void* stacked = nullptr;       // single grouped [E, N]
  void* const* table = nullptr;  // per expert: device array [E] of row pointers
  DType dtype = DType::kBF16;
  int experts = 0;
  int64_t cols = 0;  // N

  // From an [E, N] device tensor.
  static ExpertRows single_grouped(const TensorView& t);
  // From a device array of E row pointers (the caller keeps the array alive and at a fixed address
  // while graphs that use it exist).
  static ExpertRows per_expert(void* const* device_table, DType dtype, int experts, int64_t cols);
};

// y bf16 [R, N] += (probs[r] *) bias[e(r), :], in fp32 (one fma per element, rounded to bf16 once).
// bias: bf16 rows; probs fp32 [R] or absent (TensorView(): unscaled); group_offsets int32 [E + 1].
void bias_add(const TensorView& y, const ExpertRows& bias, const TensorView& probs, const TensorView& group_offsets,
              cudaStream_t stream);

// Bytes of the workspace bias_grad needs for any call of up to R rows with E experts and N columns
// (a static bound: a workspace sized for an op's row bound serves its calls with fewer rows).
size_t bias_grad_workspace_bytes(int64_t R, int experts, int64_t N);

// grad[e, :] = sum over rows r of expert e of (probs[r] *) dy[r, :]   (accumulate: grad[e, :] += ...)
// dy bf16 [R, N]; grad rows fp32 (write or accumulate into main_grad) or bf16 (write only); an
// expert without rows gets zeros (write) or is left untouched (accumulate). Sums in fp32, in a fixed
// order: chunks of <= 128 rows of each expert summed row by row, then the chunks in order (the
// chunk size depends only on R and N, so a given layer always sums in the same order).
// workspace: uint8 [bias_grad_workspace_bytes(R, E, N)] on the device, 16-byte aligned.
void bias_grad(const TensorView& dy, const TensorView& probs, const TensorView& group_offsets, const ExpertRows& grad,
               bool accumulate, const TensorView& workspace, cudaStream_t stream);

// dprobs[r] = <dy[r, :], bias[e(r), :]>   (accumulate: dprobs[r] += ...), fp32 [R], summed in fp32
// in a fixed order. With probs applied in the activation, this is the fc2 bias's share of dp.
void bias_dprobs(const TensorView& dy, const ExpertRows& bias, const TensorView& group_offsets,
                 const TensorView& dprobs, bool accumulate, cudaStream_t stream);

}  // namespace moe
