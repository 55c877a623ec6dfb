// GPT-OSS's released MXFP4 expert weights decoded to bf16, exactly as transformers decodes them.
#pragma once

#include "moe/state_dict.h"

namespace moe {

// MXFP4 blocks [E, rows, G, 16] (two E2M1 codes a byte, low nibble first) with E8M0 scales [E, rows, G]
// decoded as transformers' gpt_oss loading does (torch.ldexp(code, scale - 127) in bf16, then
// transposed): bf16 [E, G * 32, rows]. Every value is exact in bf16 (two significant bits, exponents
// within its range) or beyond its largest and inf; scale 255 (NaN in the MX format) is read as torch
// reads it, 2^128. The shapes must have been checked (hf_find.cpp does).
HostTensor mxfp4_to_bf16(const HostTensor& blocks, const HostTensor& scales);

}  // namespace moe
