// The quantize kernels' shared parts: parameters, chunk helpers and the tile kernel (one 128 x 128
// tile per CTA: the columnwise copy and / or 2-D blocks), used by quantize() and, with other
// sources of the tile's chunks, by quantize_gathered() (rows gathered through a row map),
// activation_forward_quantized() (act(h) x prob) and activation_backward_quantized() (dh). See
// quantize_kernels.cu for how the kernels divide the work.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <climits>

#include "device/cuda_check.h"
#include "moe/error.h"
#include "moe/quantize.h"
#include "quant/quant_args.h"
#include "quant/quant_device.cuh"

namespace moe::quant {

constexpr int kThreads = 256;
constexpr int kTile = 128;        // tile rows and columns of quantize_tile_kernel
constexpr int kChunks = kTile / 8;  // 16-byte chunks per tile row

struct CopyParams {
  uint8_t* data;  // nullptr: copy not produced
  void* scale;
  int64_t block_rows, block_cols, scale_entries;
  ScaleLayout layout;
  bool vec;  // columnwise copy: rows of the copy start 16-byte (FP8) / 8-byte (FP4) aligned;
             // rowwise copy: the data is 8-byte aligned
};

struct QuantParams {
  const uint16_t* x;  // bf16 bits
  int64_t M, K;
  CopyParams row, col;
  bool pow2;
  const float* global_amax;  // NVFP4
  uint64_t seed, offset;
};

inline CopyParams copy_params(const CopyArgs& a, bool vec) {
  return CopyParams{static_cast<uint8_t*>(a.enabled ? a.data : nullptr), a.scale, a.block_rows, a.block_cols,
                    a.scale_entries, a.layout, vec};
}

// Max over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp calls it.
template <int kWidth>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int s = kWidth / 2; s > 0; s /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  return v;
}

// The same on two 16-bit halves at once.
template <int kWidth>
__device__ __forceinline__ uint32_t group_max_pairs(uint32_t v) {
#pragma unroll
  for (int s = kWidth / 2; s > 0; s /= 2) v = __vmaxu2(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  return v;
}

__device__ __forceinline__ uint32_t chunk_amax_bits(const uint4& v) {
  uint32_t a = abs_max_pairs(0u, v.x);
  a = abs_max_pairs(a, v.y);
  a = abs_max_pairs(a, v.z);
  a = abs_max_pairs(a, v.w);
  return pairs_amax_bits(a);
}

__device__ __forceinline__ uint4 load_chunk(const uint16_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// The eight E2M1 codes of one chunk of 8 consecutive elements (element 0 in the low nibble); pos
// is the flat position of its first element in the rowwise copy (a multiple of 8; it keys the
// stochastic rounding bits).
template <bool kSR>
__device__ __forceinline__ uint32_t fp4_chunk_codes(const QuantParams& p, const uint4& v, float factor, int64_t pos) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  uint32_t packed = 0;
  if constexpr (kSR) {
    const Philox4 r0 = sr_bits4(p.seed, p.offset, 0, static_cast<uint64_t>(pos) / 4);
    const Philox4 r1 = sr_bits4(p.seed, p.offset, 0, static_cast<uint64_t>(pos) / 4 + 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = i % 2 ? bf16_word_hi(w[i / 2]) : bf16_word_lo(w[i / 2]);
      packed |= static_cast<uint32_t>(e2m1_from_float_sr(__fmul_rn(x, factor), i < 4 ? r0.v[i] : r1.v[i - 4]))
                << (4 * i);
    }
  } else {
    with_numbers_tag(products_are_numbers(factor), [&](auto numbers) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float x = i % 2 ? bf16_word_hi(w[i / 2]) : bf16_word_lo(w[i / 2]);
        packed |= e2m1_code<decltype(numbers)::value>(__fmul_rn(x, factor)) << (4 * i);
      }
    });
  }
  return packed;
}

// Stores the 16 codes of one NVFP4 block (lo: elements 0-7) at flat position pos (a multiple of
// 16) of the rowwise copy: one 8-byte store where the copy is 8-byte aligned, else two 4-byte ones.
__device__ __forceinline__ void store_fp4_block(const QuantParams& p, int64_t pos, uint32_t lo, uint32_t hi) {
  uint32_t* out = reinterpret_cast<uint32_t*>(p.row.data + pos / 2);
  if (p.row.vec) {
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  } else {
    out[0] = lo;
    out[1] = hi;
  }
}

