// The device-side error word (docs/semantics.md, Errors). Kernels never read or write out of bounds
// on bad input: they skip the bad entry and OR a bit into a uint32 in device memory. The host reads
// and clears the word outside graphs (ErrorWord::check), which syncs.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum ErrorBits : uint32_t {
  kErrExpertOutOfRange = 1u << 0,     // an expert id outside [0, E) (and not -1 in top-k form)
  kErrDuplicateExpert = 1u << 1,      // the same expert twice in one top-k row
  kErrRowOverflow = 1u << 2,          // sum(padded) > R: rows past R were not written
  kErrNonFiniteProb = 1u << 3,        // a NaN/Inf routing prob (the entry was skipped)
  kErrMisalignedPrepadded = 1u << 4,  // pre-padded input whose count is not a multiple of A
  kErrBadGroupOffsets = 1u << 5,      // grouped GEMM offsets not 0-based, decreasing or past the rows
  kErrNonFiniteLogit = 1u << 6,       // a NaN/Inf router logit or expert bias (the row was routed nowhere)
  kErrUnalignedGroup = 1u << 7,       // FP8 wgrad: a group not filling whole 128-token blocks (skipped)
  kErrBadRowMap = 1u << 8,            // a row map entry below -1 or past the gathered rows (read as zeros)
};

// "expert id out of range; duplicate expert in a top-k row" -- empty for 0.
std::string describe_error_bits(uint32_t bits);

}  // namespace moe
