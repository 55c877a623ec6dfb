// Device buffers for the two copies of one quantized matrix [M, K] (FP8 / MXFP8 codes), sized like
// the CPU reference's output and poisoned so that bytes a kernel leaves unwritten show, with the
// views to pass as the kernel's output and a bitwise comparison against the reference.
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "moe/quantize.h"
#include "reference/quantize_ref.h"
#include "support/gpu.h"

namespace moe::testing {

struct QuantizedCopies {
  DeviceBuffer<uint8_t> rd, rs, cd, cs;
  QuantizedTensor q;
  QuantizedCopies(const QuantConfig& c, const ref::Quantized& want, int64_t M, int64_t K)
      : rd(want.rowwise_data.size()), rs(want.rowwise_scale.size()), cd(want.columnwise_data.size()),
        cs(want.columnwise_scale.size()) {
    for (auto* b : {&rd, &rs, &cd, &cs}) b->fill_bytes(0xA5);
    if (c.rowwise) {
      const ScaleShape s = scale_shape(c, M, K);
      q.rowwise_data = TensorView(rd.get(), DType::kFP8E4M3, {M, K});
      q.rowwise_scale = TensorView(rs.get(), s.dtype, {s.rows, s.cols});
    }
    if (c.columnwise) {
      const ScaleShape s = scale_shape(c, K, M, /*columnwise=*/true);
      q.columnwise_data = TensorView(cd.get(), DType::kFP8E4M3, {K, M});
      q.columnwise_scale = TensorView(cs.get(), s.dtype, {s.rows, s.cols});
    }
  }
  void expect_equal(const ref::Quantized& want, const std::string& what) const {
    EXPECT_EQ(rd.download(), want.rowwise_data) << what << " rowwise data";
    EXPECT_EQ(rs.download(), want.rowwise_scale) << what << " rowwise scale";
    EXPECT_EQ(cd.download(), want.columnwise_data) << what << " columnwise data";
    EXPECT_EQ(cs.download(), want.columnwise_scale) << what << " columnwise scale";
  }
};

}  // namespace moe::testing