// The eight E4M3 codes of one chunk of 8 consecutive elements (element 0 in the low byte);
// kNumbers as encode_e4m3x4's.
template <bool kNumbers = false>
__device__ __forceinline__ uint2 fp8_chunk_codes(const uint4& v, float factor) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  return make_uint2(encode_e4m3x4<kNumbers>(bf16_word_lo(w[0]), bf16_word_hi(w[0]), bf16_word_lo(w[1]),
                                            bf16_word_hi(w[1]), factor),
                    encode_e4m3x4<kNumbers>(bf16_word_lo(w[2]), bf16_word_hi(w[2]), bf16_word_lo(w[3]),
                                            bf16_word_hi(w[3]), factor));
}

// Whether every lane of the warp has a NaN-free FP8 block (no_nan_products of its amax bits): the
// encoders' NaN rewrite is then skipped by the whole warp, a branch rather than a predicate.
__device__ __forceinline__ bool warp_no_nan_products(uint32_t amax_bits) {
  return __all_sync(0xFFFFFFFFu, no_nan_products(amax_bits));
}


// ---- tile kernel: columnwise copy and / or 2-D blocks ----------------------------------------

// Where a CTA's tile lies: matrix b, first row m0 and column k0 (multiples of 128), and how many of
// its rows and columns lie inside x (1 .. 128). Positions inside the tile are 32-bit; each thread
// turns them into addresses from 64-bit bases it computes once (the kernel is bound by instruction
// issue, and 64-bit index arithmetic per chunk was a large part of what it issued).
struct TileSpan {
  int64_t b, m0, k0;
  int rows, cols;
};

// Shared tile: row r holds 16 chunks of 8 bf16; chunk c of row r sits at chunk position
// c ^ swizzle(r) (the low three bits only). The term of r / 16 spreads the 8 rows r, r + 16, ...
// that a warp's column read touches at once over 8 chunk positions; the term of r % 4 spreads the
// 4 rows of the 16 x 16 block loads of 2-D NVFP4.
__device__ __forceinline__ int tile_swizzle(int r) { return ((r >> 4) & 7) ^ ((r & 3) << 1); }

