// activation_forward_quantized (moe/activation_ops.h): act(h) x prob quantized without storing act.
// The quantize tile kernel (quantize_tile.cuh) with a source that computes each 8-element chunk of
// act from h and the row's prob with the activation kernel's math and bf16 rounding
// (kernels/activation_math.cuh), so the codes and scales are bitwise those of quantize() applied to
// activation_forward()'s output -- one read of h instead of a write and a read of act besides.
#include <cuda_bf16.h>

#include "device/cuda_check.h"
#include "kernels/activation_args.h"
#include "kernels/activation_math.cuh"
#include "moe/activation_ops.h"
#include "moe/error.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quantize_tile.cuh"

namespace moe {
namespace quant {
namespace {

// What the source reads: h [M, in_cols] in the GLU interleave of the params, probs [M] or null.
struct ActivationInputs {
  const __nv_bfloat16* h;
  const float* probs;
  const int32_t* group_offsets;  // null: all M rows
  int groups;
  int64_t in_cols;
  int F, interleave;
  kernels::ActConsts c;
};

template <Activation A, bool kProbs>
struct ActivationSource {
  static constexpr bool kGated = A != Activation::kSquaredReLU;
  // A thread's 8 chunks of gate and linear inputs loaded in two passes of 4: 64 registers, four
  // CTAs per SM. All 8 at once took 115 registers (two CTAs, spills at 64) and ran 1.3x as long
  // (Nsight Compute, H200, mixtral-8x7b's act: 584 against 448 us, DRAM 52% against 68%): with two
  // CTAs per SM the loads of one overlapped the other's arithmetic too little.
  static constexpr int kCtasPerSm = 4;
  static constexpr int kLoadPasses = 2;
  static constexpr bool kRowPartials = false, kPaired = false;
  ActivationInputs in;

  struct Context {
    int64_t valid;  // rows of act: the end of the last group
    int64_t m;      // row and column of act of the thread's first chunk
    int j;
  };
  // A chunk's raw inputs: 8 gate and 8 linear values (interleave 1: 16 alternating ones, split in
  // value()), the row's prob, and whether the row is valid.
  struct Loaded {
    uint4 a, b;
    float prob;
    bool live;
  };

  __device__ __forceinline__ static Loaded empty() { return Loaded{}; }
  __device__ __forceinline__ Context context(const QuantParams& p, const TileSpan& t, int r0, int c0) const {
    return {kernels::valid_rows(in.group_offsets, in.groups, p.M), t.m0 + r0, static_cast<int>(t.k0) + c0};  // F <= 2^29
  }

  // Rows past the end of the last group are quantized as zeros: the unfused activation leaves
  // those rows of act unwritten, and no product reads them.
  __device__ __forceinline__ Loaded load(const Context& ctx, const QuantParams&, int dr, int dc) const {
    using namespace kernels;
    const int64_t m = ctx.m + dr;
    Loaded v{};
    v.live = m < ctx.valid;
    if (!v.live) return v;
    const int j = ctx.j + dc;  // F <= 2^29 (checked)
    const uint16_t* row = reinterpret_cast<const uint16_t*>(in.h) + m * in.in_cols;
    if (kGated && in.interleave == 1) {
      v.a = load_chunk(row + 2 * j);
      v.b = load_chunk(row + 2 * j + kVec);
    } else {
      v.a = load_chunk(row + (kGated ? gate_col(j, in.F, in.interleave) : j));
      if (kGated) v.b = load_chunk(row + linear_col(j, in.F, in.interleave));
    }
    v.prob = kProbs ? in.probs[m] : 1.0f;
    return v;
  }

