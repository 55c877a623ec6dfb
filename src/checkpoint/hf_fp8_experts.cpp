// FP8 expert weights between Hugging Face's per-expert form and our quantized layout
// (include/moe/checkpoint_hf_fp8.h). Bytes move; nothing is requantized.
#include "moe/checkpoint_hf_fp8.h"

#include <cstring>
#include <vector>

#include "checkpoint/byte_transpose.h"
#include "checkpoint/glu_rows.h"
#include "checkpoint/hf_names.h"
#include "checkpoint/hf_tensors.h"
#include "moe/activation.h"
#include "moe/error.h"

namespace moe {

namespace {

constexpr int64_t kBlock = 128;

int64_t blocks(int64_t n) { return blocks_of_128(n); }

// A weight's block scales as fp32: stored fp32, or bf16 (whose conversion to fp32 is exact).
std::vector<float> scales_of(const HostTensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kFP32) {
    std::memcpy(out.data(), t.data(), out.size() * sizeof(float));
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t b;
      std::memcpy(&b, t.data() + 2 * i, 2);
      const uint32_t bits = static_cast<uint32_t>(b) << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  }
  return out;
}

// F and the GLU interleave that keep every 128-row block of fc1 within the gate or the up rows.
void check_block_aligned(const std::string& prefix, int64_t F, int s, const char* interleave_arg) {
  MOE_CHECK(F % kBlock == 0, "state dict: the FP8 experts under '", prefix, "' have F = ", F,
            ", not a multiple of 128: fc1's 128x128 blocks would mix gate and up rows (requantize from the ",
            "unquantized weights instead)");
  MOE_CHECK(s >= 0 && s % kBlock == 0 && (s == 0 || F % s == 0), "argument '", interleave_arg,
            "': the FP8 experts under '", prefix, "' keep their 128x128 blocks only with a GLU interleave that is ",
            "0 or a multiple of 128 dividing F = ", F, ", got ", s);
}

// One weight [E, rows, cols] in our format: the parts hf_fp8_format stores, grouped.
struct OurWeight {
  HostTensor data, scale, col_data, col_scale;
  OurWeight(int64_t E, int64_t rows, int64_t cols) {
    const QuantConfig c = hf_fp8_format();
    auto make = [&](QuantPart part) {
      QuantPartLayout l = quant_part_layout(c, part, rows, cols);
      l.shape.insert(l.shape.begin(), E);
      return HostTensor(l.dtype, l.shape);
    };
    data = make(QuantPart::kData);
    scale = make(QuantPart::kScale);
    col_data = make(QuantPart::kColumnwiseData);
    col_scale = make(QuantPart::kColumnwiseScale);
  }
  // The columnwise copy of expert e: the transpose of its rowwise data and scales.
  void transpose_expert(int e, int64_t rows, int64_t cols) {
    const int64_t n = rows * cols, nb = blocks(rows) * blocks(cols);
    detail::transpose_bytes(data.data() + e * n, col_data.mutable_data() + e * n, rows, cols, 1);
    detail::transpose_bytes(scale.data() + e * nb * 4, col_scale.mutable_data() + e * nb * 4, blocks(rows), blocks(cols), 4);
  }
  void put(StateDict& out, const std::string& key) {
    out.emplace(quant_part_key(key, QuantPart::kData), std::move(data));
    out.emplace(quant_part_key(key, QuantPart::kScale), std::move(scale));
    out.emplace(quant_part_key(key, QuantPart::kColumnwiseData), std::move(col_data));
    out.emplace(quant_part_key(key, QuantPart::kColumnwiseScale), std::move(col_scale));
  }
};

}  // namespace

QuantConfig hf_fp8_format() {
  QuantConfig c;
  c.format = QuantFormat::kFP8Block;
  c.blocking = QuantBlocking::k2D;
  c.rowwise = true;
  c.columnwise = true;
  c.scale_layout = ScaleLayout::kRowMajor;
  return c;
}

bool hf_fp8_storable(const QuantConfig& c) {
  return c.format == QuantFormat::kFP8Block && c.blocking == QuantBlocking::k2D && c.rowwise &&
         copy_scale_layout(c, false) == ScaleLayout::kRowMajor &&
         (!c.columnwise || copy_scale_layout(c, true) == ScaleLayout::kRowMajor);
}