// Rowwise copy of a tile with 1-D blocks, read back from shared memory: thread t takes chunks
// 2 (t % 8) and 2 (t % 8) + 1 (16 elements) of tile rows t / 8 + 32 i, so a block is kB / 16 lanes
// and its scale arithmetic runs once per 16 elements instead of once per 8 (the kernel is bound by
// instruction issue), while a warp's store still covers whole rows of the copy (16-byte FP8
// stores where the copy is 16-byte aligned, 8-byte NVFP4 stores where it is 8-byte aligned).
// Every lane of the CTA calls it (the shuffles). Where the factors come from:
enum class RowFactor {
  kRowBlocks,     // 1-D blocks: computed here, scales stored here
  kTile,          // 2-D FP8: the tile is one block, its factor passed in
  kSharedBlocks,  // 2-D NVFP4: the 16 x 16 blocks' factors in shared memory, [block row][block column]
};
template <QuantFormat F, bool kSR, RowFactor kFactor = RowFactor::kRowBlocks>
__device__ __forceinline__ void tile_rows_from_shared(const QuantParams& p, const uint4* tile, const TileSpan& t,
                                                      float S, float tile_factor = 0.0f, bool tile_numbers = false,
                                                      const float* blk_factor = nullptr) {
  constexpr int kB = block_len<F>();
  constexpr int kGroup = kB / 16;  // lanes per block: 8, 2 or 1
  constexpr int kRows = kThreads / 8;  // tile rows per pass
  constexpr int kPasses = kTile / kRows;
  const int pair = threadIdx.x % 8, sub = pair % kGroup, r0 = threadIdx.x / 8;
  const int c = 16 * pair;  // first tile column of this thread (K % 8 == 0: the second chunk may be past K)
  const bool cols_inside = c < t.cols;
  const bool one_chunk = c + 8 >= t.cols;  // only the first chunk inside x (K % 16 == 8, last tile)
  // FP8 rows start 16-byte aligned: one 16-byte store per thread (else two 8-byte ones; the data
  // check makes the copy 8-byte aligned).
  const bool vec16 = reinterpret_cast<uintptr_t>(p.row.data) % 16 == 0 && p.K % 16 == 0;
  // Flat position of (row r0, column c) in the rowwise copy and the index of its block's scale;
  // each pass moves both down kRows rows.
  int64_t pos = (t.b * p.M + t.m0 + r0) * p.K + t.k0 + c;
  const int64_t pos_step = kRows * p.K;
  int64_t scale_at = 0, scale_step = 0;
  if constexpr (kFactor == RowFactor::kRowBlocks) {
    scale_at = t.b * p.row.scale_entries +
               scale_index(p.row.layout, t.m0 + r0, (t.k0 + c) / kB, p.row.block_rows, p.row.block_cols);
    scale_step = scale_row_step(p.row, kRows);
  }
  // This thread's two chunks of tile row r, and the amax bits of their block (a shuffle reduction
  // over the block's lanes: every lane calls it).
  auto read_chunks = [&](int r, uint4& lo, uint4& hi) {
    lo = tile[r * kChunks + ((2 * pair) ^ tile_swizzle(r))];
    hi = tile[r * kChunks + ((2 * pair + 1) ^ tile_swizzle(r))];
  };
  auto block_amax_bits = [](const uint4& lo, const uint4& hi) {
    return group_max<kGroup>(max(chunk_amax_bits(lo), chunk_amax_bits(hi)));
  };
  // With at least as many lanes per block as passes (FP8 block scaling: 8 and 4), all passes'
  // blocks are encoded at once: lane `sub` of a block's lanes encodes the block of pass `sub` and
  // stores its scale, and the factors travel by shuffle -- one scale computation (two IEEE
  // divisions) and one scale store per lane instead of one per pass. The chunks are read from
  // shared memory again in the passes (the registers would not hold them).
  constexpr bool kEncodeAtOnce = kFactor == RowFactor::kRowBlocks && kGroup >= kPasses;
  float pass_factor[kPasses];
  bool numbers_at_once = false;
  if constexpr (kEncodeAtOnce) {
    uint32_t amax_bits[kPasses], all = 0;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      uint4 lo, hi;
      read_chunks(r0 + kRows * i, lo, hi);
      amax_bits[i] = block_amax_bits(lo, hi);
      all = max(all, amax_bits[i]);
    }
    uint32_t mine = amax_bits[0];
#pragma unroll
    for (int i = 1; i < kPasses; ++i)
      if (sub == i) mine = amax_bits[i];
    const BlockEncode e = block_encode<F>(__uint_as_float(mine), p.pow2, S);
    // The block's row is the row of pass `sub`; its first column is that of the block's first lane.
    if (sub < kPasses && r0 + kRows * sub < t.rows && c - 16 * sub < t.cols)
      store_scale_at<F>(p.row, scale_at + sub * scale_step, e);
    const int first_lane = (threadIdx.x % 32) & ~(kGroup - 1);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) pass_factor[i] = __shfl_sync(0xFFFFFFFFu, e.factor, first_lane + i);
    numbers_at_once = warp_no_nan_products(all);
  }
