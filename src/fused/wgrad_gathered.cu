// The grouped weight gradient with gathered rows (wgrad_gathered.h; design in docs/fused.md).
//
// It computes each tile transposed, dW_e^T = X_e^T dY_e, so that the operand that must be gathered
// (X, through the dispatch map) is the 128-row one and the contiguous one (dY) the 256-row one --
// the shape of the fused fc1, whose layout keeps the tensor cores fed:
//   * warp group 0 (producer) walks the expert's rows 64 at a time. It copies the 64 gathered X rows
//     (128 columns each) with 16-byte cp.async into MN-major, 128-byte-swizzled tiles (row indices
//     read four k blocks ahead; rows past the group and padding rows zero-filled). The dY tile (256
//     columns) comes by TMA: two CTAs of a cluster -- two 128-column blocks of X for the same expert
//     and dY block -- each load one half and multicast it to both, which halves the L2 -> SM traffic
//     of the larger operand. 4-stage ring.
//   * warp groups 1 and 2 (consumers) run WGMMA 64x256x16 with both operands MN-major on X columns
//     0-63 and 64-127, then write dW_e rows (dY columns) x X columns, or accumulate into fp32,
//     through a shared-memory buffer per warp group (stmatrix in, whole 128-byte rows out).
// Persistent: each cluster walks the (expert, dY block, pair of X blocks) tiles, so one tile's
// epilogue overlaps the next tile's loads. A tile's cost is its expert's rows. Where the routing
// makes a fixed stride (cluster c: tiles c, c + C, ...) hand the clusters unequal work -- under
// skewed routing it left the SMs of the luckier clusters idle for a quarter of the kernel -- the
// clusters draw their tiles from a queue instead (tile_queue.cuh), the experts with the most rows
// first. The kernel decides in its prologue, from the group sizes, so the choice is graph-safe; on
// near-balanced routing the stride stays (the queue's hand-off cost a few percent there).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <cuda.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/fast_math.h>

#include "device/cuda_check.h"
#include "device/device_groups.cuh"
#include "device/main_grad_add.cuh"
#include "fused/async_copy.cuh"
#include "fused/pipeline.cuh"
#include "fused/cluster_launch.h"
#include "fused/consumer_loop.cuh"
#include "fused/fragment_pack.cuh"
#include "fused/tensor_map.h"
#include "fused/tile_queue.cuh"
#include "fused/wgrad_gathered.h"
#include "fused/wgrad_schedule.h"
#include "moe/error.h"

namespace moe::fused {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

// kBX: X columns per CTA (tile rows), kBY: dY columns (tile columns), kBK: rows per stage.
constexpr int kBX = 128, kBY = 256, kBK = 64, kStages = 4, kCluster = 2;
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
constexpr int kProducerRegs = 88, kConsumerRegs = 208;  // as in the fused fc1: 128 * 88 + 256 * 208 <= 64K
constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kAhead = 4;  // k blocks of row indices in flight in the producer
constexpr int kBoxCols = 64;                               // one TMA box: 64 dY columns (128 bytes) x 64 rows
constexpr int kBoxBytes = kBoxCols * kBK * 2;              // 8 KiB
constexpr int kStageBytesY = kBY * kBK * 2;                // 32 KiB: both halves land in every CTA
constexpr int kStageBytesX = kBX * kBK * 2;                // 16 KiB of gathered x rows
constexpr int kBoxesPerCta = kBY / kBoxCols / kCluster;    // 2

// MN-major tiles: 64 consecutive columns of one row are 128 contiguous bytes, eight rows make a
// 1024-byte swizzle atom. The dY tile stacks the atoms of one 64-column box along the rows first,
// so that a box is 8 KiB of contiguous shared memory, exactly what one TMA box writes.
using SmemAtom = GMMA::Layout_MN_SW128_Atom<bf16>;
using SmemLayoutX = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBX>{}, Int<kBK>{}, Int<kStages>{})));
using SmemLayoutY = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBY>{}, Int<kBK>{}, Int<kStages>{}),
                                           Step<_2, _1, _3>{}));
using TiledMma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
                                         Layout<Shape<_2, _1, _1>>{}));
static_assert(cosize_v<SmemLayoutY> == kStages * kBY * kBK, "the dY stages are contiguous");
static_assert(cosize_v<SmemLayoutX> == kStages * kBX * kBK, "the X stages are contiguous, kStageBytesX apart");