StateDict load_hf_fp8_experts(const StateDict& sd, HfFamily f, const HfExpertLayer& l, WeightLayout layout,
                              int s, Metadata& metadata) {
  MOE_CHECK(l.fp8 && !l.fused, "state dict: the experts under '", l.prefix, "' are not per-expert FP8 weights");
  MOE_CHECK(proj_names(f).gate != nullptr, "state dict: the FP8 experts under '", l.prefix, "' are ",
            hf_family_name(f), "'s, which are not gated; FP8 layers are read for gated families only");
  const int64_t E = l.experts, F = l.ffn, H = l.hidden;
  check_block_aligned(l.prefix, F, s, "glu_interleave");
  const ProjNames n = proj_names(f);
  MOE_CHECK(E > 0 && F > 0 && H > 0, "state dict: the experts under '", l.prefix, "' have an empty dimension");
  for (int e = 0; e < E; ++e)  // every tensor as the layer describes it, before any byte moves
    for (const char* proj : n.all()) {
      const bool down = proj == n.down;
      const std::string key = per_expert_key(l.prefix, e, proj);
      need(sd, key, {down ? H : F, down ? F : H}, DType::kFP8E4M3);
      need_fp8_scale(sd, key, down ? H : F, down ? F : H);
    }
  OurWeight fc1(E, 2 * F, H), fc2(E, H, F);
  const int64_t bH = blocks(H), bF = F / kBlock;
  const size_t scale_row = bH * sizeof(float);  // one row of 128x128 blocks
  for (int e = 0; e < E; ++e) {
    const std::string gate = per_expert_key(l.prefix, e, n.gate), up = per_expert_key(l.prefix, e, n.up);
    detail::place_glu_rows(fc1.data.mutable_data() + e * 2 * F * H, sd.at(gate).data(), sd.at(up).data(), H, F, s,
                           H);
    // Block rows move with their 128 rows (check_block_aligned): the same placement, over F / 128 block rows.
    const std::vector<float> gate_sc = scales_of(sd.at(gate + kFp8ScaleSuffix)), up_sc = scales_of(sd.at(up + kFp8ScaleSuffix));
    detail::place_glu_rows(fc1.scale.mutable_data() + e * 2 * bF * scale_row,
                           reinterpret_cast<const uint8_t*>(gate_sc.data()),
                           reinterpret_cast<const uint8_t*>(up_sc.data()), scale_row, bF, s / kBlock, scale_row);
    const std::string down = per_expert_key(l.prefix, e, n.down);
    std::memcpy(fc2.data.mutable_data() + e * H * F, sd.at(down).data(), H * F);
    const std::vector<float> sc = scales_of(sd.at(down + kFp8ScaleSuffix));
    std::memcpy(fc2.scale.mutable_data() + e * bH * bF * 4, sc.data(), sc.size() * sizeof(float));
    fc1.transpose_expert(e, 2 * F, H);
    fc2.transpose_expert(e, H, F);
  }
  StateDict out;
  const std::string k1 = expert_param_key(l.prefix, Param::kFc1Weight), k2 = expert_param_key(l.prefix, Param::kFc2Weight);
  fc1.put(out, k1);
  fc2.put(out, k2);
  if (layout == WeightLayout::kPerExpert) normalize_expert_keys(out, l.prefix, static_cast<int>(E), layout);
  set_quant_metadata(metadata, k1, hf_fp8_format());
  set_quant_metadata(metadata, k2, hf_fp8_format());
  return out;
}

