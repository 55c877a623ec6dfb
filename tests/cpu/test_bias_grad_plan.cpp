// bias_grad's workspace bound (src/kernels/bias_grad_plan.h): a workspace sized for R rows holds the
// partial sums of every call with fewer rows, although shorter calls take shorter chunks and may
// need more of them.
#include <gtest/gtest.h>

#include <climits>
#include <cstdint>

#include "kernels/bias_grad_plan.h"
#include "moe/bias_ops.h"
#include "moe/error.h"

namespace moe::kernels {
namespace {

TEST(BiasGradPlan, FewerRowsCanTakeMoreChunks) {
  // The reason for the bound: N = 2048 is one column slice; 131072 rows fill 1024 blocks with
  // 128-row chunks, 128 rows fewer take 64-row chunks, twice as many.
  EXPECT_EQ(plan_bias_grad(131072, 0, 2048).chunks, 1024);
  EXPECT_EQ(plan_bias_grad(131072 - 128, 0, 2048).chunks, 2046);
  EXPECT_LE(bias_grad_workspace_bytes(131072 - 128, 0, 2048), bias_grad_workspace_bytes(131072, 0, 2048));
}

TEST(BiasGradPlan, BoundCoversEverySmallerCall) {
  for (int64_t N : {0, 8, 64, 256, 2048, 2056, 4096, 7168, 16384, 65536}) {
    for (int E : {0, 1, 8, 128}) {
      int64_t most = 0;  // the most chunks of any call with r <= R rows
      for (int64_t R = 0; R <= 140000; ++R) {  // past 1024 chunks of 128 rows
        const BiasGradPlan p = plan_bias_grad(R, E, N);
        ASSERT_GE(p.chunk, 16);
        ASSERT_LE(p.chunk, 128);
        ASSERT_EQ(p.chunks, (R + p.chunk - 1) / p.chunk + E);
        most = std::max(most, p.chunks);
        ASSERT_GE(bias_grad_chunk_bound(R, E, N), most) << "R " << R << " E " << E << " N " << N;
        // The bound is not loose by more than the longest chunk's share: at most twice the most
        // chunks any call of up to R rows takes, plus one.
        ASSERT_LE(bias_grad_chunk_bound(R, E, N) - E, 2 * (most - E) + 1) << "R " << R << " N " << N;
      }
    }
  }
}

TEST(BiasGradPlan, WorkspaceBytesGrowWithRows) {
  for (int64_t N : {8, 2048, 7168}) {
    size_t last = 0;
    for (int64_t R = 0; R <= 300000; R += 97) {
      const size_t bytes = bias_grad_workspace_bytes(R, 16, N);
      ASSERT_GE(bytes, last) << "R " << R << " N " << N;
      ASSERT_GE(bytes, bias_grad_chunk_table_bytes(16) +
                           static_cast<size_t>(plan_bias_grad(R, 16, N).chunks) * static_cast<size_t>(N) * 4);
      last = bytes;
    }
  }
}

TEST(BiasGradPlan, WorkspaceBoundsAreCheckedNotWrapped) {
  // At the largest accepted sizes the byte count either fits or is refused; it never wraps.
  EXPECT_GT(bias_grad_workspace_bytes(kBiasGradMaxRows - 1, 0, 8), size_t(1) << 31);
  EXPECT_THROW(bias_grad_workspace_bytes(kBiasGradMaxRows - 1, INT32_MAX - 1, INT32_MAX), Error);
  EXPECT_THROW(bias_grad_workspace_bytes(kBiasGradMaxRows, 0, 8), Error);
  EXPECT_THROW(bias_grad_workspace_bytes(8, 0, int64_t(INT32_MAX) + 1), Error);
  EXPECT_THROW(bias_grad_workspace_bytes(8, INT32_MAX, 8), Error);
  EXPECT_THROW(bias_grad_workspace_bytes(-1, 0, 8), Error);
  EXPECT_EQ(bias_grad_chunk_table_bytes(INT32_MAX - 1), size_t(1) << 33);  // 4 (2^31 - 1) bytes, padded to 16
}

}  // namespace
}  // namespace moe::kernels
