// Quantizes an expert weight bound in either layout into one grouped quantized copy -- what the
// quantized experts' weight refresh does for FP8 and for the emulated formats alike.
#pragma once

#include <vector>

#include <cuda_runtime_api.h>

#include "moe/quantize.h"
#include "moe/tensor.h"

namespace moe {

// source: one [E, N, K] view (single grouped: one batched quantize) or E views [N, K] (per expert:
// each matrix into its slice of `grouped`; a batch quantizes bitwise like its matrices one by one,
// docs/quantization.md). grouped: the batched copies [E, ...] the config writes (NVFP4: its global
// amax [E]).
void quantize_expert_weight(const QuantConfig& config, const std::vector<TensorView>& source,
                            const QuantizedTensor& grouped, cudaStream_t stream);

}  // namespace moe
