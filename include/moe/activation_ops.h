// Activation x prob kernels of the expert layer (docs/semantics.md, Activations), unfused: bf16 in
// and out, fp32 math.
//
//   forward   out[r, j] = act(h[r, :])_j * p[r]                      (j < F)
//   backward  dh[r, :]  = d(act(h[r, :]) * p[r]) / dh  applied to d_out[r, :]
//             dprobs[r] = sum_j d_out[r, j] * act_unscaled(h[r, :])_j   (fixed-order per-row sum)
//
// Nothing but the output is stored: backward recomputes act from h. Rows past the valid total are
// neither read nor written; the total is read on the device from group_offsets (int32 [E + 1],
// valid rows = min(group_offsets[E], R)), so a call is graph-safe: no host read, no sync, no
// allocation. A default-constructed TensorView() means "absent" for probs, group_offsets and
// dprobs.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/activation.h"
#include "moe/quantize.h"
#include "moe/tensor.h"

namespace moe {

// h bf16 [R, fc1_out] (fc1_out = 2F gated, F for squared-relu; columns in the GLU interleave of
// params), probs fp32 [R] or absent (scale 1), group_offsets int32 [E + 1] or absent (all R rows),
// out bf16 [R, F]. F must be a multiple of 8 and every pointer 16-byte aligned (16-byte vectors).
void activation_forward(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                        const TensorView& group_offsets, const TensorView& out, cudaStream_t stream);

// activation_forward and quantize of its output in one pass, act never stored: `out` receives
// bitwise the codes and scales of quantize(config, out of activation_forward(params, h, probs,
// group_offsets)), except that rows past the valid total are quantized as zeros (the unfused
// activation leaves them unwritten). config: FP8 block scaling, 1-D blocks, either or both copies
// ([R, F] rowwise, [F, R] columnwise). Arguments as for activation_forward, out as for quantize.
void activation_forward_quantized(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                  const TensorView& group_offsets, const QuantConfig& config,
                                  const QuantizedTensor& out, cudaStream_t stream);

// d_out bf16 [R, F] -> dh bf16 [R, fc1_out] (same layout as h) and dprobs fp32 [R] (or absent).
// dh may be the very buffer of h (in place): every element of h is read before its gradient is
// written over it.
// Derivatives follow docs/semantics.md: for clamped-swiglu the gate derivative is zero where g >
// limit and the linear one where |l| > limit.
void activation_backward(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                         const TensorView& d_out, const TensorView& group_offsets, const TensorView& dh,
                         const TensorView& dprobs, cudaStream_t stream);

// activation_backward and quantize of its dh in one pass, dh never stored: `out` receives bitwise
// the codes and scales of quantize(config, dh of activation_backward(...)) ([R, fc1_out] rowwise,
// [fc1_out, R] columnwise), except that rows past the valid total are quantized as zeros. config:
// FP8 block scaling, 1-D blocks, either or both copies. dprobs fp32 [R] or absent: the same sum as
// activation_backward's, added in another order (per 128-column tile of dh, then over the tiles),
// so equal to it within fp32 rounding; it needs dprobs_workspace, fp32 with at least
// activation_backward_quantized_workspace(params, R, F) elements (unused without dprobs).
int64_t activation_backward_quantized_workspace(const ActivationParams& params, int64_t R, int64_t F);
// Whether activation_backward_quantized evaluates each feature's derivatives once (squared-relu,
// GLU interleave 1, or interleave 0 with F a multiple of 128, where a CTA makes a feature block's
// gate and linear tiles); elsewhere twice, once for the gate and once for the linear chunk.
bool activation_backward_quantized_evaluates_once(const ActivationParams& params, int64_t F);
void activation_backward_quantized(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                   const TensorView& d_out, const TensorView& group_offsets,
                                   const QuantConfig& config, const QuantizedTensor& out, const TensorView& dprobs,
                                   const TensorView& dprobs_workspace, cudaStream_t stream);

}  // namespace moe
