// quantize_gathered (moe/quantize.h): the quantize tile kernel (quantize_tile.cuh) with a source that
// reads row r of its matrix from x[row_slots[r] / slots] (zeros where the map has no slot), so the
// codes and scales are bitwise those of quantize() on Dispatcher::permute's x_perm -- one gathered
// read of x instead of the permute's write of x_perm and the quantize's read of it.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include <cutlass/fast_math.h>

#include "device/cuda_check.h"
#include "moe/device_errors.h"
#include "moe/error.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quantize_tile.cuh"

namespace moe {
namespace quant {
namespace {

struct GatherSource {
  // Five CTAs per SM at 48 registers: each chunk waits for its map entry, then for its row, so more
  // loads in flight pay (Nsight Compute, H200, deepseek-v3-ep32's x: 661 us at four CTAs, 615 at
  // five; two load passes at five CTAs 625).
  static constexpr int kCtasPerSm = 5;
  static constexpr int kLoadPasses = 1;
  static constexpr bool kRowPartials = false, kPaired = false;
  const uint16_t* x;  // bf16 bits [T, K]
  const int32_t* row_slots;
  // slot / slots as a high multiply and a shift (a 64-bit division was a subroutine call per chunk
  // that also spilled: docs/quantization.md).
  cutlass::FastDivmod by_slots;
  uint32_t slot_end;  // min(T * slots, 2^31): entries must lie in [-1, slot_end)
  uint32_t row_bytes;  // x's row pitch in bytes: 2 K < 2^32 (launch_tile: K < 2^31)
  uint32_t* error_word;

  struct Context {
    const int32_t* map;  // the map entry of the thread's first chunk
    const char* cols;    // x's row 0 at the thread's first chunk's column
    bool reports;        // that column is 0: the thread's chunks in it report bad entries
  };
  using Loaded = uint4;
  __device__ __forceinline__ Context context(const QuantParams&, const TileSpan& t, int r0, int c0) const {
    return {row_slots + t.m0 + r0, reinterpret_cast<const char*>(x + t.k0 + c0), t.k0 + c0 == 0};
  }
  __device__ __forceinline__ static Loaded empty() { return make_uint4(0, 0, 0, 0); }
  // The map entry is read per chunk (the compiler waits for it before the chunk's row load; issuing
  // all of a thread's entry loads first measured the same: the kernel is issue-bound). A bad entry
  // is reported once per row, by its first chunk.
  __device__ __forceinline__ Loaded load(const Context& ctx, const QuantParams&, int dr, int dc) const {
    const int32_t slot = __ldg(ctx.map + dr);
    if (static_cast<uint32_t>(slot) < slot_end) {  // -1 and other negative entries wrap past it
      const uint32_t token = static_cast<uint32_t>(by_slots.div(slot));
      return load_chunk(reinterpret_cast<const uint16_t*>(ctx.cols + 2 * dc + static_cast<uint64_t>(token) * row_bytes));
    }
    if (slot != -1 && dc == 0 && ctx.reports && error_word != nullptr) atomicOr(error_word, kErrBadRowMap);
    return empty();
  }
  __device__ __forceinline__ uint4 value(const Loaded& v) const { return v; }
};

}  // namespace
}  // namespace quant

void quantize_gathered(const QuantConfig& config, const TensorView& x, const TensorView& row_slots, int slots,
                       const QuantizedTensor& out, uint32_t* error_word, cudaStream_t stream) {
  using namespace quant;
  validate_quant_config(config);
  MOE_CHECK(config.blocking == QuantBlocking::k1D &&
                (config.format == QuantFormat::kFP8Block || config.format == QuantFormat::kMXFP8),
            "argument 'config': the gathered quantize produces FP8 block scaling or MXFP8 with 1-D blocks only");
  MOE_CHECK(x.ndim == 2, "argument 'x': expected a matrix [T, K], got shape ", x.shape_string());
  check_device_tensor(x, "x", DType::kBF16, {x.shape[0], x.shape[1]}, 16);
  MOE_CHECK(slots >= 1, "argument 'slots': expected >= 1, got ", slots);
  MOE_CHECK(row_slots.ndim == 1, "argument 'row_slots': expected one dimension [rows], got shape ",
            row_slots.shape_string());
  const int64_t rows = row_slots.shape[0];
  check_device_tensor(row_slots, "row_slots", DType::kInt32, {rows}, 4);
  MOE_CHECK((rows + 127) / 128 <= 65535, "argument 'row_slots': expected at most 65535 * 128 rows, got ", rows);
  MOE_CHECK(config.format != QuantFormat::kMXFP8 || !config.columnwise || rows % 32 == 0, "argument 'row_slots': ",
            "mxfp8 columnwise needs the rows a multiple of 32 (whole 32x1 blocks), got ", rows);
  // The gathered matrix [rows, K], as quantize() would see it: the checks below read its shape and
  // x's pointer only (non-null and aligned: no pointer attributes are queried). With T = 0 (x may
  // have no memory) every row is a zero row and x is never read: a placeholder address, aligned and
  // never dereferenced, stands in for x's.
  alignas(16) static const uint16_t kNoTokens[8] = {};
  const TensorView gathered(x.shape[0] > 0 ? x.data : const_cast<uint16_t*>(kNoTokens), DType::kBF16,
                            {rows, x.shape[1]}, x.device);
  const QuantArgs a = check_quantize_args(config, gathered, out);
  zero_scale_padding(config, a, stream);
  if (a.M == 0 || a.K == 0) return;
  const QuantParams p = quant_params(config, a);
  // Entries are int32, so at most 2^31 slots are addressable whatever T * slots is.
  const int64_t slot_end = std::min<int64_t>(x.shape[0] * static_cast<int64_t>(slots), int64_t{1} << 31);
  const GatherSource src{static_cast<const uint16_t*>(x.data), row_slots.ptr<const int32_t>(),
                         cutlass::FastDivmod(slots), static_cast<uint32_t>(slot_end),
                         static_cast<uint32_t>(2 * p.K), error_word};
  if (config.format == QuantFormat::kFP8Block)
    launch_tile<QuantFormat::kFP8Block, false, false>(p, 1, stream, src);
  else
    launch_tile<QuantFormat::kMXFP8, false, false>(p, 1, stream, src);
}

}  // namespace moe
