#include "gemm/tile_heuristic.h"

namespace moe::gemm {

// Every rule is a measurement on the named benchmark shapes (interleaved timing, docs/gemm.md; the
// H100 where the H100 and the H200 disagree):
//  - short reductions (K <= 2048): the epilogue no longer hides behind a short main loop, and
//    ping-pong (one warp group's epilogue overlapping the other's main loop) beats the cooperative
//    128x256 tile (on K = 2048 too: the fc2 of deepseek-v3-ep32, 7168 wide, 1.10x; of
//    sonic-120b-coarse 1.03-1.08x); its 128x192 tile beats 128x128 (1.5x fewer tiles, so fewer
//    per-tile costs: the group change, the pipeline fill, the epilogue drain), forward 1.01-1.03x
//    on the fine-grained shapes; the 1x2 cluster only where whole pairs of 192-wide tiles fill N
//    (the fc2 of qwen3-30b-a3b-ep8, 11 tiles wide, is 0.92x with it) and N is at most 2048 (see
//    pong_192); its epilogue converts the accumulator without CUTLASS's alpha multiply
//    (epilogue_plain_conversion.cuh: 1.10x on sonic-7b-fine's fc2, K = 256, where the epilogue is
//    longer than the main loop it should hide behind);
//  - long reductions: cooperative 128x256; the 1x2 cluster (token tile multicast to two N tiles)
//    beats 2x1 when the output width fills whole cluster pairs of 256-wide tiles, otherwise half a
//    cluster idles and 2x1 is used;
//  - fprop of the shortest reductions (K <= 256: sonic-7b-fine's fc2): the rows GEMM's ping-pong
//    128x192 (our own kernel: no TMA descriptor swap at the group change that four k blocks cannot
//    hide), 475 against 425 TFLOP/s for the CUTLASS 128x192 ping-pong with runs of 4 (H100,
//    2026-12-05, bench_grouped_gemm --all-configs, interleaved); at K >= 512 the two are within a few
//    percent either way on the named shapes (0.92-1.03x), so the CUTLASS rules below stay;
//  - runs of 4 consecutive cluster tiles per visit for reductions of at most 512 (fprop and dgrad):
//    a four-k-block main loop cannot hide the group change (TMA descriptor swap) that the
//    round-robin order makes at nearly every tile of fine-grained experts (sonic-7b-fine fc2:
//    1.09x on top of the 64x64 epilogue subtile); longer reductions lose L2 reuse with runs
//    (sonic-7b-fine fc1, K = 1536: 0.83x, L2 hit rate 68% -> 47%), so they keep run 1;
//  - dgrad of short reductions (N <= 2048) into outputs at least 768 wide: ping-pong 128x192 as
//    SonicMoE's dx (fc1 dgrad 1.06-1.14x on the four fine-grained shapes, qwen3-30b-a3b-ep8's fc2
//    dgrad 1.11x, olmoe-1b-7b's fc2 level); the 1x2 cluster where 192-wide tile pairs fill the
//    output (sonic-7b-fine 1.03x over 2x1); narrower outputs keep the cooperative tile (sonic-7b-fine
//    fc2 dgrad 0.86x, sonic-30b-fine 0.85x with 128x192);
//  - wgrad: the scheduler walks each expert's tiles along N when the output is taller than wide
//    (measured 1.0-1.05x on bf16 and up to 1.38x on the fp32 main_grad of mixtral fc1; along M
//    is better the other way round); added into a main_grad, each consumer warp group stores its
//    own rows by vector reductions (warp_group_store_epilogue.cuh): 1.02-1.10x over CUTLASS's
//    epilogue, which loads C through a producer warp (mixtral-8x7b, deepseek-v3-ep32,
//    sonic-120b-coarse); written, CUTLASS's TMA epilogue stays (the warp-group stores were 1-4%
//    faster in bf16 with no gain in the layer's step, and cost the FP8 layer's backward 0.5-3%).
namespace {
// The ping-pong 128x192 tile across an output width: the 1x2 cluster where the 192-wide tiles are
// even in number and the output at most 2048 wide, the 2x1 cluster otherwise. An odd count would
// idle half of the last cluster; on wider outputs the 1x2 cluster loses on the H100 (4096 wide, the
// fc1 dgrad of sonic-30b-coarse: 436 against 660 TFLOP/s, sonic-30b-fine's 511 against 642, their
// fc2 fprops 1.03-1.12x with 2x1; at 1536 wide 1x2 is still 1.03-1.06x ahead).
const char* pong_192(int64_t width) {
  const bool pairs_fill = (width + 191) / 192 % 2 == 0;
  return pairs_fill && width <= 2048 ? "pong_128x192x64_c1x2" : "pong_128x192x64_c2x1";
}
}  // namespace

TileChoice choose_tiles(Op op, int64_t N, int64_t K, bool accumulate, bool rows_ok) {
  switch (op) {
    case Op::kFprop: {  // Y [m, N], reduction K
      if (rows_ok && K <= 256) return {"rows_pong_128x192x64_c2x1", false, 1};
      const bool short_k = K <= 2048;
      if (short_k && N % 256 == 0)
        return {pong_192(N), true, K <= 512 ? 4 : 1};
      return {N % 512 == 0 ? "coop_128x256x64_c1x2" : "coop_128x256x64_c2x1", false};
    }
    case Op::kDgrad:  // dX [m, K], reduction N
      if (N <= 2048 && K >= 768)
        return {pong_192(K), true, 1};
      if (N <= 768) return {"pong_128x128x64_c2x1", true, N <= 512 ? 4 : 1};
      return {K % 512 == 0 ? "coop_128x256x64_c1x2" : "coop_128x256x64_c2x1", false};
    case Op::kWgrad:  // dW [N, K], reduction over the tokens of an expert
      return {accumulate ? "coop_128x256x64_c2x1_wgstores" : "coop_128x256x64_c2x1", N > K};
  }
  return {"coop_128x256x64_c2x1", false};
}

// FP8 (measured on deepseek-v3-ep32 and mixtral-8x7b, docs/gemm.md): cooperative 128x128x128 beats
// ping-pong 64x128x128 by 1.3-1.5x in both forms (ping-pong was dropped). The fprop form walks each
// expert along N when its output is at most 4096 wide (1.03-1.07x), along M for wider outputs
// (along N costs up to 9% there); wgrad follows the bf16 rule. Where the engine can restate the
// weight scales, the fprop form takes DeepGEMM's 128x192 tile with the 2x1 cluster: 7-13% faster on
// seven of the twelve deepseek / mixtral / 120b fprop and dgrad products, 1-6% slower on three, with
// no rule on (N, K) that separates them (docs/gemm.md). Weight gradients added into a main_grad
// take the warp-group stores, as in bf16 (1.07-1.12x at 2048 tokens per expert, 0.95-0.98x at 8192).
TileChoice choose_fp8_tiles(Op op, int64_t N, int64_t K, bool restated_scales, bool accumulate) {
  if (op == Op::kWgrad) return {accumulate ? "fp8_coop_128x128x128_c2x1_wgstores" : "fp8_coop_128x128x128_c2x1", N > K};
  if (restated_scales) return {"fp8_coop_128x192x128_c2x1", N <= 4096};
  return {"fp8_coop_128x128x128_c1x2", N <= 4096};
}

}  // namespace moe::gemm
