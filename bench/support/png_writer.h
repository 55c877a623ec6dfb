// A minimal PNG encoder for the benchmark charts: 8-bit RGB, no interlace, every row filtered with
// filter type 0 (none), the image data compressed with zlib. Nothing else of PNG is needed to
// draw a chart, and every viewer reads this subset.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::bench {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb& o) const { return r == o.r && g == o.g && b == o.b; }
};

// An RGB raster, row-major, origin at the top left.
class Image {
 public:
  Image(int width, int height, Rgb background = {255, 255, 255});
  int width() const { return width_; }
  int height() const { return height_; }
  Rgb at(int x, int y) const;
  // Pixels outside the image are ignored, so drawing code need not clip.
  void set(int x, int y, Rgb c);
  // Fills [x0, x1) x [y0, y1), clipped to the image.
  void fill_rect(int x0, int y0, int x1, int y1, Rgb c);
  const std::vector<uint8_t>& rgb() const { return rgb_; }  // width * height * 3 bytes

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

// The PNG file's bytes.
std::vector<uint8_t> encode_png(const Image& image);
// Writes encode_png(image) to `path`; throws moe::Error naming the path when it cannot.
void write_png(const std::string& path, const Image& image);

}  // namespace moe::bench