// Byte offset of the 16-byte chunk holding elements (c .. c + 7, k) of stage 0 of the X tile (a
// stage's chunk is at the same offset from its stage's base): the unswizzled position from the
// layout's plain part, then the 128-byte swizzle, which acts on byte addresses (chunk bits 4-6 ^=
// row bits 7-9; the tiles are 1024-byte aligned).
__device__ __forceinline__ uint32_t x_chunk_offset(int c, int k) {
  const uint32_t linear = 2u * static_cast<uint32_t>(SmemLayoutX{}.layout_b()(c, k, 0));
  return linear ^ ((linear >> 3) & 0x70u);
}

// The epilogue goes through shared memory: per consumer warp group, 64 dY columns x its 64 X
// columns at a time, 128-byte rows whose 16-byte chunks are XOR-swizzled by row so that both the
// matrix stores and the row reads are free of bank conflicts.
constexpr int kStagedRows = 64;  // dY columns per staged part
constexpr int kStagingBytes = kStagedRows * 128;  // 8 KiB per warp group and plane
// A staged part is square: 64 dY columns x the warp group's 64 X columns, so both layouts (rows of
// dY columns or of X columns, 64 two-byte values each) fill the same 128-byte rows.
static_assert(kStagedRows == kBX / 2, "a warp group's X columns fill one staged row");
// Named barriers of the consumer warp groups (0 is __syncthreads).
constexpr int kZeroRowsBarrier = 1;      // both warp groups: rows past the group zeroed
constexpr int kStagingBarrierBase = 2;   // + group: that warp group's staging buffer
// The tile queue: indices drawn one tile ahead; read by every producer and consumer warp.
constexpr int kTileSlots = 2;
constexpr int kTileReaders = kThreads / 32;
// Experts ordered by rows in shared memory (beyond this many they keep their own order, which the
// queue still balances up to the cost of the last tiles drawn, and the schedule is not estimated:
// the queue).
constexpr int kOrderedExperts = 896;
// SharedStorage::plan
constexpr unsigned kPlanQueue = 1u;    // the clusters draw from the queue (else the fixed stride)
constexpr unsigned kPlanOrdered = 2u;  // SharedStorage::order lists the experts (else their own order)

struct SharedStorage {
  alignas(1024) bf16 x[cosize_v<SmemLayoutX>];
  alignas(1024) bf16 y[cosize_v<SmemLayoutY>];
  // Per warp group: bf16 values in plane 0; fp32 values as their high (plane 0) and low (plane 1) halves.
  alignas(128) uint8_t staging[2][2][kStagingBytes];
  alignas(8) uint64_t full[kStages];   // the stage's copies and both TMA halves landed
  alignas(8) uint64_t empty[kStages];  // every consumer warp of the cluster is done with the stage
  TileQueueStorage<kTileSlots> queue;
  uint16_t order[kOrderedExperts];     // with kPlanOrdered: the experts, the most k blocks first
  unsigned long long stride_makespan;  // the schedule estimate: the stride's busiest cluster
  unsigned plan;                       // kPlan* bits, the same in every CTA
};

struct Params {
  CUtensorMap dy_map;  // dY as a 2D [R, M] tensor, 64 x 64 boxes
  const __nv_bfloat16* x;
  const int32_t* row_slots;
  cutlass::FastDivmod by_slots;  // slot / slots as a high multiply and a shift
  const int32_t* offsets;
  int E;
  int64_t R;
  int M, N;                 // dW_e is [M, N]: M = dY columns, N = X columns
  int y_tiles, x_pairs;     // dY blocks of 256 and pairs of X blocks of 128 per expert
  int total;                // tiles
  int* tile_counter;        // the tile queue's counter (zero between launches)
  WgradSchedule schedule;
  char* dw_base;
  int64_t dw_stride;        // bytes
  void* const* dw_table;
  bool fp32, accumulate;
  bool x_major;  // dW_e stored [N, M]
};

struct Tile {
  int e, y0, x0;           // expert, first dY column, first X column of this CTA
  int64_t begin, end;      // the expert's rows
};

// The kernel's plan (kPlan* bits) as a uniform value: every branch on it stays on the uniform
// datapath (a value merely read from shared memory is not known to be the same in every lane).
__device__ __forceinline__ unsigned read_plan(const SharedStorage& s) {
  return __reduce_or_sync(0xffffffffu, *reinterpret_cast<const volatile unsigned*>(&s.plan));
}