#pragma unroll
  for (int i = 0; i < kPasses; ++i, pos += pos_step, scale_at += scale_step) {
    const int r = r0 + kRows * i;
    uint4 lo, hi;
    read_chunks(r, lo, hi);
    BlockEncode e;
    bool numbers = tile_numbers;  // FP8: no product of the warp's blocks is NaN
    if constexpr (kEncodeAtOnce) {
      e.factor = pass_factor[i];
      numbers = numbers_at_once;
    } else if constexpr (kFactor == RowFactor::kTile) {
      e.factor = tile_factor;
    } else if constexpr (kFactor == RowFactor::kSharedBlocks) {
      e.factor = blk_factor[(r / 16) * 8 + pair];
    } else {
      const uint32_t amax_bits = block_amax_bits(lo, hi);
      e = block_encode<F>(__uint_as_float(amax_bits), p.pow2, S);
      if constexpr (F != QuantFormat::kNVFP4) numbers = warp_no_nan_products(amax_bits);
    }
    if (r >= t.rows || !cols_inside) continue;  // after the shuffles
    if (kFactor == RowFactor::kRowBlocks && !kEncodeAtOnce && sub == 0) store_scale_at<F>(p.row, scale_at, e);
    if constexpr (F == QuantFormat::kNVFP4) {  // K % 16 == 0
      store_fp4_block(p, pos, fp4_chunk_codes<kSR>(p, lo, e.factor, pos),
                      fp4_chunk_codes<kSR>(p, hi, e.factor, pos + 8));
    } else {
      uint8_t* out = p.row.data + pos;
      with_numbers_tag(numbers, [&](auto tag) {
        constexpr bool kNumbers = decltype(tag)::value;
        const uint2 c0 = fp8_chunk_codes<kNumbers>(lo, e.factor);
        if (one_chunk) {
          *reinterpret_cast<uint2*>(out) = c0;
          return;
        }
        const uint2 c1 = fp8_chunk_codes<kNumbers>(hi, e.factor);
        if (vec16) {
          *reinterpret_cast<uint4*>(out) = make_uint4(c0.x, c0.y, c1.x, c1.y);
        } else {
          reinterpret_cast<uint2*>(out)[0] = c0;
          reinterpret_cast<uint2*>(out)[1] = c1;
        }
      });
    }
  }
}

