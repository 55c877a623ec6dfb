#include "moe/device_errors.h"

namespace moe {

std::string describe_error_bits(uint32_t bits) {
  struct Entry {
    uint32_t bit;
    const char* text;
  };
  static const Entry kEntries[] = {
      {kErrExpertOutOfRange, "expert id out of range (entry skipped)"},
      {kErrDuplicateExpert, "the same expert twice in a top-k row (repeat skipped)"},
      {kErrRowOverflow, "rows exceed the static row bound R (rows past R not written)"},
      {kErrNonFiniteProb, "non-finite routing prob (entry skipped)"},
      {kErrMisalignedPrepadded, "pre-padded input with a count that is not a multiple of the alignment"},
      {kErrBadGroupOffsets, "grouped GEMM group offsets not starting at 0, decreasing, or past the rows (groups clamped)"},
      {kErrNonFiniteLogit, "non-finite router logit or expert bias (row routed nowhere)"},
      {kErrUnalignedGroup, "FP8 wgrad group not filling whole 128-token blocks (group skipped)"},
      {kErrBadRowMap, "row map entry below -1 or past the rows of the gathered tensor (row read as zeros)"},
  };
  std::string out;
  uint32_t known = 0;
  for (const auto& e : kEntries) {
    known |= e.bit;
    if (bits & e.bit) out += (out.empty() ? "" : "; ") + std::string(e.text);
  }
  if (bits & ~known) out += (out.empty() ? "" : "; ") + std::string("unknown error bits");
  return out;
}

}  // namespace moe
