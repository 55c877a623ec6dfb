#include "layer/expert_weight_quantize.h"

namespace moe {
namespace {

// Matrix e of a contiguous batched view [E, ...] (an empty view stays empty).
TensorView matrix_of(const TensorView& t, int64_t e) {
  if (t.data == nullptr) return t;
  TensorView m = t;
  m.data = static_cast<char*>(t.data) + e * (t.nbytes() / t.shape[0]);
  m.ndim = t.ndim - 1;
  for (int d = 0; d < m.ndim; ++d) {
    m.shape[d] = t.shape[d + 1];
    m.strides[d] = t.strides[d + 1];
  }
  m.shape[m.ndim] = 0;
  m.strides[m.ndim] = 0;
  if (m.ndim == 0) {  // the NVFP4 global amax of one matrix: [1]
    m.ndim = 1;
    m.shape[0] = 1;
    m.strides[0] = 1;
  }
  return m;
}

}  // namespace

void quantize_expert_weight(const QuantConfig& config, const std::vector<TensorView>& source,
                            const QuantizedTensor& grouped, cudaStream_t stream) {
  if (source.size() == 1 && source[0].ndim == 3) {
    quantize(config, source[0], grouped, stream);
    return;
  }
  for (size_t e = 0; e < source.size(); ++e) {
    const int64_t i = static_cast<int64_t>(e);
    QuantizedTensor q;
    q.rowwise_data = matrix_of(grouped.rowwise_data, i);
    q.rowwise_scale = matrix_of(grouped.rowwise_scale, i);
    q.columnwise_data = matrix_of(grouped.columnwise_data, i);
    q.columnwise_scale = matrix_of(grouped.columnwise_scale, i);
    q.global_amax = matrix_of(grouped.global_amax, i);
    quantize(config, source[e], q, stream);
  }
}

}  // namespace moe
