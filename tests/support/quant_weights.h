// Quantized expert weights for checkpoint tests, made by the CPU reference quantizer and laid out
// as a checkpoint stores them (moe/checkpoint_quant.h). Header-only: host code, no CUDA.
#pragma once

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moe/checkpoint_quant.h"
#include "moe/float_convert.h"
#include "moe/state_dict.h"
#include "reference/quantize_ref.h"

namespace moe::testing {

// bf16 bits of E matrices [M, K]. Expert e's values are normal(0, 1) times 2^(3e) times a
// magnitude that changes every 16 elements: block scales vary, and so does NVFP4's per-matrix
// global amax from expert to expert (which is what makes a shared amax differ from per-matrix ones).
inline std::vector<uint16_t> expert_matrices(int E, int64_t M, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-6, 6);
  std::vector<uint16_t> x(static_cast<size_t>(E * M * K));
  float m = 1;
  for (int e = 0; e < E; ++e)
    for (int64_t i = 0; i < M * K; ++i) {
      if (i % 16 == 0) m = std::ldexp(1.0f, mag(rng) + 3 * e);
      x[e * M * K + i] = float_to_bf16_bits(nd(rng) * m);
    }
  return x;
}

// The reference's bytes of one part (all B matrices).
inline std::vector<uint8_t> part_bytes(const ref::Quantized& q, QuantPart part) {
  switch (part) {
    case QuantPart::kData: return q.rowwise_data;
    case QuantPart::kScale: return q.rowwise_scale;
    case QuantPart::kColumnwiseData: return q.columnwise_data;
    case QuantPart::kColumnwiseScale: return q.columnwise_scale;
    case QuantPart::kGlobalAmax: {
      std::vector<uint8_t> b(q.global_amax.size() * 4);
      if (!b.empty()) std::memcpy(b.data(), q.global_amax.data(), b.size());
      return b;
    }
  }
  return {};
}

// Adds the parts of q (B matrices [M, K] quantized with c) under `key`: B tensors' worth stacked
// as [B, ...] when `grouped`, else q must hold one matrix and gets the per-matrix shapes.
inline void add_quantized(StateDict& sd, const std::string& key, const QuantConfig& c, const ref::Quantized& q,
                          int64_t B, int64_t M, int64_t K, bool grouped) {
  ASSERT_TRUE(grouped || B == 1);
  for (QuantPart part : kQuantParts) {
    if (!quant_stores(c, part)) continue;
    QuantPartLayout l = quant_part_layout(c, part, M, K);
    if (grouped) l.shape.insert(l.shape.begin(), B);
    HostTensor t(l.dtype, l.shape);
    const std::vector<uint8_t> bytes = part_bytes(q, part);
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), t.nbytes()) << quant_part_key(key, part);
    if (!bytes.empty()) std::memcpy(t.mutable_data(), bytes.data(), bytes.size());
    sd[quant_part_key(key, part)] = std::move(t);
  }
}

// Grouped: x quantized as one batch of E under `key`. Per expert: each expert quantized on its own
// under key0, key1, ...
inline void add_grouped(StateDict& sd, const std::string& key, const QuantConfig& c, const std::vector<uint16_t>& x,
                        int E, int64_t M, int64_t K) {
  add_quantized(sd, key, c, ref::quantize(c, x, E, M, K), E, M, K, true);
}
inline void add_per_expert(StateDict& sd, const std::string& key, const QuantConfig& c,
                           const std::vector<uint16_t>& x, int E, int64_t M, int64_t K) {
  for (int e = 0; e < E; ++e) {
    const std::vector<uint16_t> one(x.begin() + e * M * K, x.begin() + (e + 1) * M * K);
    add_quantized(sd, key + std::to_string(e), c, ref::quantize(c, one, 1, M, K), 1, M, K, false);
  }
}

// A quantized expert layer under `prefix`, grouped: fc1 [E, 2F, H] from x1 and fc2 [E, H, F] from x2,
// both in format c, their formats declared in `meta`.
inline void add_grouped_layer(StateDict& sd, Metadata& meta, const std::string& prefix, const QuantConfig& c,
                              const std::vector<uint16_t>& x1, const std::vector<uint16_t>& x2, int E, int64_t H,
                              int64_t F) {
  add_grouped(sd, prefix + "fc1.weight", c, x1, E, 2 * F, H);
  add_grouped(sd, prefix + "fc2.weight", c, x2, E, H, F);
  set_quant_metadata(meta, prefix + "fc1.weight", c);
  set_quant_metadata(meta, prefix + "fc2.weight", c);
}

// Dequantized tensors (convert's dequantize): every value of t, of dtype dt (fp32, or bf16: `want`
// rounded once), equals want's (NaN where want is NaN).
inline void expect_values(const HostTensor& t, DType dt, const std::vector<float>& want, const std::string& key) {
  ASSERT_EQ(t.dtype(), dt) << key;
  ASSERT_EQ(t.numel(), static_cast<int64_t>(want.size())) << key;
  size_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const float got = dt == DType::kFP32 ? reinterpret_cast<const float*>(t.data())[i]
                                         : bf16_bits_to_float(reinterpret_cast<const uint16_t*>(t.data())[i]);
    const float w = dt == DType::kFP32 ? want[i] : round_to_bf16(want[i]);
    bad += !(got == w || (std::isnan(got) && std::isnan(w)));
  }
  EXPECT_EQ(bad, 0u) << key;
}

// Nothing quantized left in the Hugging Face form: no F8_E4M3 tensor, no "_scale_inv" key.
inline void expect_no_fp8_left(const StateDict& sd) {
  for (const auto& [k, t] : sd) {
    EXPECT_NE(t.dtype(), DType::kFP8E4M3) << k;
    EXPECT_EQ(k.find("_scale_inv"), std::string::npos) << k;
  }
}

}  // namespace moe::testing
