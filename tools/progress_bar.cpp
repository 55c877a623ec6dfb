#include "progress_bar.h"

#include <cstdio>

#include <unistd.h>

namespace moe::tools {

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

ProgressBar::ProgressBar(std::string label, bool enabled) : label_(std::move(label)), enabled_(enabled) {}

ProgressBar::~ProgressBar() {
  if (drawn_) std::fputc('\n', stderr);
}

void ProgressBar::update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  drawn_ = true;
  constexpr int kWidth = 30;
  const double frac = total ? static_cast<double>(done) / static_cast<double>(total) : 1.0;
  const int filled = static_cast<int>(frac * kWidth);
  char bar[kWidth + 1];
  for (int i = 0; i < kWidth; ++i) bar[i] = i < filled ? '#' : '.';
  bar[kWidth] = '\0';
  constexpr double kMiB = 1024.0 * 1024.0;
  std::fprintf(stderr, "\r%s [%s] %3d%%  %.1f / %.1f MiB", label_.c_str(), bar, static_cast<int>(frac * 100),
               done / kMiB, total / kMiB);
  std::fflush(stderr);
}

}  // namespace moe::tools
