// Text tests on tensor keys and file names, shared by the checkpoint sources (C++17 has no ends_with).
#pragma once

#include <string>

namespace moe::detail {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace moe::detail
