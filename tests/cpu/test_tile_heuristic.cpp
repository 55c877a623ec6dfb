// The grouped GEMM's tile heuristic (src/gemm/tile_heuristic.cpp) against the kernel registry, on the
// host: for both products of every named shape, each op's choice names a configuration compiled for
// that op and those dtypes, and asks for runs of tiles only where the configuration takes them. A
// rule that names a configuration no longer compiled fails here, without a GPU; gpu_test_grouped_gemm
// runs every compiled configuration. Also on the host: configurations forced from the environment
// (MOE_ENGINE_GEMM_CONFIGS) and the sizes the rows GEMM configurations take.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fused/rows_gemm.h"
#include "gemm/forced_configs.h"
#include "gemm/grouped_kernel.h"
#include "gemm/tile_heuristic.h"
#include "moe/error.h"
#include "support/bench_util.h"

namespace moe::gemm {
namespace {

void expect_compiled(Op op, DType ab, DType out, bool accumulate, const TileChoice& c, const std::string& what) {
  const KernelEntry* k = find_kernel(op, ab, out, accumulate, c.name);
  ASSERT_NE(k, nullptr) << what << ": '" << c.name << "' is not compiled for these operands and output";
  EXPECT_GE(c.tile_run, 1) << what;
  if (c.tile_run > 1) EXPECT_TRUE(k->tile_runs) << what << ": '" << c.name << "' takes no runs of tiles";
}

TEST(TileHeuristic, EveryNamedShapeProductHasACompiledChoice) {
  for (const bench::Shape& s : bench::named_shapes()) {
    // fc1 (gated): N = 2F outputs from K = H; fc2: N = H from K = F.
    for (auto [N, K] : {std::pair<int64_t, int64_t>{2 * s.F, s.H}, {s.H, s.F}}) {
      const std::string what = std::string(s.name) + " N=" + std::to_string(N) + " K=" + std::to_string(K);
      expect_compiled(Op::kFprop, DType::kBF16, DType::kBF16, false, choose_tiles(Op::kFprop, N, K), what + " fprop");
      expect_compiled(Op::kDgrad, DType::kBF16, DType::kBF16, false, choose_tiles(Op::kDgrad, N, K), what + " dgrad");
      expect_compiled(Op::kWgrad, DType::kBF16, DType::kBF16, false, choose_tiles(Op::kWgrad, N, K), what + " wgrad");
      expect_compiled(Op::kWgrad, DType::kBF16, DType::kFP32, false, choose_tiles(Op::kWgrad, N, K),
                      what + " wgrad fp32");
      expect_compiled(Op::kWgrad, DType::kBF16, DType::kFP32, true, choose_tiles(Op::kWgrad, N, K, true),
                      what + " wgrad into main_grad");
      // FP8: one fprop-form kernel serves fprop and dgrad (grouped_kernel.h).
      for (bool restated : {false, true}) {
        const std::string how = restated ? " (restated weight scales)" : "";
        expect_compiled(Op::kFprop, DType::kFP8E4M3, DType::kBF16, false, choose_fp8_tiles(Op::kFprop, N, K, restated),
                        what + " fp8 fprop" + how);
        expect_compiled(Op::kWgrad, DType::kFP8E4M3, DType::kBF16, false, choose_fp8_tiles(Op::kWgrad, N, K, restated),
                        what + " fp8 wgrad" + how);
        expect_compiled(Op::kWgrad, DType::kFP8E4M3, DType::kFP32, true,
                        choose_fp8_tiles(Op::kWgrad, N, K, restated, true), what + " fp8 wgrad into main_grad" + how);
        // Only a configuration the engine can feed: 64-row weight scales only where restated.
        const KernelEntry* k = find_kernel(Op::kFprop, DType::kFP8E4M3, DType::kBF16, false,
                                           choose_fp8_tiles(Op::kFprop, N, K, restated).name);
        if (k != nullptr && !restated) EXPECT_NE(k->weight_scale_rows, 64) << what;
      }
    }
  }
}

TEST(TileHeuristic, WeightGradientsIntoMainGradTakeTheWarpGroupStores) {
  // Added into an fp32 main_grad: the warp-group store epilogue (vector reductions, no load of C);
  // written: CUTLASS's TMA epilogue.
  for (auto [N, K] : {std::pair<int64_t, int64_t>{28672, 4096}, {4096, 14336}, {512, 7168}}) {
    const auto ends_with_stores = [](const char* name) {
      const std::string s(name);
      return s.size() > 9 && s.compare(s.size() - 9, 9, "_wgstores") == 0;
    };
    EXPECT_TRUE(ends_with_stores(choose_tiles(Op::kWgrad, N, K, true).name)) << N << "x" << K;
    EXPECT_FALSE(ends_with_stores(choose_tiles(Op::kWgrad, N, K, false).name)) << N << "x" << K;
    for (bool restated : {false, true}) {
      EXPECT_TRUE(ends_with_stores(choose_fp8_tiles(Op::kWgrad, N, K, restated, true).name)) << N << "x" << K;
      EXPECT_FALSE(ends_with_stores(choose_fp8_tiles(Op::kWgrad, N, K, restated, false).name)) << N << "x" << K;
    }
  }
}

// The dgrad rule measured on the fine-grained shapes (docs/gemm.md): ping-pong 128x192 for reductions
// up to 2048 into outputs at least 768 wide, with the 1x2 cluster where 192-wide tile pairs fill an
// output at most 2048 wide; the cooperative tile for narrow outputs and long reductions.
TEST(TileHeuristic, DgradTilesFollowTheMeasuredRule) {
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 512, 1536).name, "pong_128x192x64_c1x2");   // sonic-7b-fine fc1
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 1536, 2048).name, "pong_128x192x64_c2x1");  // qwen3-30b-a3b-ep8 fc1
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 1024, 4096).name, "pong_128x192x64_c2x1");  // sonic-30b-fine fc1
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 2048, 4096).name, "pong_128x192x64_c2x1");  // sonic-30b-coarse fc1
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 2048, 1536).name, "pong_128x192x64_c1x2");  // sonic-7b-coarse fc1
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 2048, 768).name, "pong_128x192x64_c1x2");   // qwen3-30b-a3b-ep8 fc2
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 1536, 256).name, "coop_128x256x64_c2x1");   // sonic-7b-fine fc2
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 4096, 512).name, "coop_128x256x64_c1x2");   // sonic-30b-fine fc2
  EXPECT_STREQ(choose_tiles(Op::kDgrad, 4096, 7168).name, "coop_128x256x64_c1x2");  // deepseek-v3-ep32 fc1
  // The ping-pong tiles walk each expert along N, one tile per visit.
  for (auto [N, K] : {std::pair<int64_t, int64_t>{512, 1536}, {1536, 2048}, {2048, 768}}) {
    EXPECT_TRUE(choose_tiles(Op::kDgrad, N, K).raster_along_n) << N << " " << K;
    EXPECT_EQ(choose_tiles(Op::kDgrad, N, K).tile_run, 1) << N << " " << K;
  }
}

