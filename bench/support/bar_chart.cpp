#include "support/bar_chart.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "moe/error.h"
#include "support/pixel_font.h"

namespace moe::bench {
namespace {

constexpr int kLabelScale = 2;  // tick labels, group labels, legend, title
constexpr int kBarWidth = 26, kGroupGap = 30, kPlotHeight = 420;
constexpr Rgb kInk{40, 40, 40}, kGrid{225, 225, 225};

bool drawable(double v) { return std::isfinite(v) && v > 0; }

// Smallest "round" step (1, 2 or 5 times a power of ten) giving at most ~6 ticks up to `max`.
double round_step(double max) {
  if (!(max > 0)) return 1;
  const double raw = max / 6;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

std::string format_value(double v, double step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, step >= 1 ? "%.0f" : "%.2g", v);
  return buf;
}

}  // namespace

Rgb series_color(int series) {
  static const Rgb palette[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189}};
  return palette[series % 5];
}

int BarChartLayout::bar_left(int group, int s) const {
  return plot_left + kGroupGap / 2 + group * group_width + s * bar_width;
}

int BarChartLayout::bar_top(double value) const {
  const double frac = std::clamp(value / y_max, 0.0, 1.0);
  return plot_bottom - static_cast<int>(std::lround(frac * (plot_bottom - plot_top)));
}

BarChartLayout layout_bar_chart(const BarChart& c) {
  MOE_CHECK(!c.series.empty(), "argument 'chart': expected at least one series");
  MOE_CHECK(c.values.size() == c.groups.size(), "argument 'chart': expected ", c.groups.size(),
            " rows of values (one per group), got ", c.values.size());
  double max = 0;
  for (const auto& row : c.values) {
    MOE_CHECK(row.size() == c.series.size(), "argument 'chart': expected ", c.series.size(),
              " values per group (one per series), got ", row.size());
    for (double v : row)
      if (drawable(v)) max = std::max(max, v);
  }
  BarChartLayout L;
  L.y_step = round_step(max);
  L.y_max = std::max(1.0, std::ceil(max / L.y_step)) * L.y_step;
  L.bar_width = kBarWidth;
  L.series = static_cast<int>(c.series.size());

  size_t longest_group = 0;
  for (const auto& g : c.groups) longest_group = std::max(longest_group, g.size());
  const int tick_label = text_length(format_value(L.y_max, L.y_step), kLabelScale);
  const int groups = static_cast<int>(c.groups.size());
  L.group_width = L.series * kBarWidth + kGroupGap;

  const int th = text_height(kLabelScale);
  L.plot_left = 20 + th + 10 + tick_label + 10;  // unit (written upwards), tick labels
  L.plot_right = L.plot_left + std::max(1, groups) * L.group_width;
  // Title, legend, then room for the value written above the tallest bar.
  L.plot_top = 20 + th + 10 + th + 14 + text_length(format_value(L.y_max, L.y_step), kLabelScale);
  L.plot_bottom = L.plot_top + kPlotHeight;
  int legend = 0;
  for (const auto& s : c.series) legend += th + 6 + text_length(s, kLabelScale) + 20;
  L.width = std::max({L.plot_right + 20, 20 + text_length(c.title, kLabelScale) + 20, 20 + legend});
  L.height = L.plot_bottom + 12 + text_length(std::string(longest_group, 'x'), kLabelScale) + 20;
  return L;
}

Image render_bar_chart(const BarChart& c) {
  const BarChartLayout L = layout_bar_chart(c);
  Image img(L.width, L.height);
  const int th = text_height(kLabelScale);

  draw_text(img, 20, 20, c.title, kInk, kLabelScale);
  int lx = 20;
  const int ly = 20 + th + 10;
  for (size_t s = 0; s < c.series.size(); ++s) {
    img.fill_rect(lx, ly, lx + th, ly + th, series_color(static_cast<int>(s)));
    lx += th + 6;
    draw_text(img, lx, ly, c.series[s], kInk, kLabelScale);
    lx += text_length(c.series[s], kLabelScale) + 20;
  }

  // Grid lines and tick labels, then the axes on top of them.
  for (double v = 0; v <= L.y_max + L.y_step / 2; v += L.y_step) {
    const int y = L.bar_top(v);
    img.fill_rect(L.plot_left, y, L.plot_right, y + 1, kGrid);
    const std::string label = format_value(v, L.y_step);
    draw_text(img, L.plot_left - 10 - text_length(label, kLabelScale), y - th / 2, label, kInk, kLabelScale);
  }
  const int plot_middle = (L.plot_top + L.plot_bottom) / 2;
  draw_text(img, 20, plot_middle + text_length(c.unit, kLabelScale) / 2, c.unit, kInk, kLabelScale, true);
  img.fill_rect(L.plot_left - 1, L.plot_top, L.plot_left, L.plot_bottom + 1, kInk);
  img.fill_rect(L.plot_left - 1, L.plot_bottom, L.plot_right, L.plot_bottom + 1, kInk);

  for (size_t g = 0; g < c.groups.size(); ++g) {
    for (size_t s = 0; s < c.series.size(); ++s) {
      const double v = c.values[g][s];
      if (!drawable(v)) continue;
      const int x = L.bar_left(static_cast<int>(g), static_cast<int>(s));
      const int top = L.bar_top(v);
      img.fill_rect(x, top, x + L.bar_width, L.plot_bottom, series_color(static_cast<int>(s)));
      // The value, written upwards just above the bar (a bar is narrower than a horizontal label).
      draw_text(img, x + (L.bar_width - th) / 2, top - 4, format_value(v, L.y_step), kInk, kLabelScale, true);
    }
    const int group_x = L.bar_left(static_cast<int>(g), 0) + (L.series * L.bar_width - th) / 2;
    draw_text(img, group_x, L.plot_bottom + 12 + text_length(c.groups[g], kLabelScale), c.groups[g], kInk,
              kLabelScale, true);
  }
  return img;
}

}  // namespace moe::bench