// The warp's next tile after tile t: drawn from the queue, or t + clusters by the stride. Lane 0
// alone takes it (only lane 0 keeps `reader` current), so the warp's one branch is lane 0's, as in
// warp_tile's use with the queue alone.
__device__ __forceinline__ int following_tile(SharedStorage& s, TileQueuePosition<kTileSlots>& reader, int lane,
                                              unsigned plan, int t, int clusters) {
  int next = 0;
  if (lane == 0) next = (plan & kPlanQueue) ? take_tile(s.queue, reader) : t + clusters;
  return warp_tile(next);
}

__device__ __forceinline__ Tile decode_tile(const SharedStorage& s, const Params& p, int t, int rank, unsigned plan) {
  Tile tile;
  const int per_expert = p.y_tiles * p.x_pairs;
  tile.e = (plan & kPlanOrdered) ? s.order[t / per_expert] : t / per_expert;
  const int local = t % per_expert;
  tile.y0 = (local % p.y_tiles) * kBY;
  tile.x0 = ((local / p.y_tiles) * kCluster + rank) * kBX;
  kernels::group_rows(p.offsets, tile.e, p.R, &tile.begin, &tile.end);
  return tile;
}

// The slot of permuted row r (-1: past the group or a padding row: zeros), as loaded: nothing may
// depend on the load until the row is needed (see source_row).
__device__ __forceinline__ int row_slot(const Params& p, int64_t r, int64_t end) {
  if (r >= end) return -1;
  return p.row_slots == nullptr ? static_cast<int>(r) : p.row_slots[r];
}
// Row of x holding a permuted row whose slot is `slot`.
__device__ __forceinline__ int source_row(const Params& p, int slot) {
  if (slot < 0) return -1;
  if (p.row_slots == nullptr) return slot;
  return p.by_slots.div(slot);
}

__device__ void produce(SharedStorage& s, const Params& p, int rank) {
  const int tid = threadIdx.x;  // 0..127
  const int lane = tid & 31;
  static_assert(kBX == 128 && kProducerThreads == 128, "the copy mapping below covers these tiles");
  // X: thread copies columns c .. c + 7 of rows r0 + 8 i (i < 8); a warp moves two whole 256-byte
  // row segments per instruction. Lane l < 16 of a warp holds the source row of row
  // (r0 & ~1) + (l & 1) + 8 (l >> 1), the rows its two row groups need; the indices are loaded
  // kAhead stages ahead, so the load's latency (an L2 round trip under full load) stays off the
  // copy path.
  const int c = (tid & 15) * 8, r0 = tid >> 4;
  const int own = (r0 & ~1) + (lane & 1) + 8 * (lane >> 1);
  const int from = r0 & 1;  // + 2 i: the lane holding row r0 + 8 i
  const uint32_t x_base = smem_u32(s.x);
  // The stage stride (16 KiB) leaves the swizzled bits alone, so a chunk's offset is its offset in
  // stage 0 plus the stage's base.
  static_assert(kStageBytesX % 1024 == 0, "stage bases keep the 128-byte swizzle pattern");
  uint32_t chunk[kBK / 8];
#pragma unroll
  for (int i = 0; i < kBK / 8; ++i) chunk[i] = x_chunk_offset(c, r0 + 8 * i);
  RingPosition<kStages> ring;
  ring.phase = 1;  // a fresh barrier counts as released for parity 1
  // With the queue, thread 0 of CTA 0 draws the cluster's tiles: the next one once a tile's loads
  // are issued, which the consumers are still four stages from using up.
  const unsigned plan = read_plan(s);
  const bool queue = plan & kPlanQueue;
  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  const bool drawer = queue && rank == 0 && tid == 0;
  const int last_draw = p.total + clusters - 1;
  TileQueuePosition<kTileSlots> reader, writer;
  writer.phase = 1;
  if (drawer) draw_tile<kTileSlots, kCluster>(s.queue, writer, p.tile_counter, last_draw);
  // One call site for the next tile (a loop header calling it twice left the copy loop's shuffles
  // not provably converged: a divergence check before each).
  int t = static_cast<int>(blockIdx.x) / kCluster - clusters;
  for (;;) {
    t = following_tile(s, reader, lane, plan, t, clusters);
    if (t >= p.total) break;
    const Tile tile = decode_tile(s, p, t, rank, plan);
    const bool c_in = tile.x0 + c < p.N;
    const int64_t col0 = tile.x0 + c;
    const __nv_bfloat16* x_col = p.x + col0;
    const int k_blocks = static_cast<int>((tile.end - tile.begin + kBK - 1) / kBK);
    // ahead[j] holds the indices of k block kb0 + j. A step issues its copies first and only then
    // reloads its register for k block kb + kAhead, so no register ever waits on a load in flight
    // except the one the step itself needs (loaded kAhead steps earlier).
    int ahead[kAhead];
#pragma unroll
    for (int j = 0; j < kAhead; ++j)
      ahead[j] = lane < 16 ? row_slot(p, tile.begin + int64_t(j) * kBK + own, tile.end) : -1;
#pragma unroll 1
    for (int kb0 = 0; kb0 < k_blocks; kb0 += kAhead) {
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        const int kb = kb0 + j;
        if (kb >= k_blocks) break;
        const int64_t row0 = tile.begin + static_cast<int64_t>(kb) * kBK;
        cutlass::arch::ClusterBarrier::wait(&s.empty[ring.stage], ring.phase);
        if (tid == 0) {
          // Both halves of the dY tile land here (ours and the peer's multicast); this CTA loads
          // half `rank`: boxes 2 rank and 2 rank + 1. EVICT_LAST: the other clusters of the
          // expert's X blocks read the same dY tile at about the same time (with EVICT_FIRST the
          // fc1 weight gradient read 1.15 GB from DRAM instead of 0.76).
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.full[ring.stage], kStageBytesY);
#pragma unroll
          for (int b = 0; b < kBoxesPerCta; ++b) {
            const int box = rank * kBoxesPerCta + b;
            SM90_TMA_LOAD_MULTICAST_2D::copy(&p.dy_map, &s.full[ring.stage], static_cast<uint16_t>((1 << kCluster) - 1),
                                             static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_LAST),
                                             reinterpret_cast<char*>(s.y) + ring.stage * kStageBytesY + box * kBoxBytes,
                                             tile.y0 + box * kBoxCols, static_cast<int>(row0));
          }
        }
        const int mine = source_row(p, ahead[j]);
        const uint32_t stage_base = x_base + ring.stage * kStageBytesX;
#pragma unroll
        for (int i = 0; i < kBK / 8; ++i) {
          const int row = __shfl_sync(kFullMask, mine, from + 2 * i);
          const bool v = c_in && row >= 0;
          // An invalid chunk reads nothing (source size 0); x itself stands in as its address.
          cp_async_16(stage_base + chunk[i], x_col + (v ? static_cast<int64_t>(row) * p.N : -col0), v);
        }
        // Arrives on full[stage] once this thread's copies have landed.
        cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[ring.stage]);
        ring.advance();
        ahead[j] = lane < 16 ? row_slot(p, row0 + int64_t(kAhead) * kBK + own, tile.end) : -1;
      }
    }
    if (drawer) draw_tile<kTileSlots, kCluster>(s.queue, writer, p.tile_counter, last_draw);
  }
  cute::cp_async_wait<0>();
}