  // act x prob of the chunk in fp32, rounded to bf16 as activation_forward stores it.
  __device__ __forceinline__ uint4 value(const Loaded& v) const {
    using namespace kernels;
    if (!v.live) return make_uint4(0, 0, 0, 0);
    const uint32_t wa[4] = {v.a.x, v.a.y, v.a.z, v.a.w}, wb[4] = {v.b.x, v.b.y, v.b.z, v.b.w};
    float g[kVec], l[kVec];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if (kGated && in.interleave == 1) {  // a: columns 2j .. 2j + 7, b: the next 8; gate at even ones
        g[w] = bf16_word_lo(wa[w]);
        l[w] = bf16_word_hi(wa[w]);
        g[w + 4] = bf16_word_lo(wb[w]);
        l[w + 4] = bf16_word_hi(wb[w]);
      } else {
        g[2 * w] = bf16_word_lo(wa[w]);
        g[2 * w + 1] = bf16_word_hi(wa[w]);
        l[2 * w] = kGated ? bf16_word_lo(wb[w]) : 0.0f;
        l[2 * w + 1] = kGated ? bf16_word_hi(wb[w]) : 0.0f;
      }
    }
    uint4 out;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i)
      h2[i] = __floats2bfloat162_rn(ActOp<A>::value(g[2 * i], l[2 * i], in.c) * v.prob,
                                    ActOp<A>::value(g[2 * i + 1], l[2 * i + 1], in.c) * v.prob);
    return out;
  }
};

template <Activation A>
void launch(const QuantParams& p, const ActivationInputs& in, cudaStream_t stream) {
  if (in.probs != nullptr)
    launch_tile<QuantFormat::kFP8Block, false, false>(p, 1, stream, ActivationSource<A, true>{in});
  else
    launch_tile<QuantFormat::kFP8Block, false, false>(p, 1, stream, ActivationSource<A, false>{in});
}

}  // namespace
}  // namespace quant

void activation_forward_quantized(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                  const TensorView& group_offsets, const QuantConfig& config,
                                  const QuantizedTensor& out, cudaStream_t stream) {
  using namespace quant;
  MOE_CHECK(config.format == QuantFormat::kFP8Block && config.blocking == QuantBlocking::k1D,
            "argument 'config': the fused activation quantize produces FP8 block scaling with 1-D blocks only");
  MOE_CHECK(h.ndim == 2, "argument 'h': expected a 2-D tensor [R, fc1_out], got shape ", h.shape_string());
  const bool gated = params.kind != Activation::kSquaredReLU;
  // act's shape, as activation_forward's out would have it: the checks below read its shape only.
  const TensorView act(h.data, DType::kBF16, {h.shape[0], gated ? h.shape[1] / 2 : h.shape[1]}, h.device);
  const kernels::ActivationDims d = kernels::check_activation_args(params, h, probs, group_offsets, act, "h");
  // The quantize checks would name act 'x'; its one limit h can break is the grid's row tiles.
  MOE_CHECK((d.R + 127) / 128 <= 65535, "argument 'h': expected at most 65535 * 128 rows, got ", d.R);
  const QuantArgs a = check_quantize_args(config, act, out);
  zero_scale_padding(config, a, stream);
  if (d.R == 0) return;
  const QuantParams p = quant_params(config, a);
  ActivationInputs in;
  in.h = h.ptr<const __nv_bfloat16>();
  in.probs = kernels::is_absent(probs) ? nullptr : probs.ptr<const float>();
  in.group_offsets = kernels::is_absent(group_offsets) ? nullptr : group_offsets.ptr<const int32_t>();
  in.groups = d.groups;
  in.in_cols = d.in_cols;
  in.F = static_cast<int>(d.F);
  in.interleave = params.glu_interleave;
  in.c = kernels::ActConsts{params.alpha, params.limit, params.offset};
  switch (params.kind) {
    case Activation::kSwiGLU: launch<Activation::kSwiGLU>(p, in, stream); break;
    case Activation::kGeGLU: launch<Activation::kGeGLU>(p, in, stream); break;
    case Activation::kClampedSwiGLU: launch<Activation::kClampedSwiGLU>(p, in, stream); break;
    case Activation::kSquaredReLU: launch<Activation::kSquaredReLU>(p, in, stream); break;
  }
}

}  // namespace moe
