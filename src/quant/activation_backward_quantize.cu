// activation_backward_quantized (moe/activation_ops.h): the activation's backward dh quantized
// without storing dh. The quantize tile kernel (quantize_tile.cuh) with a source that computes each
// 8-column chunk of dh from h, d_out and the row's prob with the backward kernel's math and bf16
// rounding (kernels/activation_math.cuh), so the codes and scales are bitwise those of quantize()
// applied to activation_backward()'s dh: one read of h and d_out instead of a write and a read of dh
// besides. With GLU interleave 0 and F a multiple of 128 a CTA makes a feature block's gate tile
// and its linear tile F columns to the right from one evaluation of the derivatives (paired
// tiles); otherwise each chunk of dh is computed on its own (with interleave 0 or >= 8 a feature's
// derivatives then twice, once for its gate and once for its linear chunk). The prob's gradient
// (sum over the row of d_out x act_unscaled) is summed per tile row (a fixed shuffle tree) into a
// workspace, then per row over the tiles in a fixed order by a second kernel: deterministic, no
// atomics, though in another order than activation_backward's.
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

// A gated activation's gate and linear tiles can be made by one CTA when each feature block's two
// tiles are whole tiles of dh: interleave 0 and F a multiple of 128.
bool paired_tiles(const ActivationParams& params, int64_t F) {
  return params.kind != Activation::kSquaredReLU && params.glu_interleave == 0 && F % kTile == 0;
}

// What the source reads: h [M, in_cols] in the GLU interleave of the params, d_out [M, F], probs [M]
// or null; where it writes the tiles' row sums of the prob's gradient ([tiles, M], null: none).
struct GradInputs {
  const __nv_bfloat16* h;
  const __nv_bfloat16* d_out;
  const float* probs;
  const int32_t* group_offsets;  // null: all M rows
  int groups;
  int64_t M, in_cols;
  int F, interleave;
  kernels::ActConsts c;
  float* partials;
};

template <Activation A, bool kProbs, bool kDprobs, bool kPairedTiles>
struct ActivationGradSource {
  static constexpr bool kGated = A != Activation::kSquaredReLU;
  static_assert(!kPairedTiles || kGated, "paired tiles: a gate and a linear tile");
  // A thread's 8 chunks of h (gate and linear) and d_out in four passes of two: 64 registers, four
  // CTAs per SM; paired tiles also hold the 8 linear chunks until the gate tile is done (three).
  static constexpr int kCtasPerSm = kPairedTiles ? 3 : 4;
  static constexpr int kLoadPasses = 4;
  static constexpr bool kRowPartials = kDprobs, kPaired = kPairedTiles;
  GradInputs in;

  // Paired tiles: the grid covers the gate tiles [0, F); each one's linear tile lies F to the right.
  __device__ __forceinline__ int64_t second_tile_offset() const { return in.F; }
  int64_t first_tiles(int64_t K) const { return K / (2 * kTile); }

  struct Context {
    int64_t valid;  // rows of dh: the end of the last group
    int64_t m;      // row and column of dh of the thread's first chunk
    int col;
  };
  // A chunk's raw inputs: the gate and linear values of its features (interleave 1: 4 alternating
  // pairs in g), their d_out values, the row's prob; whether the row is valid and whether the chunk
  // holds gate gradients (each feature's term of the prob's gradient is counted in its gate chunk).
  struct Loaded {
    uint4 g, l, go;
    float prob;
    bool live, gate;
  };

  __device__ __forceinline__ static Loaded empty() { return Loaded{}; }
  __device__ __forceinline__ Context context(const QuantParams& p, const TileSpan& t, int r0, int c0) const {
    return {kernels::valid_rows(in.group_offsets, in.groups, p.M), t.m0 + r0, static_cast<int>(t.k0) + c0};
  }

  // Rows past the end of the last group are quantized as zeros (the unfused backward leaves those
  // rows of dh unwritten, and no product reads them).
  __device__ __forceinline__ Loaded load(const Context& ctx, const QuantParams&, int dr, int dc) const {
    using namespace kernels;
    const int64_t m = ctx.m + dr;
    Loaded v{};
    v.live = m < ctx.valid;
    if (!v.live) return v;
    const int col = ctx.col + dc;  // a multiple of 8; F <= 2^29 (checked)
    const uint16_t* h = reinterpret_cast<const uint16_t*>(in.h) + m * in.in_cols;
    const uint16_t* d_out = reinterpret_cast<const uint16_t*>(in.d_out) + m * in.F;
    v.gate = true;
    if (kPairedTiles) {  // col is a gate column (interleave 0): the feature's linear one is F further
      v.g = load_chunk(h + col);
      v.l = load_chunk(h + in.F + col);
      v.go = load_chunk(d_out + col);
    } else if (!kGated) {
      v.g = load_chunk(h + col);
      v.go = load_chunk(d_out + col);
    } else if (in.interleave == 1) {  // columns [col, col + 8): features col / 2 .. col / 2 + 3
      v.g = load_chunk(h + col);
      const uint2 go = __ldg(reinterpret_cast<const uint2*>(d_out + col / 2));
      v.go = make_uint4(go.x, go.y, 0, 0);
    } else {  // 8 gate or 8 linear columns (F and the interleave are multiples of 8)
      const int s = in.interleave;
      int j;
      if (s == 0) {
        v.gate = col < in.F;
        j = v.gate ? col : col - in.F;
      } else {
        v.gate = (col / s) % 2 == 0;
        j = (col / (2 * s)) * s + col % s;
      }
      v.g = load_chunk(h + gate_col(j, in.F, s));
      v.l = load_chunk(h + linear_col(j, in.F, s));
      v.go = load_chunk(d_out + j);
    }
    v.prob = kProbs ? in.probs[m] : 1.0f;
    return v;
  }

