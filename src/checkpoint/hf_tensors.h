// Checks of the Hugging Face expert tensors a conversion reads (shared by the unquantized and the
// FP8 conversions): each a moe::Error naming the key.
#pragma once

#include <string>
#include <vector>

#include "moe/checkpoint_hf.h"
#include "moe/error.h"
#include "moe/state_dict.h"

namespace moe {

// ceil(n / 128) without overflow (shapes come from untrusted files).
inline int64_t blocks_of_128(int64_t n) { return n / 128 + (n % 128 != 0); }

// The tensor under `key`, which must have this shape and dtype.
inline const HostTensor& need(const StateDict& sd, const std::string& key, const std::vector<int64_t>& shape,
                              DType dtype) {
  auto it = sd.find(key);
  MOE_CHECK(it != sd.end(), "state dict: missing '", key, "'");
  const HostTensor& t = it->second;
  MOE_CHECK(t.shape() == shape, "state dict: '", key, "' has shape ", t.shape_string(), ", expected ",
            shape_string(shape));
  MOE_CHECK(t.dtype() == dtype, "state dict: '", key, "' has dtype ", dtype_name(t.dtype()), ", the layer's other ",
            "expert tensors ", dtype_name(dtype));
  return t;
}

// The 128x128 block scales of an FP8 weight [rows, cols]: "<weight key>_scale_inv", fp32 (bf16, which
// converts to fp32 exactly, is read too) [ceil(rows / 128), ceil(cols / 128)].
inline const HostTensor& need_fp8_scale(const StateDict& sd, const std::string& weight_key, int64_t rows,
                                        int64_t cols) {
  const std::string key = weight_key + kFp8ScaleSuffix;
  auto it = sd.find(key);
  MOE_CHECK(it != sd.end(), "state dict: missing '", key, "' (the 128x128 block scales of the FP8 '", weight_key, "')");
  const HostTensor& t = it->second;
  const std::vector<int64_t> shape{blocks_of_128(rows), blocks_of_128(cols)};
  MOE_CHECK(t.shape() == shape, "state dict: '", key, "' has shape ", t.shape_string(), ", expected ",
            shape_string(shape), " (one scale per 128x128 block of ", shape_string({rows, cols}), ")");
  MOE_CHECK(t.dtype() == DType::kFP32 || t.dtype() == DType::kBF16, "state dict: '", key, "' has dtype ",
            dtype_name(t.dtype()), ", expected fp32 (or bf16)");
  return t;
}

}  // namespace moe