// Columnwise copy of a tile, read back from shared memory (the tile kernel's second pass; factors
// as in tile_rows_from_shared: computed here for 1-D blocks, passed in for 2-D ones). Every lane of
// the CTA calls it (the shuffles).
template <QuantFormat F, bool kTwoD, bool kSR>
__device__ __forceinline__ void tile_cols_from_shared(const QuantParams& p, const uint4* tile, const TileSpan& t,
                                                      float S, float tile_factor, bool tile_numbers,
                                                      const float* blk_factor) {
  constexpr int kB = block_len<F>();
  constexpr bool kNV2D = kTwoD && F == QuantFormat::kNVFP4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Columnwise copy (stored [K, M]: a column of x is a row of the copy). Pass `it` of warp w
  // handles the column pair kp = 4 (w + 8 it) + lane / 8 (tile columns 2 kp, 2 kp + 1) and the
  // 16 rows 16 run .. 16 run + 15 with run = lane % 8: per row one 32-bit word of shared memory
  // (the two columns' bf16), the 32 lanes reading 8 rows x 4 words, all in different banks.
  const uint32_t* words = reinterpret_cast<const uint32_t*>(tile);
  const int run = lane % 8;
  const int mr = 16 * run;  // first tile row of this lane's run
  const bool run_inside = mr < t.rows, run_whole = mr + 16 <= t.rows;
  const int kp0 = 4 * warp + lane / 8;  // column pair of pass 0; a pass moves it by 32 (64 columns)
  // Flat position of (column 2 kp0, row mr) in the columnwise copy and the index of its block's
  // scale; h = 1 (the pair's second column) and each pass move both.
  int64_t pos = (t.b * p.K + t.k0 + 2 * kp0) * p.M + t.m0 + mr;
  int64_t scale_at = 0, scale_h = 0, scale_pass = 0;
  if constexpr (!kTwoD) {
    scale_at = t.b * p.col.scale_entries +
               scale_index(p.col.layout, t.k0 + 2 * kp0, (t.m0 + mr) / kB, p.col.block_rows, p.col.block_cols);
    scale_h = scale_row_step(p.col, 1);
    scale_pass = scale_row_step(p.col, 64);
  }
#pragma unroll 1
  for (int it = 0; it < 2; ++it, pos += 64 * p.M, scale_at += scale_pass) {
    const int kp = kp0 + 32 * it;
    const int chunk = kp / 4;
    uint32_t w[16];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int r = mr + jj;
      w[jj] = words[(r * kChunks + (chunk ^ tile_swizzle(r))) * 4 + kp % 4];
    }
    const bool cols_inside = 2 * kp < t.cols;  // K % 8 == 0: both columns are inside x or neither
    float factor[2];
    bool numbers = tile_numbers;  // FP8: no product of the warp's blocks is NaN
    if constexpr (kTwoD) {
      factor[0] = factor[1] = kNV2D ? blk_factor[run * 8 + kp / 8] : tile_factor;
    } else {
      uint32_t a = 0;
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) a = abs_max_pairs(a, w[jj]);
      constexpr int kRuns = kB / 16;  // the lanes of one b x 1 block: 8, 2 or 1 runs
      a = group_max_pairs<kRuns>(a);
      if constexpr (F != QuantFormat::kNVFP4) numbers = warp_no_nan_products(pairs_amax_bits(a));
      if constexpr (kRuns >= 2) {
        // The pair's two blocks encoded at once: run h of the block's runs encodes column h and
        // stores its scale, the factors travel by shuffle (as in the rowwise passes).
        const int h = run % kRuns;
        const BlockEncode e = block_encode<F>(__uint_as_float(h == 1 ? a & 0xFFFF0000u : a << 16), p.pow2, S);
        // The block is inside where its first run is.
        if (h < 2 && cols_inside && 16 * (run - h) < t.rows) store_scale_at<F>(p.col, scale_at + h * scale_h, e);
        const int first_lane = lane & ~(kRuns - 1);
        factor[0] = __shfl_sync(0xFFFFFFFFu, e.factor, first_lane);
        factor[1] = __shfl_sync(0xFFFFFFFFu, e.factor, first_lane + 1);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float amax = __uint_as_float(h ? a & 0xFFFF0000u : a << 16);
          const BlockEncode e = block_encode<F>(amax, p.pow2, S);
          factor[h] = e.factor;
          if (cols_inside && run_inside) store_scale_at<F>(p.col, scale_at + h * scale_h, e);
        }
      }
    }
    if (!cols_inside || !run_inside) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x[16];
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) x[jj] = h ? bf16_word_hi(w[jj]) : bf16_word_lo(w[jj]);
      const int64_t hpos = pos + h * p.M;  // position in the columnwise copy
      if constexpr (F == QuantFormat::kNVFP4) {
        uint32_t packed[2] = {0, 0};  // M % 16 == 0: the run is whole and hpos a multiple of 16
        if constexpr (kSR) {
          const int64_t k = t.k0 + 2 * kp, m = t.m0 + mr;  // matrix column and first row of the run
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            uint32_t rb[4];
            if constexpr (kTwoD) {
              // 2-D blocks round both copies with the rowwise position's bits (exact transpose).
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const uint64_t idx = static_cast<uint64_t>((t.b * p.M + m + 4 * q + e) * p.K + k + h);
                rb[e] = sr_bits4(p.seed, p.offset, 0, idx / 4).v[idx % 4];
              }
            } else {
              const Philox4 r4 = sr_bits4(p.seed, p.offset, 1, static_cast<uint64_t>(hpos) / 4 + q);
#pragma unroll
              for (int e = 0; e < 4; ++e) rb[e] = r4.v[e];
            }
#pragma unroll
            for (int e = 0; e < 4; ++e)
              packed[q / 2] |= static_cast<uint32_t>(e2m1_from_float_sr(__fmul_rn(x[4 * q + e], factor[h]), rb[e]))
                               << (4 * ((4 * q + e) % 8));
          }
        } else {
          with_numbers_tag(products_are_numbers(factor[h]), [&](auto tag) {
#pragma unroll
            for (int jj = 0; jj < 16; ++jj)
              packed[jj / 8] |= e2m1_code<decltype(tag)::value>(__fmul_rn(x[jj], factor[h])) << (4 * (jj % 8));
          });
        }
        uint8_t* dst = p.col.data + hpos / 2;
        if (p.col.vec) {
          *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
        } else {  // 4-byte aligned (the data check)
          reinterpret_cast<uint32_t*>(dst)[0] = packed[0];
          reinterpret_cast<uint32_t*>(dst)[1] = packed[1];
        }
      } else {
        uint8_t* dst = p.col.data + hpos;
        with_numbers_tag(numbers, [&](auto tag) {
          constexpr bool kNumbers = decltype(tag)::value;
          uint32_t q[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
            q[i] = encode_e4m3x4<kNumbers>(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3], factor[h]);
          if (p.col.vec && run_whole) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(q[0], q[1], q[2], q[3]);
          } else {  // FP8 block with M not a multiple of 16: rows one by one, inside x only
            for (int jj = 0; jj < 16 && mr + jj < t.rows; ++jj)
              dst[jj] = static_cast<uint8_t>(q[jj / 4] >> (8 * (jj % 4)));
          }
        });
      }
    }
  }
}

