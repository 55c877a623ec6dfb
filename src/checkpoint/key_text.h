// Text tests on tensor keys and file names, shared by the checkpoint sources (C++17 has no ends_with).
#pragma once

#include <cstdint>
#include <string>

#include "moe/checkpoint_quant.h"

namespace moe::detail {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// What follows a parameter's key in one of our tensors: an expert index or nothing, then (weights
// of a quantized layer only) a companion suffix. Sets *index to the index or -1.
inline bool our_key_rest(const std::string& rest, bool companions, int64_t* index) {
  size_t digits = 0;
  while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  const std::string suffix = rest.substr(digits);
  bool ours = suffix.empty();
  if (companions)
    for (QuantPart part : kQuantParts) ours = ours || suffix == quant_part_suffix(part);
  if (!ours) return false;
  *index = -1;
  if (digits > 0) *index = digits > 9 ? INT64_MAX : std::stoll(rest.substr(0, digits));
  return true;
}

}  // namespace moe::detail