// The dY rows of a stage past the expert's group (TMA read the next expert's rows there) are set to
// zero, so that a non-finite value there cannot reach this expert through 0 * inf. Whole 128-byte
// rows: the swizzle only permutes chunks inside a row.
__device__ __forceinline__ void zero_rows_past_group(SharedStorage& s, int stage, int valid, int ctid) {
  char* base = reinterpret_cast<char*>(s.y) + stage * kStageBytesY;
  const int chunks = (kBK - valid) * (kBY / kBoxCols) * 8;  // 16-byte chunks to clear
  for (int i = ctid; i < chunks; i += kConsumerThreads) {
    const int box = i / ((kBK - valid) * 8), in_box = i % ((kBK - valid) * 8);
    const int row = valid + in_box / 8;
    *reinterpret_cast<uint4*>(base + box * kBoxBytes + row * 128 + (in_box % 8) * 16) = make_uint4(0, 0, 0, 0);
  }
  cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> WGMMA reads
  cutlass::arch::NamedBarrier::sync(kConsumerThreads, kZeroRowsBarrier);
}

// Epilogue. Accumulator (i) is X column a, dY column b of the tile, i.e. dW_e[b][a]; with
// i = v0 + 2 v1 + 4 v2 it sits at tile row (a) r + 8 v1 and column (b) c + 8 v2 + v0, where
// (r, c) = coord(0): r = the warp's first row + lane / 4, c = 2 (lane % 4).
template <class Acc, class Coord>
__device__ __forceinline__ void store_tile_elementwise(const Params& p, const Tile& tile, char* dw, const Acc& acc,
                                                       const Coord& coord) {
#pragma unroll
  for (int i = 0; i < size(acc); ++i) {
    const int a = tile.x0 + get<0>(coord(i)), b = tile.y0 + get<1>(coord(i));
    if (a >= p.N || b >= p.M) continue;
    const int64_t at = p.x_major ? static_cast<int64_t>(a) * p.M + b : static_cast<int64_t>(b) * p.N + a;
    if (p.fp32) {
      float* q = reinterpret_cast<float*>(dw) + at;
      *q = p.accumulate ? *q + acc(i) : acc(i);
    } else {
      reinterpret_cast<__nv_bfloat16*>(dw)[at] = __float2bfloat16_rn(acc(i));
    }
  }
}