// Where the tile kernel's bf16 chunks come from: x itself (quantize), x's rows through a row map
// (quantize_gathered), or act(h) x prob / dh computed in registers (activation_forward_quantized,
// activation_backward_quantized). A source works in three steps, so that a pass's loads are in
// flight before any arithmetic on them: context() once per thread, given the
// tile position (r0, c0) of the thread's first chunk (what every chunk of the thread needs: base
// addresses, values read from global memory); load() issues the reads of the chunk at tile
// position (r0 + dr, c0 + dc), inside the matrix (dr, dc are compile-time constants once the
// kernel's loop is unrolled, so addresses are bases plus constant offsets); value() gives its 8
// bf16 elements. empty() stands for a chunk outside the matrix (zeros, which never raise an amax);
// kCtasPerSm is the occupancy the kernel is compiled for (its registers hold a thread's loaded
// chunks) and kLoadPasses how many groups of them it loads one after the other. A source with
// kRowPartials also sums a term along each row: value(loaded, term) gives a chunk's, and each tile
// row's sum goes to store_partial(row, grid column, sum). A kPaired source makes two tiles per CTA:
// value(loaded, [term,] second) also gives the chunk at the same place of the tile
// second_tile_offset() columns to the right, and the grid covers first_tiles(K) column tiles.
struct MatrixSource {
  static constexpr int kCtasPerSm = 4;
  static constexpr int kLoadPasses = 1;
  static constexpr bool kRowPartials = false, kPaired = false;
  struct Context {
    const uint16_t* first;  // the thread's first chunk
    uint32_t K;             // < 2^31 (launch_tile)
  };
  using Loaded = uint4;
  __device__ __forceinline__ Context context(const QuantParams& p, const TileSpan& t, int r0, int c0) const {
    return {p.x + (t.b * p.M + t.m0 + r0) * p.K + t.k0 + c0, static_cast<uint32_t>(p.K)};
  }
  __device__ __forceinline__ static Loaded empty() { return make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ Loaded load(const Context& ctx, const QuantParams&, int dr, int dc) const {
    return load_chunk(ctx.first + static_cast<uint64_t>(static_cast<uint32_t>(dr)) * ctx.K + dc);
  }
  __device__ __forceinline__ uint4 value(const Loaded& v) const { return v; }
};

template <QuantFormat F, bool kTwoD, bool kSR, class Source = MatrixSource>
__global__ void __launch_bounds__(kThreads, kSR ? 2 : Source::kCtasPerSm) quantize_tile_kernel(QuantParams p, Source src) {
  constexpr int kB = block_len<F>();
  constexpr bool kNV2D = kTwoD && F == QuantFormat::kNVFP4;  // 16 x 16 blocks: one warp per block
  constexpr int kLoads = kTile * kChunks / kThreads;          // 8 chunks per thread
  __shared__ __align__(16) uint4 tile[kTile * kChunks];
  __shared__ float blk_factor[kNV2D ? 64 : 1];  // 2-D NVFP4: [block row][block column] of the tile
  __shared__ uint32_t warp_amax[kThreads / 32];  // 2-D FP8: the tile is one block

  TileSpan t;
  t.b = blockIdx.z;
  t.m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  t.k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  t.rows = static_cast<int>(min(p.M - t.m0, static_cast<int64_t>(kTile)));
  t.cols = static_cast<int>(min(p.K - t.k0, static_cast<int64_t>(kTile)));
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float S = F == QuantFormat::kNVFP4 ? nvfp4_global_scale(p.global_amax[t.b]) : 1.0f;

  // Which chunk (row r, chunk c of the tile) load i of this thread holds: 2-D NVFP4 gives warp w
  // the 16 x 16 blocks (w, i), lane l row l / 2 and chunk l % 2 of the block; otherwise a half
  // warp holds a tile row (one 1 x 128, four 1 x 32 or eight 1 x 16 blocks).
  auto chunk_row = [&](int i) { return kNV2D ? 16 * warp + lane / 2 : tid / kChunks + 16 * i; };
  auto chunk_col = [&](int i) { return kNV2D ? 2 * i + lane % 2 : tid % kChunks; };

  const int r0 = chunk_row(0), c0 = 8 * chunk_col(0);
  const typename Source::Context ctx = src.context(p, t, r0, c0);
  // The loads are issued in Source::kLoadPasses passes (each loaded, converted and put in shared
  // memory before the next): a source whose loaded chunks take many registers holds a fraction of
  // them at a time, for more CTAs per SM. The 2-D paths read v again below: one pass.
  constexpr int kPasses = Source::kLoadPasses, kPerPass = kLoads / kPasses;
  static_assert(kLoads % kPasses == 0 && (kPasses == 1 || !kTwoD), "load passes: 1-D blocks, whole passes");
  // A paired source gives each chunk of this tile and the one at the same place of a second tile
  // (see ActivationGradSource), kept in registers until the first tile is quantized.
  constexpr bool kPaired = Source::kPaired;
  static_assert((!kPaired && !Source::kRowPartials) || (F == QuantFormat::kFP8Block && !kTwoD),
                "paired tiles and row partial sums: FP8 block scaling with 1-D blocks");
  uint4 v[kLoads];
  uint4 second[kPaired ? kLoads : 1];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    typename Source::Loaded loaded[kPerPass];
#pragma unroll
    for (int q = 0; q < kPerPass; ++q) {
      const int i = pass * kPerPass + q, r = chunk_row(i), c = 8 * chunk_col(i);
      loaded[q] = r < t.rows && c < t.cols ? src.load(ctx, p, r - r0, c - c0) : Source::empty();
    }
    if constexpr (Source::kRowPartials) {
      float term[kPerPass];
#pragma unroll
      for (int q = 0; q < kPerPass; ++q) {
        const int i = pass * kPerPass + q;
        if constexpr (kPaired)
          v[i] = src.value(loaded[q], term[q], second[i]);
        else
          v[i] = src.value(loaded[q], term[q]);
      }
#pragma unroll
      for (int q = 0; q < kPerPass; ++q) {  // a half warp holds a tile row: a fixed shuffle tree
#pragma unroll
        for (int s = kChunks / 2; s > 0; s /= 2) term[q] += __shfl_xor_sync(0xFFFFFFFFu, term[q], s);
        const int i = pass * kPerPass + q, r = chunk_row(i);
        if (chunk_col(i) == 0 && r < t.rows) src.store_partial(t.m0 + r, static_cast<int>(blockIdx.x), term[q]);
      }
    } else if constexpr (kPaired) {
#pragma unroll
      for (int q = 0; q < kPerPass; ++q) v[pass * kPerPass + q] = src.value(loaded[q], second[pass * kPerPass + q]);
    } else {
#pragma unroll
      for (int q = 0; q < kPerPass; ++q) v[pass * kPerPass + q] = src.value(loaded[q]);
    }
#pragma unroll
    for (int q = 0; q < kPerPass; ++q) {
      const int i = pass * kPerPass + q, r = chunk_row(i);
      tile[r * kChunks + (chunk_col(i) ^ tile_swizzle(r))] = v[i];
    }
  }