  // The chunk of dh in fp32 (the backward kernel's expressions), rounded to bf16 as it stores dh;
  // `term` gets the chunk's part of the prob's gradient, `linear` (paired tiles) the linear
  // gradients of the same features.
  __device__ __forceinline__ uint4 value(const Loaded& v, float& term, uint4& linear) const {
    using namespace kernels;
    term = 0.0f;
    linear = make_uint4(0, 0, 0, 0);
    if (!v.live) return make_uint4(0, 0, 0, 0);
    const uint32_t wg[4] = {v.g.x, v.g.y, v.g.z, v.g.w}, wl[4] = {v.l.x, v.l.y, v.l.z, v.l.w};
    const uint32_t wo[4] = {v.go.x, v.go.y, v.go.z, v.go.w};
    uint4 out;
    __nv_bfloat162* d2 = reinterpret_cast<__nv_bfloat162*>(&out);
    if (kGated && !kPairedTiles && in.interleave == 1) {  // word w: (gate, linear) of feature w
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float go = w % 2 ? bf16_word_hi(wo[w / 2]) : bf16_word_lo(wo[w / 2]);
        float a, dgi, dli;
        ActOp<A>::grad(bf16_word_lo(wg[w]), bf16_word_hi(wg[w]), in.c, a, dgi, dli);
        term += go * a;
        const float gp = go * v.prob;
        d2[w] = __floats2bfloat162_rn(gp * dgi, gp * dli);
      }
      return out;
    }
    float dg[kVec], dl[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float g = i % 2 ? bf16_word_hi(wg[i / 2]) : bf16_word_lo(wg[i / 2]);
      const float l = kGated ? (i % 2 ? bf16_word_hi(wl[i / 2]) : bf16_word_lo(wl[i / 2])) : 0.0f;
      const float go = i % 2 ? bf16_word_hi(wo[i / 2]) : bf16_word_lo(wo[i / 2]);
      float a, dgi, dli;
      ActOp<A>::grad(g, l, in.c, a, dgi, dli);
      term += go * a;
      const float gp = go * v.prob;
      dg[i] = gp * dgi;
      dl[i] = gp * dli;
    }
    __nv_bfloat162* l2 = reinterpret_cast<__nv_bfloat162*>(&linear);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      if (kPairedTiles) {
        d2[i] = __floats2bfloat162_rn(dg[2 * i], dg[2 * i + 1]);
        l2[i] = __floats2bfloat162_rn(dl[2 * i], dl[2 * i + 1]);
      } else {
        d2[i] = v.gate ? __floats2bfloat162_rn(dg[2 * i], dg[2 * i + 1]) : __floats2bfloat162_rn(dl[2 * i], dl[2 * i + 1]);
      }
    }
    if (!v.gate) term = 0.0f;  // a linear chunk's features are counted in their gate chunk
    return out;
  }
  // The kernel's other calls: without the prob's gradient, or without a second tile.
  __device__ __forceinline__ uint4 value(const Loaded& v, uint4& linear) const {
    float unused;
    return value(v, unused, linear);
  }
  __device__ __forceinline__ uint4 value(const Loaded& v, float& term) const {
    uint4 unused;
    return value(v, term, unused);
  }
  __device__ __forceinline__ uint4 value(const Loaded& v) const {
    float unused_term;
    uint4 unused;
    return value(v, unused_term, unused);
  }

  __device__ __forceinline__ void store_partial(int64_t m, int x, float sum) const {
    in.partials[static_cast<int64_t>(x) * in.M + m] = sum;
  }
};

// dprobs[m] = the row's tile sums added in the grid's column order, for the valid rows.
__global__ void sum_tile_partials_kernel(const float* __restrict__ partials, int tiles, int64_t M,
                                         const int32_t* group_offsets, int groups, float* __restrict__ dprobs) {
  const int64_t m = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= kernels::valid_rows(group_offsets, groups, M)) return;
  float s = 0.0f;
  for (int x = 0; x < tiles; ++x) s += partials[x * M + m];
  dprobs[m] = s;
}

template <Activation A, bool kProbs, bool kPaired>
void launch(const QuantParams& p, const GradInputs& in, cudaStream_t stream) {
  if (in.partials != nullptr)
    launch_tile<QuantFormat::kFP8Block, false, false>(p, 1, stream, ActivationGradSource<A, kProbs, true, kPaired>{in});
  else
    launch_tile<QuantFormat::kFP8Block, false, false>(p, 1, stream, ActivationGradSource<A, kProbs, false, kPaired>{in});
}

