// Hugging Face expert tensors -> ExpertWeights and back (layouts in include/moe/checkpoint_hf.h; the
// layers are found by hf_find.cpp). Pure data movement: every element is copied as bytes, so values and
// dtype never change (GPT-OSS's MXFP4 release is decoded exactly, checkpoint/hf_mxfp4.h).
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "checkpoint/byte_transpose.h"
#include "checkpoint/glu_rows.h"
#include "checkpoint/hf_mxfp4.h"
#include "checkpoint/hf_names.h"
#include "checkpoint/hf_tensors.h"
#include "moe/checkpoint_hf.h"
#include "moe/error.h"

namespace moe {

// ---------------------------------------------------------------------------------------------
// The x @ W form (GPT-OSS, the privacy filter, qwen3_vl_moe's released files): gate_up [E, H, 2F], down
// [E, F, H]. Gate j and up j are columns 2j and 2j + 1 (GPT-OSS, interleaved) or j and F + j (halves).

namespace {

// One expert's 2F gate and up rows (of `row` bytes: rows of gate_up^T in the x @ W form, rows of a
// fused gate_up, or bias elements), as halves [gate ; up] or alternating (gate 0, up 0, gate 1, ...):
// where up row 0 starts, and the step from one gate (or up) row to the next.
size_t up_offset(bool alternating, int64_t F, size_t row) { return alternating ? row : F * row; }
size_t glu_row_step(bool alternating, size_t row) { return alternating ? 2 * row : row; }

// Our fc1 / fc2 of every expert from gate_up / down in the x @ W form: gate_up transposed (a column of
// x @ W is one of our rows), its rows then placed in our GLU order; down transposed into fc2.
void from_x_at_w(ExpertWeights& w, const uint8_t* gu, const uint8_t* dn, bool interleaved, int s, size_t el) {
  const ExpertWeightsSpec& spec = w.spec();
  const int64_t H = spec.hidden, F = spec.ffn;
  const size_t row = H * el;
  std::vector<uint8_t> rows(2 * F * row);  // gate_up^T of one expert: [2F, H]
  for (int e = 0; e < spec.experts; ++e) {
    detail::transpose_bytes(gu + e * H * 2 * F * el, rows.data(), H, 2 * F, el);
    detail::place_glu_rows(w.mutable_expert_data(Param::kFc1Weight, e), rows.data(),
                           rows.data() + up_offset(interleaved, F, row), glu_row_step(interleaved, row), F, s, row);
    detail::transpose_bytes(dn + e * F * H * el, w.mutable_expert_data(Param::kFc2Weight, e), F, H, el);
  }
}

// The reverse: gate_up [E, H, 2F] and down [E, F, H] of dtype dt from our fc1 / fc2.
std::pair<HostTensor, HostTensor> to_x_at_w(const ExpertWeights& w, bool interleaved, DType dt, size_t el) {
  const ExpertWeightsSpec& spec = w.spec();
  const int64_t E = spec.experts, H = spec.hidden, F = spec.ffn;
  const size_t row = H * el;
  HostTensor gu(dt, {E, H, 2 * F}), dn(dt, {E, F, H});
  std::vector<uint8_t> rows(2 * F * row);  // gate_up^T of one expert: [2F, H]
  for (int e = 0; e < E; ++e) {
    detail::take_glu_rows(w.expert_data(Param::kFc1Weight, e), rows.data(),
                          rows.data() + up_offset(interleaved, F, row), glu_row_step(interleaved, row), F,
                          spec.activation.glu_interleave, row);
    detail::transpose_bytes(rows.data(), gu.mutable_data() + e * H * 2 * F * el, 2 * F, H, el);
    detail::transpose_bytes(w.expert_data(Param::kFc2Weight, e), dn.mutable_data() + e * F * H * el, H, F, el);
  }
  return {std::move(gu), std::move(dn)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// HF -> ours

ExpertWeights load_hf_experts(const StateDict& sd, HfFamily f, const HfExpertLayer& l, WeightLayout layout,
                              int glu_interleave) {
  MOE_CHECK(!l.fp8, "state dict: the experts under '", l.prefix, "' are FP8 with block scales: load_hf_fp8_experts ",
            "reads them");
  MOE_CHECK(glu_interleave == 0 || is_gated(hf_activation(f).kind), "argument 'glu_interleave': the ",
            hf_family_name(f), " experts are not gated (fc1 has no gate and linear halves to interleave), got ",
            glu_interleave);
  ExpertWeightsSpec spec;
  spec.hidden = l.hidden;
  spec.ffn = l.ffn;
  spec.experts = l.experts;
  spec.activation = hf_activation(f);
  spec.activation.glu_interleave = glu_interleave;
  spec.bias = hf_has_bias(f);
  spec.layout = layout;
  ExpertWeights w(spec, l.dtype);
  const int64_t H = l.hidden, F = l.ffn, E = l.experts;
  const int s = glu_interleave;
  const size_t el = static_cast<size_t>(dtype_bytes(l.dtype, 1));
  const size_t row = H * el;  // one fc1 row

  if (stored_as_gpt_oss(f)) {
    // MXFP4 decodes (exactly) into the bf16 tensors transformers makes of it: gate_up [E, H, 2F], down [E, F, H].
    HostTensor gu_decoded, dn_decoded;
    if (l.mxfp4) {
      gu_decoded = mxfp4_to_bf16(sd.at(l.prefix + "gate_up_proj_blocks"), sd.at(l.prefix + "gate_up_proj_scales"));
      dn_decoded = mxfp4_to_bf16(sd.at(l.prefix + "down_proj_blocks"), sd.at(l.prefix + "down_proj_scales"));
    }
    const uint8_t* gu = l.mxfp4 ? gu_decoded.data() : need(sd, l.prefix + "gate_up_proj", {E, H, 2 * F}, l.dtype).data();
    const uint8_t* gub = need(sd, l.prefix + "gate_up_proj_bias", {E, 2 * F}, l.dtype).data();
    const uint8_t* dn = l.mxfp4 ? dn_decoded.data() : need(sd, l.prefix + "down_proj", {E, F, H}, l.dtype).data();
    const uint8_t* dnb = need(sd, l.prefix + "down_proj_bias", {E, H}, l.dtype).data();
    const bool interleaved = gpt_oss_columns_interleaved(f);
    from_x_at_w(w, gu, dn, interleaved, s, el);
    for (int e = 0; e < E; ++e) {  // the biases follow the columns
      const uint8_t* gub_e = gub + e * 2 * F * el;
      detail::place_glu_rows(w.mutable_expert_data(Param::kFc1Bias, e), gub_e, gub_e + up_offset(interleaved, F, el),
                             glu_row_step(interleaved, el), F, s, el);
      std::memcpy(w.mutable_expert_data(Param::kFc2Bias, e), dnb + e * H * el, H * el);
    }
    return w;
  }

  const ProjNames n = proj_names(f);
  const FusedNames fn = fused_names(f);
  if (l.transposed) {  // x @ W: gate = columns [0, F), up = [F, 2F) of gate_up [E, H, 2F]; down [E, F, H]
    from_x_at_w(w, need(sd, l.prefix + fn.gate_up, {E, H, 2 * F}, l.dtype).data(),
                need(sd, l.prefix + fn.down, {E, F, H}, l.dtype).data(), /*interleaved=*/false, s, el);
    return w;
  }
  const uint8_t* fused_gu = l.fused ? need(sd, l.prefix + fn.gate_up, {E, 2 * F, H}, l.dtype).data() : nullptr;
  const uint8_t* fused_dn = l.fused ? need(sd, l.prefix + fn.down, {E, H, F}, l.dtype).data() : nullptr;
  for (int e = 0; e < E; ++e) {
    const uint8_t *gate, *up, *down;
    size_t stride = row;
    if (l.fused) {  // [gate ; up] rows, as chunk(2, dim=-1) of the product splits them (inkling: alternating)
      gate = fused_gu + e * 2 * F * row;
      up = gate + up_offset(fused_rows_alternate(f), F, row);
      stride = glu_row_step(fused_rows_alternate(f), row);
      down = fused_dn + e * H * F * el;
    } else {
      gate = n.gate ? need(sd, per_expert_key(l.prefix, e, n.gate), {F, H}, l.dtype).data() : nullptr;
      up = need(sd, per_expert_key(l.prefix, e, n.up), {F, H}, l.dtype).data();
      down = need(sd, per_expert_key(l.prefix, e, n.down), {H, F}, l.dtype).data();
    }
    uint8_t* fc1 = w.mutable_expert_data(Param::kFc1Weight, e);
    std::memcpy(w.mutable_expert_data(Param::kFc2Weight, e), down, H * F * el);
    if (gate)
      detail::place_glu_rows(fc1, gate, up, stride, F, s, row);
    else  // not gated: fc1 is the up projection
      std::memcpy(fc1, up, F * row);
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// ours -> HF

StateDict hf_expert_tensors(const ExpertWeights& w, HfFamily f, const std::string& prefix) {
  // Hugging Face keys an expert module's tensors under "...experts." (granitemoe: "...block_sparse_moe."):
  // under any other prefix the names written would be no family's, and no reader would find the layer.
  MOE_CHECK(names_expert_module(prefix, f), "Hugging Face ", hf_family_name(f), ": the experts' prefix must end in '",
            expert_module(f), "' (the module's name), got '", prefix, "'");
  const ExpertWeightsSpec& spec = w.spec();
  const ActivationParams act = hf_activation(f);
  MOE_CHECK(spec.activation.kind == act.kind, "Hugging Face ", hf_family_name(f), ": its experts use ",
            activation_name(act.kind), ", these weights are for ", activation_name(spec.activation.kind));
  MOE_CHECK(spec.bias == hf_has_bias(f), "Hugging Face ", hf_family_name(f), ": its experts ",
            hf_has_bias(f) ? "have" : "have no", " biases, these weights ", spec.bias ? "have" : "have none");
  const int64_t H = spec.hidden, F = spec.ffn, E = spec.experts;
  const int s = spec.activation.glu_interleave;
  const DType dt = w.dtype();
  const size_t el = static_cast<size_t>(dtype_bytes(dt, 1));
  const size_t row = H * el;
  StateDict sd;

  if (stored_as_gpt_oss(f)) {
    const bool interleaved = gpt_oss_columns_interleaved(f);
    auto [gu, dn] = to_x_at_w(w, interleaved, dt, el);
    HostTensor gub(dt, {E, 2 * F}), dnb(dt, {E, H});
    for (int e = 0; e < E; ++e) {  // the biases follow the columns
      uint8_t* gub_e = gub.mutable_data() + e * 2 * F * el;
      detail::take_glu_rows(w.expert_data(Param::kFc1Bias, e), gub_e, gub_e + up_offset(interleaved, F, el),
                            glu_row_step(interleaved, el), F, s, el);
      std::memcpy(dnb.mutable_data() + e * H * el, w.expert_data(Param::kFc2Bias, e), H * el);
    }
    sd.emplace(prefix + "gate_up_proj", std::move(gu));
    sd.emplace(prefix + "gate_up_proj_bias", std::move(gub));
    sd.emplace(prefix + "down_proj", std::move(dn));
    sd.emplace(prefix + "down_proj_bias", std::move(dnb));
    return sd;
  }

  if (f == HfFamily::kQwen3VlMoe) {  // the released form: x @ W, gate_up [E, H, 2F] (halves), down [E, F, H]
    auto [gu, dn] = to_x_at_w(w, /*interleaved=*/false, dt, el);
    sd.emplace(prefix + "gate_up_proj", std::move(gu));
    sd.emplace(prefix + "down_proj", std::move(dn));
    return sd;
  }
  if (stored_fused(f)) {  // [gate ; up] rows of every expert (inkling: alternating), and every expert's fc2
    const FusedNames fn = fused_names(f);
    const bool alternate = fused_rows_alternate(f);
    HostTensor gu(dt, {E, 2 * F, H}), dn(dt, {E, H, F});
    for (int e = 0; e < E; ++e) {
      uint8_t* gu_e = gu.mutable_data() + e * 2 * F * row;
      detail::take_glu_rows(w.expert_data(Param::kFc1Weight, e), gu_e, gu_e + up_offset(alternate, F, row),
                            glu_row_step(alternate, row), F, s, row);
      std::memcpy(dn.mutable_data() + e * H * F * el, w.expert_data(Param::kFc2Weight, e), H * F * el);
    }
    sd.emplace(prefix + fn.gate_up, std::move(gu));
    sd.emplace(prefix + fn.down, std::move(dn));
    return sd;
  }

  const ProjNames n = proj_names(f);
  for (int e = 0; e < E; ++e) {
    HostTensor up(dt, {F, H}), down(dt, {H, F});
    const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
    std::memcpy(down.mutable_data(), w.expert_data(Param::kFc2Weight, e), H * F * el);
    sd.emplace(per_expert_key(prefix, e, n.down), std::move(down));
    if (!n.gate) {  // not gated: fc1 is the up projection
      std::memcpy(up.mutable_data(), fc1, F * row);
      sd.emplace(per_expert_key(prefix, e, n.up), std::move(up));
      continue;
    }
    HostTensor gate(dt, {F, H});
    detail::take_glu_rows(fc1, gate.mutable_data(), up.mutable_data(), row, F, s, row);
    sd.emplace(per_expert_key(prefix, e, n.gate), std::move(gate));
    sd.emplace(per_expert_key(prefix, e, n.up), std::move(up));
  }
  return sd;
}

}  // namespace moe
