// Expert weights on the host, in our layout, loaded from and saved to state dicts
// (docs/semantics.md, Weight layouts and checkpoints).
//
// ExpertWeights is what a checkpoint becomes before it meets a layer: the four parameters of the
// expert MLP in the physical layout the kernels use -- fc1 [fc1_out, H] per expert with its rows
// in GLU-interleaved order when the activation says so, fc2 [H, F], biases [fc1_out] / [H] --
// either single grouped (one [E, ...] tensor per parameter) or per expert (E tensors). The CPU
// reference takes its fp64 pointer tables from it (src/checkpoint/reference_weights.h) and the
// GPU layer its device copies (views() per parameter).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe/activation.h"
#include "moe/grouped_mlp_config.h"
#include "moe/state_dict.h"

namespace moe {

// What fixes the shapes of the expert parameters.
struct ExpertWeightsSpec {
  int64_t hidden = 0;  // H
  int64_t ffn = 0;     // F
  int experts = 0;     // E
  ActivationParams activation;  // gated or not; GLU interleave of fc1's rows
  bool bias = false;
  WeightLayout layout = WeightLayout::kSingleGrouped;

  static ExpertWeightsSpec from_config(const GroupedMlpConfig& c);
  int64_t fc1_out() const { return fc1_out_features(activation.kind, ffn); }
  // Shape of one expert's block of parameter p: [fc1_out, H], [fc1_out], [H, F] or [H].
  std::vector<int64_t> expert_shape(Param p) const;
  bool has(Param p) const { return bias || p == Param::kFc1Weight || p == Param::kFc2Weight; }
  void validate() const;  // throws moe::Error naming the bad field
};

class ExpertWeights {
 public:
  // Zero-filled weights of `dtype` (a floating-point dtype).
  ExpertWeights(const ExpertWeightsSpec& spec, DType dtype);

  // The layer's parameters out of a state dict with our key names under `prefix`
  // (docs/semantics.md): keys in either layout are accepted and normalised to spec.layout (the dict
  // itself is not modified). A grouped tensor may also come flattened ([E * fc1_out, H]). Every
  // parameter must be present with the expected shape (biases exactly when spec.bias) and all share
  // one floating dtype; anything else is a moe::Error naming the key. Borrowed tensors stay
  // borrowed (no copy) where no conversion is needed.
  static ExpertWeights from_state_dict(const StateDict& sd, const ExpertWeightsSpec& spec,
                                       const std::string& prefix = "");
  // The parameters under `prefix` with our key names, in spec.layout.
  StateDict to_state_dict(const std::string& prefix = "") const;

  // The same weights in another layout (bitwise identical values).
  ExpertWeights with_layout(WeightLayout layout) const;
  // The same weights with another GLU interleave of fc1's rows (values moved, not changed).
  ExpertWeights with_glu_interleave(int glu_interleave) const;
  // Converted to another floating dtype (bf16/fp16 round to nearest even).
  ExpertWeights cast(DType dtype) const;

  const ExpertWeightsSpec& spec() const { return spec_; }
  DType dtype() const { return dtype_; }
  // Tensors of parameter p: one [E, ...] (single grouped) or E (per expert); none for an absent bias.
  const std::vector<HostTensor>& tensors(Param p) const { return params_[index(p)]; }
  // Expert e's block of parameter p (expert_shape(p), contiguous).
  const uint8_t* expert_data(Param p, int e) const;
  uint8_t* mutable_expert_data(Param p, int e);
  // Host views of parameter p in the layer's convention (grouped: one [E, ...] view; per expert: E).
  std::vector<TensorView> views(Param p) const;

  // Same spec, dtype and bytes.
  bool equals(const ExpertWeights& other) const;

 private:
  static int index(Param p) { return static_cast<int>(p); }
  ExpertWeights() = default;
  ExpertWeightsSpec spec_;
  DType dtype_ = DType::kBF16;
  std::vector<HostTensor> params_[4];
};

// Floating dtypes weights may have.
bool is_weight_dtype(DType t);

// An expert layer stored with our key names, as found in a state dict.
struct ExpertLayerKeys {
  std::string prefix;   // what precedes "fc1.weight"
  WeightLayout layout;  // how its keys are stored now
  int experts = 0;
  int64_t hidden = 0;
  int64_t fc1_out = 0;  // rows of fc1 (2F when gated)
  int64_t ffn = 0;      // F (columns of fc2)
  bool bias = false;
  DType dtype = DType::kBF16;
};

// The expert layers of `sd` with our key names, sorted by prefix:
//   per expert:    a prefix with "fc1.weight0"; E = the number of consecutive fc1.weight{i}
//                  (or `experts` when given; a gap is then reported when the layer is loaded);
//   single grouped: a 3-D "fc1.weight" [E, fc1_out, H] with a 3-D "fc2.weight" [E, H, F] (E = first
//                  dim, which must equal `experts` when given). With `experts` given, 2-D stacked
//                  tensors [E * fc1_out, H] / [E * H, F] are recognised too.
// A 2-D "fc1.weight" without `experts` is not an expert layer (an ordinary MLP has one too).
std::vector<ExpertLayerKeys> find_expert_layers(const StateDict& sd, int experts = 0);
// The spec of such a layer for an activation (its gating must agree with fc1_out and F).
ExpertWeightsSpec layer_spec(const ExpertLayerKeys& layer, const ActivationParams& activation, WeightLayout layout);

}  // namespace moe
