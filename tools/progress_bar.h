// A one-line progress bar on stderr for long file operations.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace moe::tools {

class ProgressBar {
 public:
  // Draws nothing unless `enabled`.
  ProgressBar(std::string label, bool enabled);
  ~ProgressBar();  // ends the line if anything was drawn
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // Redraws at most ten times a second, and always at completion.
  void update(uint64_t done, uint64_t total);

 private:
  std::string label_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_{};
};

bool stderr_is_terminal();

}  // namespace moe::tools
