// The PNG writer and the bar chart of `moe-engine bench --png` (bench/support): the file is
// decoded here independently (chunk layout, CRCs with zlib's crc32, the image data inflated with
// zlib's uncompress) and its pixels compared with what was drawn; the chart's bars are measured in
// the rendered image.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <zlib.h>

#include "support/bar_chart.h"
#include "support/expect_error.h"
#include "support/pixel_font.h"
#include "support/png_writer.h"

namespace moe::bench {
namespace {

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return uint32_t(b[at]) << 24 | uint32_t(b[at + 1]) << 16 | uint32_t(b[at + 2]) << 8 | uint32_t(b[at + 3]);
}

struct Decoded {
  uint32_t width = 0, height = 0;
  std::vector<uint8_t> rgb;
};

// A decoder for exactly the subset encode_png promises (8-bit RGB, filter 0, no interlace); any
// deviation fails the test.
Decoded decode(const std::vector<uint8_t>& png) {
  Decoded d;
  const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_GE(png.size(), 8u);
  EXPECT_TRUE(std::equal(signature, signature + 8, png.begin()));
  std::vector<std::string> order;
  std::vector<uint8_t> idat;
  size_t at = 8;
  while (at + 12 <= png.size()) {
    const uint32_t len = be32(png, at);
    const std::string type(png.begin() + at + 4, png.begin() + at + 8);
    EXPECT_LE(at + 12 + len, png.size()) << type;
    if (at + 12 + len > png.size()) return d;
    const uint8_t* data = png.data() + at + 8;
    const uLong crc = crc32(crc32(0L, Z_NULL, 0), png.data() + at + 4, 4 + len);
    EXPECT_EQ(be32(png, at + 8 + len), static_cast<uint32_t>(crc)) << "CRC of " << type;
    order.push_back(type);
    if (type == "IHDR") {
      EXPECT_EQ(len, 13u);
      d.width = be32(png, at + 8);
      d.height = be32(png, at + 12);
      EXPECT_EQ(data[8], 8) << "bit depth";
      EXPECT_EQ(data[9], 2) << "colour type RGB";
      EXPECT_EQ(data[10], 0) << "compression";
      EXPECT_EQ(data[11], 0) << "filter method";
      EXPECT_EQ(data[12], 0) << "interlace";
    } else if (type == "IDAT") {
      idat.insert(idat.end(), data, data + len);
    }
    at += 12 + len;
  }
  EXPECT_EQ(at, png.size()) << "bytes after the last chunk";
  EXPECT_EQ(order, (std::vector<std::string>{"IHDR", "IDAT", "IEND"}));

  const size_t stride = 1 + 3 * size_t(d.width);
  std::vector<uint8_t> raw(stride * d.height + 1);  // one spare byte: the stream must not be longer
  uLongf raw_len = raw.size();
  EXPECT_EQ(uncompress(raw.data(), &raw_len, idat.data(), idat.size()), Z_OK);
  EXPECT_EQ(raw_len, stride * d.height);
  for (uint32_t y = 0; y < d.height && raw_len == stride * d.height; ++y) {
    EXPECT_EQ(raw[y * stride], 0) << "filter type of row " << y;
    d.rgb.insert(d.rgb.end(), raw.begin() + y * stride + 1, raw.begin() + (y + 1) * stride);
  }
  return d;
}

TEST(PngWriter, EncodesEveryPixel) {
  Image img(5, 3, {10, 20, 30});
  img.set(0, 0, {255, 0, 0});
  img.set(4, 2, {0, 255, 1});
  img.fill_rect(1, 1, 3, 2, {7, 8, 9});
  img.set(-1, 0, {1, 1, 1});  // outside: ignored
  img.set(5, 2, {1, 1, 1});
  const Decoded d = decode(encode_png(img));
  ASSERT_EQ(d.width, 5u);
  ASSERT_EQ(d.height, 3u);
  ASSERT_EQ(d.rgb.size(), 5u * 3u * 3u);
  auto px = [&](int x, int y) {
    const size_t i = (size_t(y) * 5 + x) * 3;
    return Rgb{d.rgb[i], d.rgb[i + 1], d.rgb[i + 2]};
  };
  for (int y = 0; y < 3; ++y)
    for (int x = 0; x < 5; ++x) {
      Rgb want{10, 20, 30};
      if (x == 0 && y == 0) want = {255, 0, 0};
      if (x == 4 && y == 2) want = {0, 255, 1};
      if (y == 1 && (x == 1 || x == 2)) want = {7, 8, 9};
      const Rgb got = px(x, y);
      EXPECT_TRUE(got == want) << "pixel (" << x << ", " << y << "): " << int(got.r) << "," << int(got.g) << ","
                               << int(got.b);
      EXPECT_TRUE(img.at(x, y) == want);
    }
}

TEST(PngWriter, WritesTheFileAndNamesABadPath) {
  Image img(2, 2, {1, 2, 3});
  const std::string path = ::testing::TempDir() + "moe_png_writer_test.png";
  write_png(path, img);
  std::ifstream f(path, std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, encode_png(img));
  std::remove(path.c_str());
  testing::expect_error_naming([&] { write_png("/nonexistent-dir/x.png", img); }, "/nonexistent-dir/x.png");
  testing::expect_error_naming([] { Image(0, 4); }, "image size");
}

TEST(PixelFont, DrawsKnownGlyphPixels) {
  Image img(20, 10);
  const Rgb ink{0, 0, 0};
  draw_text(img, 1, 1, "1", ink);
  // '1' rows: ..#.. / .##.. / ..#.. x4 / .###.
  EXPECT_TRUE(img.at(1 + 2, 1) == ink);
  EXPECT_TRUE(img.at(1 + 0, 1) == (Rgb{255, 255, 255}));
  EXPECT_TRUE(img.at(1 + 1, 1 + 1) == ink);
  EXPECT_TRUE(img.at(1 + 1, 1 + 6) == ink && img.at(1 + 3, 1 + 6) == ink);
  EXPECT_TRUE(img.at(1 + 4, 1 + 6) == (Rgb{255, 255, 255}));
  // Vertical text reads upwards: the top row of '-' ... the bar of '-' (row 3) becomes column 3,
  // spanning the five rows above the baseline point.
  Image v(10, 10);
  draw_text(v, 2, 8, "-", ink, 1, true);
  for (int y = 3; y < 8; ++y) EXPECT_TRUE(v.at(2 + 3, y) == ink) << y;
  EXPECT_TRUE(v.at(2 + 3, 8) == (Rgb{255, 255, 255}));
  EXPECT_TRUE(v.at(2 + 2, 5) == (Rgb{255, 255, 255}));
  EXPECT_EQ(text_length("abc", 2), (3 * kGlyphAdvance - 1) * 2);
}

// Rows of colour c in column x, counted upwards from the x axis.
int bar_height(const Image& img, int x, int axis_row, Rgb c) {
  int h = 0;
  for (int y = axis_row - 1; y >= 0 && img.at(x, y) == c; --y) ++h;
  return h;
}

TEST(BarChart, BarsHaveTheirValuesHeightAndColour) {
  BarChart c;
  c.title = "test chart";
  c.unit = "TFLOP/s";
  c.series = {"fwd", "bwd", "total"};
  c.groups = {"qwen3-30b-a3b-ep8", "4096x2048x768x16x8"};
  c.values = {{455, 610, 524}, {100, 0, std::nan("")}};
  const BarChartLayout L = layout_bar_chart(c);
  // 610 / 6 ticks = 102 -> the next round step is 200; 610 rounds up to 800.
  EXPECT_EQ(L.y_step, 200);
  EXPECT_EQ(L.y_max, 800);
  const Image img = render_bar_chart(c);
  ASSERT_EQ(img.width(), L.width);
  ASSERT_EQ(img.height(), L.height);
  const int plot_h = L.plot_bottom - L.plot_top;
  for (int g = 0; g < 2; ++g)
    for (int s = 0; s < 3; ++s) {
      const double v = c.values[g][s];
      const int x = L.bar_left(g, s) + L.bar_width / 2;
      const int expect = (std::isfinite(v) && v > 0) ? static_cast<int>(std::lround(v / L.y_max * plot_h)) : 0;
      EXPECT_EQ(bar_height(img, x, L.plot_bottom, series_color(s)), expect) << "group " << g << " series " << s;
      // The bar spans its whole width, and the columns beside it are not of its colour.
      if (expect > 0) {
        EXPECT_TRUE(img.at(L.bar_left(g, s), L.plot_bottom - 1) == series_color(s));
        EXPECT_TRUE(img.at(L.bar_left(g, s) + L.bar_width - 1, L.plot_bottom - 1) == series_color(s));
      }
    }
  EXPECT_FALSE(img.at(L.bar_left(0, 0) - 1, L.plot_bottom - 1) == series_color(0));
  // The x axis row is ink, the legend shows every series colour.
  EXPECT_TRUE(img.at(L.plot_left + 3, L.plot_bottom) == (Rgb{40, 40, 40}));
  for (int s = 0; s < 3; ++s) {
    bool found = false;
    for (int y = 0; y < L.plot_top && !found; ++y)
      for (int x = 0; x < img.width() && !found; ++x) found = img.at(x, y) == series_color(s);
    EXPECT_TRUE(found) << "legend colour of series " << s;
  }
  // The PNG of the chart decodes to the same pixels.
  const Decoded d = decode(encode_png(img));
  EXPECT_EQ(d.rgb, img.rgb());
}

TEST(BarChart, RejectsValuesThatDoNotMatchTheLabels) {
  BarChart c;
  c.series = {"a", "b"};
  c.groups = {"g"};
  c.values = {{1.0}};
  testing::expect_error_naming([&] { layout_bar_chart(c); }, "argument 'chart'");
  c.values = {{1.0, 2.0}, {3.0, 4.0}};
  testing::expect_error_naming([&] { layout_bar_chart(c); }, "argument 'chart'");
  c.values = {{0.0, 0.0}};  // nothing to draw still gives an axis
  EXPECT_GT(layout_bar_chart(c).y_max, 0);
}

}  // namespace
}  // namespace moe::bench
