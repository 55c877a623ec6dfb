// The checkpoint conversions' tiled transposes against the element-by-element definition: every
// element size the conversions use (1, 2, 4 bytes; 8 and an odd 3 too), shapes below, at and across
// the tile edge, and the equality check failing on a single changed byte anywhere.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "checkpoint/byte_transpose.h"

namespace moe {
namespace {

TEST(ByteTranspose, MatchesTheDefinitionForEveryShapeAndElementSize) {
  for (size_t el : {1u, 2u, 3u, 4u, 8u})
    for (int64_t rows : {1, 7, 64, 65, 130})
      for (int64_t cols : {1, 63, 64, 129}) {
        SCOPED_TRACE(testing::Message() << el << " bytes, " << rows << " x " << cols);
        std::vector<uint8_t> src(rows * cols * el), dst(src.size()), want(src.size());
        for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + i / 7);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            for (size_t b = 0; b < el; ++b) want[(c * rows + r) * el + b] = src[(r * cols + c) * el + b];
        detail::transpose_bytes(src.data(), dst.data(), rows, cols, el);
        ASSERT_EQ(dst, want);
        EXPECT_TRUE(detail::is_transpose_bytes(src.data(), dst.data(), rows, cols, el));
        for (size_t at : {size_t{0}, dst.size() / 2, dst.size() - 1}) {
          std::vector<uint8_t> off = dst;
          off[at] ^= 0x40;
          EXPECT_FALSE(detail::is_transpose_bytes(src.data(), off.data(), rows, cols, el)) << "byte " << at;
        }
      }
}

}  // namespace
}  // namespace moe
