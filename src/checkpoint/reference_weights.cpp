#include "checkpoint/reference_weights.h"

#include "checkpoint/element_io.h"
#include "moe/error.h"

namespace moe {

namespace {

void to_double(DType t, const uint8_t* src, int64_t n, double* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = detail::load_element(t, src, i);
}

std::vector<double*>& table(ref::ExpertParams& p, Param param) {
  switch (param) {
    case Param::kFc1Weight: return p.fc1_weight;
    case Param::kFc1Bias: return p.fc1_bias;
    case Param::kFc2Weight: return p.fc2_weight;
    case Param::kFc2Bias: return p.fc2_bias;
  }
  return p.fc1_weight;
}

}  // namespace

ReferenceWeights to_reference_weights(const ExpertWeights& w) {
  const ExpertWeightsSpec& s = w.spec();
  ReferenceWeights r;
  for (Param p : {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias}) {
    if (!s.has(p)) continue;
    int64_t n = 1;
    for (int64_t d : s.expert_shape(p)) n *= d;
    std::vector<double*>& ptrs = table(r.params, p);
    if (s.layout == WeightLayout::kSingleGrouped) {
      std::vector<double> block(static_cast<size_t>(n * s.experts));
      for (int e = 0; e < s.experts; ++e) to_double(w.dtype(), w.expert_data(p, e), n, block.data() + e * n);
      r.blocks.push_back(std::move(block));
      for (int e = 0; e < s.experts; ++e) ptrs.push_back(r.blocks.back().data() + e * n);
    } else {
      for (int e = 0; e < s.experts; ++e) {
        std::vector<double> block(static_cast<size_t>(n));
        to_double(w.dtype(), w.expert_data(p, e), n, block.data());
        r.blocks.push_back(std::move(block));
        ptrs.push_back(r.blocks.back().data());
      }
    }
  }
  return r;
}

}  // namespace moe
