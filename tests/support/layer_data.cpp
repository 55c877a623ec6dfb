#include "support/layer_data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe/float_convert.h"

namespace moe::testing::layer_data {

std::vector<double> random_bf16_values(size_t n, double scale, std::mt19937_64& rng) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = round_to_bf16(static_cast<float>(nd(rng)));
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<double>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16_bits(static_cast<float>(v[i]));
  return b;
}
std::vector<double> from_bf16(const std::vector<uint16_t>& b) {
  std::vector<double> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_bits_to_float(b[i]);
  return v;
}
std::vector<double> grad_to_double(const DeviceBuffer<uint8_t>& buf, DType t, size_t n) {
  auto bytes = buf.download();
  std::vector<double> v(n);
  if (t == DType::kBF16) {
    const auto* p = reinterpret_cast<const uint16_t*>(bytes.data());
    for (size_t i = 0; i < n; ++i) v[i] = bf16_bits_to_float(p[i]);
  } else {
    const auto* p = reinterpret_cast<const float*>(bytes.data());
    for (size_t i = 0; i < n; ++i) v[i] = p[i];
  }
  return v;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double num = 0, den = 0, maxerr = 0, maxref = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "]";
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
    maxerr = std::max(maxerr, std::abs(got[i] - want[i]));
    maxref = std::max(maxref, std::abs(want[i]));
  }
  if (den == 0) {
    EXPECT_EQ(maxerr, 0.0) << what << ": reference is zero";
    return;
  }
  EXPECT_LE(std::sqrt(num / den), 1e-2) << what;
  EXPECT_LE(maxerr, 5e-2 * maxref) << what;
}

DeviceParam make_param(const std::vector<double>& host, int E, std::vector<int64_t> shape, DType t,
                       WeightLayout layout) {
  DeviceParam p;
  p.host = host;
  int64_t per = 1;
  for (auto s : shape) per *= s;
  const int esize = dtype_bits(t) / 8;
  auto encode = [&](size_t begin, size_t n) {
    std::vector<uint8_t> bytes(n * esize);
    for (size_t i = 0; i < n; ++i) {
      if (t == DType::kBF16) {
        uint16_t b = float_to_bf16_bits(static_cast<float>(host[begin + i]));
        std::memcpy(&bytes[i * 2], &b, 2);
      } else {
        float f = static_cast<float>(host[begin + i]);
        std::memcpy(&bytes[i * 4], &f, 4);
      }
    }
    return bytes;
  };
  if (layout == WeightLayout::kSingleGrouped) {
    p.bufs.emplace_back(encode(0, host.size()));
    TensorView v;
    v.data = p.bufs[0].get();
    v.dtype = t;
    v.device = Device::kCUDA;
    v.ndim = static_cast<int>(shape.size()) + 1;
    v.shape[0] = E;
    for (size_t d = 0; d < shape.size(); ++d) v.shape[d + 1] = shape[d];
    int64_t st = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.strides[d] = st;
      st *= v.shape[d];
    }
    p.views.push_back(v);
  } else {
    for (int e = 0; e < E; ++e) {
      p.bufs.emplace_back(encode(static_cast<size_t>(e) * per, per));
      TensorView v;
      v.data = p.bufs.back().get();
      v.dtype = t;
      v.device = Device::kCUDA;
      v.ndim = static_cast<int>(shape.size());
      for (size_t d = 0; d < shape.size(); ++d) v.shape[d] = shape[d];
      int64_t st = 1;
      for (int d = v.ndim - 1; d >= 0; --d) {
        v.strides[d] = st;
        st *= v.shape[d];
      }
      p.views.push_back(v);
    }
  }
  return p;
}

std::vector<double> download_param(const DeviceParam& p, DType t) {
  std::vector<double> out;
  for (const auto& b : p.bufs) {
    auto v = grad_to_double(b, t, b.size() / (dtype_bits(t) / 8));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

TensorView expert_slice(const DeviceParam& p, int64_t first_expert, std::vector<int64_t> shape, DType t) {
  int64_t per = 1;
  for (size_t i = 1; i < shape.size(); ++i) per *= shape[i];
  TensorView v;
  v.data = static_cast<char*>(p.views[0].data) + first_expert * per * (dtype_bits(t) / 8);
  v.dtype = t;
  v.device = Device::kCUDA;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    stride *= shape[i];
  }
  return v;
}

}  // namespace moe::testing::layer_data