// Four 8 x 8 bf16 matrices from the accumulator fragments of a warp into shared memory: lanes 8 m ..
// 8 m + 7 give the addresses of matrix m's 8 rows; register m holds matrix m's fragment (row lane / 4,
// columns 2 (lane % 4) and + 1). Transposed (kTrans), stored row j is the fragment's column j.
template <bool kTrans>
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  if constexpr (kTrans) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
  }
}

__device__ __forceinline__ uint2 ld_shared_8(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint4 ld_shared_16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Two fp32 accumulators' high (or low) 16-bit halves as one b16 pair, the first in the low half.
__device__ __forceinline__ uint32_t half_pair(float a, float b, bool high) {
  return __byte_perm(__float_as_uint(a), __float_as_uint(b), high ? 0x7632 : 0x5410);
}

// The stores through shared memory, 64 dY columns of the tile at a time. The accumulator's 8 x 8
// blocks (8 X columns x 8 dY columns, one lane quad each) go to the warp group's buffer by stmatrix,
// transposed for [M, N] (the fc1 weight gradient: a staged row is one dY column's 64 X columns) and as
// they are for [N, M] (the fc2 weight gradient: a staged row is one X column's 64 dY columns); then 8
// lanes store one whole row segment (128 bytes of bf16, 256 of fp32). bf16 values are rounded once,
// as by store_tile_elementwise; fp32 values travel as their high and low 16-bit halves in two planes
// (stmatrix moves 16-bit elements) and are put together bit for bit, and main_grad gets the same
// single addition, as a vector reduction in L2 (device/main_grad_add.cuh). Every store instruction
// covers whole 128-byte lines (the shuffle-transposed vector stores this replaces spread each
// instruction over 8 to 32 rows). M % 8 == N % 8 == 0, so a row segment of 8 is wholly in or out.
template <bool kXMajor, bool kFp32, class Acc, class Coord>
__device__ __forceinline__ void store_tile_staged(const Params& p, const Tile& tile, char* dw, const Acc& acc,
                                                  const Coord& coord, uint32_t buf, int group, int gtid, int lane) {
  static_assert(decltype(size(acc))::value == 128, "a 2 x 2 x 32 accumulator fragment (64x256 WGMMA)");
  // Accumulator i = v0 + 2 v1 + 4 v2 is X column r + 8 v1, dY column c + 8 v2 + v0, where (r, c) =
  // coord(0): r = the warp's first row + lane / 4, c = 2 (lane % 4). A warp's X columns: w0 .. w0 + 15
  // of the tile, w0 = r - lane / 4.
  const int w0 = get<0>(coord(0)) - (lane >> 2);
  const int first_x = tile.x0 + (w0 & ~63);  // the warp group's first X column
  // Lane l addresses row l % 8 of matrix l / 8 of the four an instruction stores: (X half 0, dY
  // group g), (half 1, g), (half 0, g + 1), (half 1, g + 1).
  const int m = lane >> 3, j = lane & 7;
  const int x8 = ((w0 & 63) >> 3) + (m & 1);  // the matrix's 8 X columns, in 8s within the group's 64
#pragma unroll
  for (int part = 0; part < kBY / kStagedRows; ++part) {
#pragma unroll
    for (int gp = 0; gp < kStagedRows / 16; ++gp) {
      const int g = part * (kStagedRows / 8) + 2 * gp;
      const int y8 = 2 * gp + (m >> 1);  // the matrix's 8 dY columns, in 8s within the part's 64
      // [M, N]: row = dY column, chunk = 8 X columns; [N, M]: row = X column, chunk = 8 dY columns.
      const int row = kXMajor ? 8 * x8 + j : 8 * y8 + j;
      const int chunk = kXMajor ? y8 : x8;
      const uint32_t at = buf + row * 128 + ((chunk ^ (row & 7)) << 4);
      if constexpr (kFp32) {
#pragma unroll
        for (int plane = 0; plane < 2; ++plane) {
          const bool high = plane == 0;
          stmatrix_x4<!kXMajor>(at + plane * kStagingBytes, half_pair(acc(4 * g), acc(4 * g + 1), high),
                                half_pair(acc(4 * g + 2), acc(4 * g + 3), high),
                                half_pair(acc(4 * g + 4), acc(4 * g + 5), high),
                                half_pair(acc(4 * g + 6), acc(4 * g + 7), high));
        }
      } else {
        stmatrix_x4<!kXMajor>(at, pack_bf16x2(acc(4 * g), acc(4 * g + 1)), pack_bf16x2(acc(4 * g + 2), acc(4 * g + 3)),
                              pack_bf16x2(acc(4 * g + 4), acc(4 * g + 5)), pack_bf16x2(acc(4 * g + 6), acc(4 * g + 7)));
      }
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads / 2, kStagingBarrierBase + group);
#pragma unroll
    for (int it = 0; it < kStagedRows * 8 / (kConsumerThreads / 2); ++it) {
      const int idx = it * (kConsumerThreads / 2) + gtid, row = idx >> 3, cq = idx & 7;
      if constexpr (kFp32) {
        // Lane cq of a row takes values 4 cq .. 4 cq + 3 and 32 + 4 cq .. 32 + 4 cq + 3 of the row's 64,
        // so that each store instruction covers 128 contiguous bytes of the row.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int c8 = 4 * half + (cq >> 1), e0 = 8 * c8 + 4 * (cq & 1);  // staged chunk, first value
          const uint32_t from = buf + row * 128 + ((c8 ^ (row & 7)) << 4) + 8 * (cq & 1);
          const int b = tile.y0 + part * kStagedRows + (kXMajor ? e0 : row);
          const int a = first_x + (kXMajor ? row : e0);
          if (b >= p.M || a >= p.N) continue;
          const uint2 hi = ld_shared_8(from), lo = ld_shared_8(from + kStagingBytes);
          float4 v = make_float4(__uint_as_float(__byte_perm(lo.x, hi.x, 0x5410)),
                                 __uint_as_float(__byte_perm(lo.x, hi.x, 0x7632)),
                                 __uint_as_float(__byte_perm(lo.y, hi.y, 0x5410)),
                                 __uint_as_float(__byte_perm(lo.y, hi.y, 0x7632)));
          const int64_t at = kXMajor ? static_cast<int64_t>(a) * p.M + b : static_cast<int64_t>(b) * p.N + a;
          float4* q = reinterpret_cast<float4*>(reinterpret_cast<float*>(dw) + at);
          if (p.accumulate)
            kernels::add_to_main_grad(reinterpret_cast<float*>(q), v);  // in L2: no load to wait for
          else
            *q = v;
        }
      } else {
        const uint32_t from = buf + row * 128 + ((cq ^ (row & 7)) << 4);
        const int b = tile.y0 + part * kStagedRows + (kXMajor ? 8 * cq : row);
        const int a = first_x + (kXMajor ? row : 8 * cq);
        if (b >= p.M || a >= p.N) continue;
        const int64_t at = kXMajor ? static_cast<int64_t>(a) * p.M + b : static_cast<int64_t>(b) * p.N + a;
        *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(dw) + at) = ld_shared_16(from);
      }
    }
    cutlass::arch::NamedBarrier::sync(kConsumerThreads / 2, kStagingBarrierBase + group);  // the buffer is free again
  }
}