// Short-reduction fprop (K <= 2048): ping-pong 128x192, with the 1x2 cluster where the output is an
// even number of 192-wide tiles and at most 2048 wide, the 2x1 cluster otherwise; runs of four tiles
// for reductions up to 512; the rows GEMM's ping-pong 128x192 at K <= 256. Longer reductions: the
// cooperative 128x256 tile.
TEST(TileHeuristic, ShortReductionFpropTilesPairWholeClusters) {
  const auto expect = [](int64_t N, int64_t K, const char* name, int run) {
    const TileChoice c = choose_tiles(Op::kFprop, N, K);
    EXPECT_STREQ(c.name, name) << N << " " << K;
    EXPECT_EQ(c.tile_run, run) << N << " " << K;
    EXPECT_TRUE(c.raster_along_n) << N << " " << K;
  };
  expect(1536, 1024, "pong_128x192x64_c1x2", 1);  // sonic-7b-coarse fc2
  // K <= 256 (sonic-7b-fine fc2): the rows GEMM's ping-pong 128x192; a call it cannot take (per-expert
  // weight tables) gets the CUTLASS ping-pong 128x192 with runs of four tiles.
  EXPECT_STREQ(choose_tiles(Op::kFprop, 1536, 256).name, "rows_pong_128x192x64_c2x1");
  EXPECT_STREQ(choose_tiles(Op::kFprop, 64, 8).name, "rows_pong_128x192x64_c2x1");
  const TileChoice cutlass = choose_tiles(Op::kFprop, 1536, 256, false, /*rows_ok=*/false);
  EXPECT_STREQ(cutlass.name, "pong_128x192x64_c1x2");
  EXPECT_EQ(cutlass.tile_run, 4);
  EXPECT_TRUE(cutlass.raster_along_n);
  expect(4096, 512, "pong_128x192x64_c2x1", 4);   // sonic-30b-fine fc2 (22 tiles, but 4096 wide)
  expect(4096, 1024, "pong_128x192x64_c2x1", 1);  // sonic-30b-coarse fc2
  expect(4096, 2048, "pong_128x192x64_c2x1", 1);  // sonic-120b-coarse fc2
  expect(7168, 2048, "pong_128x192x64_c2x1", 1);  // deepseek-v3-ep32 fc2
  expect(2048, 768, "pong_128x192x64_c2x1", 1);   // qwen3-30b-a3b-ep8 fc2 (11 tiles)
  expect(2048, 1024, "pong_128x192x64_c2x1", 1);  // olmoe-1b-7b fc2
  EXPECT_STREQ(choose_tiles(Op::kFprop, 4096, 14336).name, "coop_128x256x64_c1x2");  // mixtral-8x7b fc2
  EXPECT_STREQ(choose_tiles(Op::kFprop, 4096, 4096).name, "coop_128x256x64_c1x2");   // sonic-120b-coarse fc1
}