  float tile_factor = 1.0f;     // 2-D FP8
  bool tile_numbers = false;    // 2-D FP8: no product of the tile is NaN
  if constexpr (kTwoD && F == QuantFormat::kFP8Block) {
    uint32_t a = 0;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) a = max(a, chunk_amax_bits(v[i]));
    a = group_max<32>(a);
    if (lane == 0) warp_amax[warp] = a;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) a = max(a, warp_amax[w]);
    const BlockEncode e = block_encode<F>(__uint_as_float(a), p.pow2, S);
    tile_factor = e.factor;
    tile_numbers = no_nan_products(a);
    if (tid == 0) {
      const int64_t gr = t.m0 / kB, gc = t.k0 / kB;
      if (p.row.data) store_block_scale<F>(p.row, t.b, gr, gc, e);
      if (p.col.data) store_block_scale<F>(p.col, t.b, gc, gr, e);
    }
    if (p.row.data)
      tile_rows_from_shared<F, kSR, RowFactor::kTile>(p, tile, t, S, tile_factor, tile_numbers);
  } else if constexpr (kNV2D) {
    // 16 x 16 blocks: a block is the whole warp (load i of warp w holds block (w, i)).
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const float amax = __uint_as_float(group_max<32>(chunk_amax_bits(v[i])));
      const BlockEncode e = block_encode<F>(amax, p.pow2, S);
      if (lane == 0) {
        blk_factor[warp * 8 + i] = e.factor;
        const int64_t gr = t.m0 / kB + warp, gc = t.k0 / kB + i;
        if (gr * kB < p.M && gc * kB < p.K) {  // M, K multiples of 16: the block is whole
          if (p.row.data) store_block_scale<F>(p.row, t.b, gr, gc, e);
          if (p.col.data) store_block_scale<F>(p.col, t.b, gc, gr, e);
        }
      }
    }
    __syncthreads();
    if (p.row.data)
      tile_rows_from_shared<F, kSR, RowFactor::kSharedBlocks>(p, tile, t, S, 0.0f, false, blk_factor);
  } else {
    __syncthreads();  // the tile is in shared memory
    if (p.row.data) tile_rows_from_shared<F, kSR>(p, tile, t, S);
  }
  if (p.col.data) tile_cols_from_shared<F, kTwoD, kSR>(p, tile, t, S, tile_factor, tile_numbers, blk_factor);
  if constexpr (kPaired) {
    TileSpan t2 = t;
    t2.k0 = t.k0 + src.second_tile_offset();
    t2.cols = static_cast<int>(min(p.K - t2.k0, static_cast<int64_t>(kTile)));
    __syncthreads();  // every read of the first tile is done
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int r = chunk_row(i);
      tile[r * kChunks + (chunk_col(i) ^ tile_swizzle(r))] = second[i];
    }
    __syncthreads();
    if (p.row.data) tile_rows_from_shared<F, kSR>(p, tile, t2, S);
    if (p.col.data) tile_cols_from_shared<F, kTwoD, kSR>(p, tile, t2, S, tile_factor, tile_numbers, blk_factor);
  }
}