__device__ void consume(SharedStorage& s, const Params& p, int rank) {
  const int ctid = threadIdx.x - kProducerThreads;
  const int lane = threadIdx.x & 31;
  TiledMma mma;
  mma.accumulate_ = GMMA::ScaleOut::One;
  Tensor sX = make_tensor(make_smem_ptr(s.x), SmemLayoutX{});
  Tensor sY = make_tensor(make_smem_ptr(s.y), SmemLayoutY{});
  auto thr = mma.get_thread_slice(ctid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sX));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sY));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBX>, Int<kBY>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBX>, Int<kBY>>{}));
  const int group = ctid / (kConsumerThreads / 2);
  const uint32_t staging = smem_u32(s.staging[group][0]);

  RingPosition<kStages> ring;
  ring.phase = 0;
  const unsigned plan = read_plan(s);
  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  TileQueuePosition<kTileSlots> reader;
  int t = following_tile(s, reader, lane, plan, static_cast<int>(blockIdx.x) / kCluster - clusters, clusters);
  while (t < p.total) {
    const Tile tile = decode_tile(s, p, t, rank, plan);
    const int64_t rows = tile.end - tile.begin;
    const int k_blocks = static_cast<int>((rows + kBK - 1) / kBK);
    clear(acc);  // an empty group's gradient is zero
    consume_k_blocks<kCluster>(
        mma, tCrA, tCrB, acc, s.full, s.empty, ring, k_blocks, lane,
        [&](int stage, int kb) {
          const int valid = static_cast<int>(std::min<int64_t>(rows - int64_t(kb) * kBK, kBK));
          if (valid < kBK) zero_rows_past_group(s, stage, valid, ctid);
        },
        [](int, int) {}, false);  // WGMMA alone reads the stages: one release per warp
    // The next tile's index, read (and its slot released) before this tile's stores are in flight.
    t = following_tile(s, reader, lane, plan, t, clusters);

    if (p.accumulate && k_blocks == 0) continue;  // main_grad keeps its value
    char* dw = p.dw_table != nullptr ? static_cast<char*>(p.dw_table[tile.e]) : p.dw_base + tile.e * p.dw_stride;
    // The staged stores need a 16-byte aligned dW_e (M and N are multiples of 8); a caller's table may
    // hold any address, so the element-wise form stays for the others.
    if ((reinterpret_cast<uintptr_t>(dw) & 15u) == 0) {
      const int gtid = ctid % (kConsumerThreads / 2);
      if (p.fp32 && p.x_major)
        store_tile_staged<true, true>(p, tile, dw, acc, coord, staging, group, gtid, lane);
      else if (p.fp32)
        store_tile_staged<false, true>(p, tile, dw, acc, coord, staging, group, gtid, lane);
      else if (p.x_major)
        store_tile_staged<true, false>(p, tile, dw, acc, coord, staging, group, gtid, lane);
      else
        store_tile_staged<false, false>(p, tile, dw, acc, coord, staging, group, gtid, lane);
    } else {
      store_tile_elementwise(p, tile, dw, acc, coord);
    }
  }
}