template <Activation A>
void launch(const QuantParams& p, const GradInputs& in, bool paired, cudaStream_t stream) {
  if constexpr (A == Activation::kSquaredReLU) {  // paired is false: one tile per feature block
    if (in.probs != nullptr)
      launch<A, true, false>(p, in, stream);
    else
      launch<A, false, false>(p, in, stream);
  } else {
    if (in.probs != nullptr)
      paired ? launch<A, true, true>(p, in, stream) : launch<A, true, false>(p, in, stream);
    else
      paired ? launch<A, false, true>(p, in, stream) : launch<A, false, false>(p, in, stream);
  }
}

int64_t tiles_of(int64_t cols) { return (cols + kTile - 1) / kTile; }

}  // namespace
}  // namespace quant

bool activation_backward_quantized_evaluates_once(const ActivationParams& params, int64_t F) {
  return params.kind == Activation::kSquaredReLU || params.glu_interleave == 1 || quant::paired_tiles(params, F);
}

int64_t activation_backward_quantized_workspace(const ActivationParams& params, int64_t R, int64_t F) {
  return R * quant::tiles_of(fc1_out_features(params.kind, F));
}

void activation_backward_quantized(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                   const TensorView& d_out, const TensorView& group_offsets,
                                   const QuantConfig& config, const QuantizedTensor& out, const TensorView& dprobs,
                                   const TensorView& dprobs_workspace, cudaStream_t stream) {
  using namespace quant;
  MOE_CHECK(config.format == QuantFormat::kFP8Block && config.blocking == QuantBlocking::k1D,
            "argument 'config': the fused activation backward quantize produces FP8 block scaling with 1-D blocks ",
            "only");
  const kernels::ActivationDims d = kernels::check_activation_args(params, h, probs, group_offsets, d_out, "d_out");
  kernels::check_row_vector(dprobs, "dprobs", d.R);
  MOE_CHECK((d.R + 127) / 128 <= 65535, "argument 'h': expected at most 65535 * 128 rows, got ", d.R);
  const bool with_dprobs = !kernels::is_absent(dprobs);
  if (with_dprobs) {
    const int64_t need = activation_backward_quantized_workspace(params, d.R, d.F);
    MOE_CHECK(dprobs_workspace.dtype == DType::kFP32 && dprobs_workspace.numel() >= need &&
                  (need == 0 || dprobs_workspace.data != nullptr),
              "argument 'dprobs_workspace': expected fp32 with at least ", need,
              " elements (activation_backward_quantized_workspace), got ", dtype_name(dprobs_workspace.dtype), " ",
              dprobs_workspace.shape_string());
    if (need > 0) {
      check_device(dprobs_workspace, "dprobs_workspace", Device::kCUDA);
      check_pointer(dprobs_workspace, "dprobs_workspace", 4);
    }
  }
  // dh's shape, as activation_backward's would have it: the quantize checks read its shape only.
  const TensorView dh(h.data, DType::kBF16, {d.R, d.in_cols}, h.device);
  const QuantArgs a = check_quantize_args(config, dh, out);
  zero_scale_padding(config, a, stream);
  if (d.R == 0) return;
  const QuantParams p = quant_params(config, a);
  GradInputs in;
  in.h = h.ptr<const __nv_bfloat16>();
  in.d_out = d_out.ptr<const __nv_bfloat16>();
  in.probs = kernels::is_absent(probs) ? nullptr : probs.ptr<const float>();
  in.group_offsets = kernels::is_absent(group_offsets) ? nullptr : group_offsets.ptr<const int32_t>();
  in.groups = d.groups;
  in.M = d.R;
  in.in_cols = d.in_cols;
  in.F = static_cast<int>(d.F);
  in.interleave = params.glu_interleave;
  in.c = kernels::ActConsts{params.alpha, params.limit, params.offset};
  in.partials = with_dprobs ? dprobs_workspace.ptr<float>() : nullptr;
  const bool paired = paired_tiles(params, d.F);
  switch (params.kind) {
    case Activation::kSwiGLU: launch<Activation::kSwiGLU>(p, in, paired, stream); break;
    case Activation::kGeGLU: launch<Activation::kGeGLU>(p, in, paired, stream); break;
    case Activation::kClampedSwiGLU: launch<Activation::kClampedSwiGLU>(p, in, paired, stream); break;
    case Activation::kSquaredReLU: launch<Activation::kSquaredReLU>(p, in, paired, stream); break;
  }
  if (with_dprobs) {
    constexpr int kThreadsPerBlock = 256;
    const dim3 grid(static_cast<unsigned>((d.R + kThreadsPerBlock - 1) / kThreadsPerBlock));
    // The grid's column tiles (paired: the gate tiles), each of which wrote its rows' sums.
    const int64_t tiles = paired ? d.F / kTile : tiles_of(d.in_cols);
    sum_tile_partials_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(in.partials, static_cast<int>(tiles),
                                                                    d.R, in.group_offsets, in.groups,
                                                                    dprobs.ptr<float>());
    MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moe