// Layout padding is part of the output: zero it (a memset node when captured).
inline void zero_scale_padding(const QuantConfig& config, const QuantArgs& a, cudaStream_t stream) {
  const int scale_bytes = config.format == QuantFormat::kFP8Block ? 4 : 1;
  for (const CopyArgs* c : {&a.row, &a.col})
    if (c->enabled && c->scale_padded && a.B > 0)
      MOE_CUDA_CHECK(cudaMemsetAsync(c->scale, 0, static_cast<size_t>(a.B * c->scale_entries * scale_bytes), stream));
}

// The kernels' parameters for checked arguments (bf16 x).
inline QuantParams quant_params(const QuantConfig& config, const QuantArgs& a) {
  QuantParams p;
  p.x = static_cast<const uint16_t*>(a.x);
  p.M = a.M;
  p.K = a.K;
  // vec of the rowwise copy: 8-byte aligned FP4 data, written 16 codes per store.
  p.row = copy_params(a.row, reinterpret_cast<uintptr_t>(a.row.data) % 8 == 0);
  // Columnwise rows of M codes start at multiples of the vector size when M is a multiple of 16
  // and the data pointer is aligned to the vector (16 bytes FP8, 8 bytes FP4).
  const bool fp4 = config.format == QuantFormat::kNVFP4;
  const bool col_vec = a.col.enabled && a.M % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(a.col.data) % (fp4 ? 8 : 16) == 0;
  p.col = copy_params(a.col, col_vec);
  p.pow2 = config.pow2_scale;
  p.global_amax = a.global_amax;
  p.seed = config.seed;
  p.offset = config.offset;
  return p;
}

template <QuantFormat F, bool kTwoD, bool kSR, class Source = MatrixSource>
void launch_tile(const QuantParams& p, int64_t B, cudaStream_t stream, const Source& src = {}) {
  // The kernel's in-tile offsets are 32-bit (row times K included).
  MOE_CHECK(p.K <= INT32_MAX, "argument 'x': expected fewer than 2^31 columns, got ", p.K);
  // A paired source's grid covers the first tile of each pair (its own column tiles).
  int64_t col_tiles = (p.K + kTile - 1) / kTile;
  if constexpr (Source::kPaired) col_tiles = src.first_tiles(p.K);
  const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>((p.M + kTile - 1) / kTile),
                  static_cast<unsigned>(B));
  quantize_tile_kernel<F, kTwoD, kSR, Source><<<grid, kThreads, 0, stream>>>(p, src);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::quant