// SharedStorage::plan, and with the queue SharedStorage::order: the experts by their k blocks, most
// first (ties: lower expert first), so that the queue hands out the longest tiles while there are
// short ones left to even out the end. Every CTA computes the same from the group sizes (kAuto:
// wgrad_schedule.h's estimate, a thread per cluster); the epilogue's staging buffers, not in use
// yet, hold each expert's k blocks meanwhile.
__device__ void plan_schedule(SharedStorage& s, const Params& p) {
  if (p.E > kOrderedExperts) {  // no room to estimate or to order: the queue, experts in their own order
    if (threadIdx.x == 0) s.plan = p.schedule == WgradSchedule::kStride ? 0u : kPlanQueue;
    return;  // the kernel's cluster sync publishes the plan
  }
  static_assert(sizeof(s.staging) >= kOrderedExperts * sizeof(int), "the staging buffers hold the k blocks");
  int* k_blocks = reinterpret_cast<int*>(s.staging);
  if (threadIdx.x == 0) s.stride_makespan = 0;
  for (int e = threadIdx.x; e < p.E; e += kThreads) {
    int64_t begin, end;
    kernels::group_rows(p.offsets, e, p.R, &begin, &end);
    k_blocks[e] = static_cast<int>((end - begin + kBK - 1) / kBK);
  }
  __syncthreads();
  const int clusters = static_cast<int>(gridDim.x) / kCluster;
  const int per_expert = p.y_tiles * p.x_pairs;
  if (p.schedule == WgradSchedule::kAuto) {
    for (int c = threadIdx.x; c < clusters; c += kThreads)
      atomicMax(&s.stride_makespan, static_cast<unsigned long long>(stride_work(k_blocks, p.E, per_expert, clusters, c)));
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const bool queue = p.schedule == WgradSchedule::kQueue ||
                       (p.schedule == WgradSchedule::kAuto &&
                        queue_pays(s.stride_makespan, k_blocks, p.E, per_expert, clusters));
    s.plan = queue ? kPlanQueue | kPlanOrdered : 0u;
  }
  __syncthreads();
  if (!(s.plan & kPlanOrdered)) return;
  for (int e = threadIdx.x; e < p.E; e += kThreads) {
    const int mine = k_blocks[e];
    int rank = 0;
    for (int f = 0; f < p.E; ++f) {
      const int other = k_blocks[f];
      rank += other > mine || (other == mine && f < e);
    }
    s.order[rank] = static_cast<uint16_t>(e);
  }
}