// MOE_ENGINE_GEMM_CONFIGS (gemm/forced_configs.h): items op=name, spaces and empty items ignored,
// and every item that is not one refused with the variable's name.
TEST(ForcedConfigs, ParsesItemsAndNamesTheSourceOnErrors) {
  const std::vector<ForcedConfig> got =
      parse_forced_configs(" fprop=rows_coop_128x256x64_c2x1 ,, dgrad = rows_pong_64x256x64_c2x1,wgrad=x ", "VAR");
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].op, Op::kFprop);
  EXPECT_EQ(got[0].name, "rows_coop_128x256x64_c2x1");
  EXPECT_EQ(got[1].op, Op::kDgrad);
  EXPECT_EQ(got[1].name, "rows_pong_64x256x64_c2x1");
  EXPECT_EQ(got[2].op, Op::kWgrad);
  EXPECT_EQ(got[2].name, "x");
  EXPECT_TRUE(parse_forced_configs("", "VAR").empty());
  // chosen_config's suffixes: the tile order and the run.
  const std::vector<ForcedConfig> suffixed = parse_forced_configs("fprop=pong_128x192x64_c1x2/N/run4,dgrad=a/M", "VAR");
  ASSERT_EQ(suffixed.size(), 2u);
  EXPECT_EQ(suffixed[0].name, "pong_128x192x64_c1x2");
  EXPECT_TRUE(suffixed[0].raster_along_n);
  EXPECT_EQ(suffixed[0].tile_run, 4);
  EXPECT_EQ(suffixed[1].name, "a");
  EXPECT_FALSE(suffixed[1].raster_along_n);
  EXPECT_EQ(suffixed[1].tile_run, 1);
  EXPECT_TRUE(parse_forced_configs(" , ", "VAR").empty());
  for (const char* bad : {"fprop", "fprop=", "bprop=coop_128x256x64_c2x1", "=coop_128x256x64_c2x1", "fprop=/N",
                          "fprop=a/X", "fprop=a/run", "fprop=a/run0", "fprop=a/run4x"}) {
    try {
      parse_forced_configs(bad, "VAR");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("VAR"), std::string::npos) << e.what();
    }
  }
  // The rows GEMM's configurations are compiled for both token-side products (and only those).
  for (Op op : {Op::kFprop, Op::kDgrad})
    for (const char* name : {"rows_coop_128x256x64_c2x1", "rows_pong_64x256x64_c2x1", "rows_pong_128x192x64_c2x1"}) {
      const KernelEntry* k = find_kernel(op, DType::kBF16, DType::kBF16, false, name);
      ASSERT_NE(k, nullptr) << name;
      EXPECT_TRUE(k->contiguous_rows) << name;
      EXPECT_FALSE(k->tile_runs) << name;
    }
  EXPECT_EQ(find_kernel(Op::kWgrad, DType::kBF16, DType::kBF16, false, "rows_coop_128x256x64_c2x1"), nullptr);
}

// The sizes the rows GEMM takes (GroupedGemm runs the heuristic's CUTLASS kernel for the others):
// each refusal says which bound.
TEST(RowsGemm, SizesItTakesAndWhyNot) {
  EXPECT_EQ(fused::rows_gemm_unsupported(128, 196608, 256, 1536), "");
  EXPECT_EQ(fused::rows_gemm_unsupported(4096, 0, 8, 8), "");
  const auto refused = [](int E, int64_t R, int64_t red, int64_t out, const char* word) {
    const std::string why = fused::rows_gemm_unsupported(E, R, red, out);
    EXPECT_NE(why.find(word), std::string::npos) << E << " " << R << " " << red << " " << out << ": '" << why << "'";
  };
  refused(0, 64, 64, 64, "experts");
  refused(4097, 64, 64, 64, "experts");
  refused(8, 64, 12, 64, "multiples of 8");
  refused(8, 64, 64, 4, "multiples of 8");
  refused(8, 64, int64_t(1) << 30, 64, "2^30");
  refused(8, int64_t(1) << 31, 64, 64, "2^31");
}

}  // namespace
}  // namespace moe::gemm