StateDict hf_fp8_expert_tensors(const StateDict& sd, const std::string& prefix, const QuantConfig& fc1_format,
                                const QuantConfig& fc2_format, HfFamily f, int s) {
  MOE_CHECK(f != HfFamily::kGptOss, "Hugging Face gpt_oss: its experts are not stored as FP8 with 128x128 block ",
            "scales (GPT-OSS ships MXFP4); the FP8 experts under '", prefix, "' cannot be written in its naming");
  MOE_CHECK(proj_names(f).gate != nullptr && !stored_fused(f) && !stored_as_gpt_oss(f), "Hugging Face ", hf_family_name(f), ": FP8 experts ",
            "are written for the gated per-expert families only; the experts under '", prefix, "' stay ours");
  MOE_CHECK(names_expert_module(prefix, f), "Hugging Face ", hf_family_name(f), ": the experts' prefix must end in '",
            expert_module(f), "' (the module's name), got '", prefix, "'");
  const std::string k1 = expert_param_key(prefix, Param::kFc1Weight), k2 = expert_param_key(prefix, Param::kFc2Weight);
  for (const auto& [key, c] : {std::pair{k1, fc1_format}, std::pair{k2, fc2_format}})
    MOE_CHECK(hf_fp8_storable(c),
              "convert: the experts under '", prefix, "' are quantized ('", key, "' is ", format_quant_metadata(c),
              "); Hugging Face naming holds FP8 block 128x128 weights with row-major scales only");
  const QuantizedParamInfo i1 = inspect_quantized_param(sd, k1, fc1_format), i2 = inspect_quantized_param(sd, k2, fc2_format);
  const int E = i1.experts;
  const int64_t H = i1.cols, F = i1.rows / 2;
  MOE_CHECK(i2.experts == E && i1.rows == 2 * F && i2.rows == H && i2.cols == F, "state dict: the FP8 experts under '",
            prefix, "' do not make one gated MLP: fc1 [", i1.rows, ", ", i1.cols, "], fc2 [", i2.rows, ", ", i2.cols,
            "] (expected fc1 [2F, H], fc2 [H, F])");
  for (Param p : {Param::kFc1Bias, Param::kFc2Bias}) {
    const std::string b = expert_param_key(prefix, p);
    MOE_CHECK(!sd.count(b) && !sd.count(b + "0"), "convert: the FP8 experts under '", prefix, "' have biases ('", b,
              "'); the Hugging Face families stored in FP8 have none");
  }
  check_block_aligned(prefix, F, s, "from_glu_interleave");
  // One grouped copy of each part, whatever the layout.
  StateDict g;
  for (const auto& [key, info] : {std::pair{k1, i1}, std::pair{k2, i2}})
    for (QuantPart part : kQuantParts) {
      const std::string base = quant_part_key(key, part);
      if (info.layout == WeightLayout::kSingleGrouped) {
        if (sd.count(base)) g.emplace(base, sd.at(base));
      } else {
        for (int e = 0; e < E; ++e) {
          const std::string k = quant_part_key(key + std::to_string(e), part);
          if (sd.count(k)) g.emplace(k, sd.at(k));
        }
      }
    }
  normalize_expert_keys(g, prefix, E, WeightLayout::kSingleGrouped);
  // A stored columnwise copy is dropped: it must hold nothing the rowwise copy does not.
  for (const auto& [key, rows, cols, c] : {std::tuple{k1, 2 * F, H, fc1_format}, std::tuple{k2, H, F, fc2_format}}) {
    if (!c.columnwise) continue;
    const uint8_t* d = g.at(quant_part_key(key, QuantPart::kData)).data();
    const uint8_t* cd = g.at(quant_part_key(key, QuantPart::kColumnwiseData)).data();
    const uint8_t* sc = g.at(quant_part_key(key, QuantPart::kScale)).data();
    const uint8_t* csc = g.at(quant_part_key(key, QuantPart::kColumnwiseScale)).data();
    const int64_t nb = blocks(rows) * blocks(cols);
    for (int e = 0; e < E; ++e)
      MOE_CHECK(detail::is_transpose_bytes(d + e * rows * cols, cd + e * rows * cols, rows, cols, 1) &&
                    detail::is_transpose_bytes(sc + e * nb * 4, csc + e * nb * 4, blocks(rows), blocks(cols), 4),
                "state dict: the columnwise copy of '", key, "' (expert ", e, ") is not the transpose of its rowwise ",
                "copy; Hugging Face naming keeps the rowwise copy only, and this one would be lost");
  }

  const ProjNames n = proj_names(f);
  const int64_t bH = blocks(H), bF = F / kBlock;
  const uint8_t* d1 = g.at(quant_part_key(k1, QuantPart::kData)).data();
  const uint8_t* s1 = g.at(quant_part_key(k1, QuantPart::kScale)).data();
  const uint8_t* d2 = g.at(quant_part_key(k2, QuantPart::kData)).data();
  const uint8_t* s2 = g.at(quant_part_key(k2, QuantPart::kScale)).data();
  const size_t scale_row = bH * sizeof(float);  // one row of 128x128 blocks
  StateDict out;
  for (int e = 0; e < E; ++e) {
    HostTensor gate(DType::kFP8E4M3, {F, H}), up(DType::kFP8E4M3, {F, H});
    HostTensor gate_sc(DType::kFP32, {bF, bH}), up_sc(DType::kFP32, {bF, bH});
    detail::take_glu_rows(d1 + e * 2 * F * H, gate.mutable_data(), up.mutable_data(), H, F, s, H);
    detail::take_glu_rows(s1 + e * 2 * bF * scale_row, gate_sc.mutable_data(), up_sc.mutable_data(), scale_row, bF,
                          s / kBlock, scale_row);
    for (auto& [proj, w, sc] : {std::tuple{n.gate, &gate, &gate_sc}, std::tuple{n.up, &up, &up_sc}}) {
      const std::string key = per_expert_key(prefix, e, proj);
      out.emplace(key + kFp8ScaleSuffix, std::move(*sc));
      out.emplace(key, std::move(*w));
    }
    HostTensor w(DType::kFP8E4M3, {H, F}), sc(DType::kFP32, {bH, bF});
    std::memcpy(w.mutable_data(), d2 + e * H * F, H * F);
    std::memcpy(sc.mutable_data(), s2 + e * bH * bF * 4, bH * bF * 4);
    const std::string key = per_expert_key(prefix, e, n.down);
    out.emplace(key + kFp8ScaleSuffix, std::move(sc));
    out.emplace(key, std::move(w));
  }
  return out;
}

}  // namespace moe