__global__ void __launch_bounds__(kThreads, 1) wgrad_gathered_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the address bits: the tiles must start 1024-byte aligned.
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(align_smem_1024(smem_raw));
  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  plan_schedule(s, p);
  if (threadIdx.x == 64) init_tile_queue<kTileSlots, kCluster>(s.queue, kTileReaders);
  if (threadIdx.x == 32) {
    // full: every producer thread's cp.async arrival + the TMA issuer's expect-tx arrival;
    // empty: every consumer warp of both CTAs of the cluster.
    init_stage_barriers<kStages>(s.full, s.empty, kProducerThreads + 1,
                                 kCluster * stage_releases(kConsumerThreads, false));
  }
  if (threadIdx.x == 0) cute::prefetch_tma_descriptor(&p.dy_map);
  // The peer's barriers must be initialized before anything arrives on them (and the plan and the
  // order are complete, their scratch space free).
  cute::cluster_sync();
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    produce(s, p, rank);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume(s, p, rank);
  }
  // No CTA may leave while its peer can still multicast into it or arrive on its barriers.
  cute::cluster_sync();
}

constexpr size_t kSmemBytes = 1024 + sizeof(SharedStorage);
static_assert(kSmemBytes <= 227 * 1024, "the staging buffers fit beside the four stages (H100 / H200 opt-in limit)");

// dY [R, M] as a TMA tensor: 64-column x 64-row boxes, 128-byte swizzle (the MN-major layout the
// WGMMA reads), zeros past the last row and column.
CUtensorMap dy_map(const void* base, int64_t R, int M) {
  const uint64_t dims[2] = {static_cast<uint64_t>(M), static_cast<uint64_t>(R)};
  const uint64_t strides[1] = {static_cast<uint64_t>(M) * 2};
  const uint32_t box[2] = {kBoxCols, kBK};
  return bf16_tensor_map(base, 2, dims, strides, box, "gathered wgrad");
}

}  // namespace

const char* wgrad_gathered_unsupported(int experts, int64_t M, int64_t N) {
  if (experts < 1) return "the gathered weight gradient needs at least one expert";
  if (M < 8 || M % 8 != 0 || N < 8 || N % 8 != 0) return "the gathered weight gradient needs M and N multiples of 8";
  if (M >= (int64_t(1) << 30) || N >= (int64_t(1) << 30)) return "the gathered weight gradient needs M, N < 2^30";
  const int64_t tiles = int64_t(experts) * ((M + kBY - 1) / kBY) * ((N + kCluster * kBX - 1) / (kCluster * kBX));
  // The queue draws up to tiles + clusters - 1 indices (a cluster per two SMs).
  if (tiles >= (int64_t(1) << 30)) return "the gathered weight gradient needs fewer than 2^30 output tiles";
  return "";
}

void launch_wgrad_gathered(const WgradGatheredArgs& a, cudaStream_t stream) {
  const char* why = wgrad_gathered_unsupported(a.experts, a.M, a.N);
  MOE_CHECK(why[0] == '\0', "gathered wgrad: ", why);
  MOE_CHECK(!a.accumulate || a.dw_fp32, "gathered wgrad: accumulation needs an fp32 gradient");
  MOE_CHECK(a.R < (int64_t(1) << 31), "gathered wgrad: needs fewer than 2^31 rows");
  Params p;
  // A zero-row tensor map cannot be encoded; with no rows no TMA is issued (every group is empty).
  if (a.R > 0) {
    p.dy_map = dy_map(a.dy, a.R, a.M);
  } else {
    std::memset(&p.dy_map, 0, sizeof p.dy_map);
  }
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.row_slots = a.row_slots;
  p.by_slots = cutlass::FastDivmod(std::max(a.slots, 1));
  p.offsets = a.group_offsets;
  p.E = a.experts;
  p.R = a.R;
  p.M = a.M;
  p.N = a.N;
  p.y_tiles = (a.M + kBY - 1) / kBY;
  p.x_pairs = (a.N + kCluster * kBX - 1) / (kCluster * kBX);
  p.total = a.experts * p.y_tiles * p.x_pairs;
  MOE_CHECK(a.tile_counter != nullptr, "gathered wgrad: argument 'tile_counter' is required (a zeroed int)");
  p.tile_counter = a.tile_counter;
  p.schedule = a.schedule;
  p.dw_base = static_cast<char*>(a.dw_base);
  p.dw_stride = a.dw_stride_bytes;
  p.dw_table = a.dw_table;
  p.fp32 = a.dw_fp32;
  p.accumulate = a.accumulate;
  p.x_major = a.x_major;
  int sms = a.sm_count;
  if (sms <= 0) {
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  }
  const int clusters = std::max(1, std::min(p.total, sms / kCluster));
  launch_clustered(wgrad_gathered_kernel, p, clusters * kCluster, kThreads, kCluster, kSmemBytes, kSmemBytes, stream);
}

}  // namespace moe::fused
