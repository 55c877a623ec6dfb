// Grouped bar charts of benchmark results, drawn into an Image (then written with write_png): one
// group of bars per shape, one bar per series (e.g. forward / backward / total TFLOP/s), a y axis
// with round tick values, the value above each bar, a legend and a title.
#pragma once

#include <string>
#include <vector>

#include "support/png_writer.h"

namespace moe::bench {

struct BarChart {
  std::string title;                        // top left
  std::string unit;                         // above the y axis, e.g. "TFLOP/s"
  std::vector<std::string> series;          // legend; one bar per series in every group
  std::vector<std::string> groups;          // labels under the groups (written upwards)
  std::vector<std::vector<double>> values;  // [group][series]; negative or non-finite values draw no bar
};

// Where render_bar_chart puts things (pixels; y grows downwards), so tests can check the drawing.
struct BarChartLayout {
  int width = 0, height = 0;
  int plot_left = 0, plot_right = 0, plot_top = 0, plot_bottom = 0;  // plot_bottom is the x axis row
  int bar_width = 0, group_width = 0, series = 0;
  double y_max = 0;  // value at plot_top (a round number >= every value)
  double y_step = 0;  // between ticks
  int bar_left(int group, int series) const;
  // Rows a bar of this value covers: [bar_top(v), plot_bottom).
  int bar_top(double value) const;
};

// Series colours, in order (repeated past the end).
Rgb series_color(int series);

// Throws moe::Error when `values` does not have groups x series entries.
BarChartLayout layout_bar_chart(const BarChart& chart);
Image render_bar_chart(const BarChart& chart);

}  // namespace moe::bench
