// Host and device data of expert-layer tests: bf16 random values, parameters in either weight
// layout, and the tolerance check against the fp64 reference (shared by the layer tests).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moe/dtype.h"
#include "moe/grouped_mlp_config.h"
#include "moe/tensor.h"
#include "support/gpu.h"

namespace moe::testing::layer_data {

std::vector<double> random_bf16_values(size_t n, double scale, std::mt19937_64& rng);

// Each expert's [rows, cols] matrix of a host [E, rows, cols] block, transposed: [E, cols, rows]
// (the transposed-weights orientation).
template <class T>
std::vector<T> transpose_experts(const std::vector<T>& v, int E, int64_t rows, int64_t cols) {
  std::vector<T> t(v.size());
  for (int e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) t[(e * cols + c) * rows + r] = v[(e * rows + r) * cols + c];
  return t;
}
std::vector<uint16_t> to_bf16(const std::vector<double>& v);
std::vector<double> from_bf16(const std::vector<uint16_t>& b);
std::vector<double> grad_to_double(const DeviceBuffer<uint8_t>& buf, DType t, size_t n);

// Relative L2 error <= 1e-2 and max error <= 5e-2 * max|ref| (see the layer tests' tolerance note).
void expect_close(const std::vector<double>& got, const std::vector<double>& want, const char* what);

// One parameter held on the device in the layout under test, and its host (fp64) copy.
struct DeviceParam {
  std::vector<double> host;                 // [E, rows...] logical values
  std::vector<DeviceBuffer<uint8_t>> bufs;  // one (grouped) or E (per expert)
  std::vector<TensorView> views;
};

DeviceParam make_param(const std::vector<double>& host, int E, std::vector<int64_t> shape, DType t,
                       WeightLayout layout);
std::vector<double> download_param(const DeviceParam& p, DType t);

// The experts [first_expert, first_expert + shape[0]) of a single-grouped parameter as one view
// (e.g. an expert-parallel rank's slice of the same weights); shape = [experts, rows...].
TensorView expert_slice(const DeviceParam& p, int64_t first_expert, std::vector<int64_t> shape, DType t);

}  // namespace moe::testing::layer_data
