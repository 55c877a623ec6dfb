// Lists of key names for error messages: the first few, then a count (an expert index taken from
// an untrusted file can make the list of missing keys enormous).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace moe::detail {

class KeyList {
 public:
  static constexpr size_t kShown = 16;
  void add(const std::string& key) {
    if (shown_.size() < kShown) shown_.push_back(key);
    ++count_;
  }
  // Counts keys without building their names (once the list is full).
  void skip(size_t n = 1) { count_ += n; }
  bool full() const { return shown_.size() >= kShown; }
  bool empty() const { return count_ == 0; }
  size_t size() const { return count_; }
  std::string str() const {
    std::string s;
    for (const std::string& k : shown_) s += (s.empty() ? "'" : ", '") + k + "'";
    if (count_ > shown_.size()) s += " and " + std::to_string(count_ - shown_.size()) + " more";
    return s;
  }

 private:
  std::vector<std::string> shown_;
  size_t count_ = 0;
};

}  // namespace moe::detail
