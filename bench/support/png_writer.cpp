#include "support/png_writer.h"

#include <algorithm>
#include <fstream>

#include <zlib.h>

#include "moe/error.h"

namespace moe::bench {

Image::Image(int width, int height, Rgb background) : width_(width), height_(height) {
  MOE_CHECK(width > 0 && height > 0 && width <= 16384 && height <= 16384,
            "argument 'image size': expected 1..16384 x 1..16384, got ", width, " x ", height);
  rgb_.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < rgb_.size(); i += 3) {
    rgb_[i] = background.r;
    rgb_[i + 1] = background.g;
    rgb_[i + 2] = background.b;
  }
}

Rgb Image::at(int x, int y) const {
  MOE_CHECK(x >= 0 && y >= 0 && x < width_ && y < height_, "Image::at: pixel (", x, ", ", y, ") outside ",
            width_, " x ", height_);
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  return {rgb_[i], rgb_[i + 1], rgb_[i + 2]};
}

void Image::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t i = (static_cast<size_t>(y) * width_ + x) * 3;
  rgb_[i] = c.r;
  rgb_[i + 1] = c.g;
  rgb_[i + 2] = c.b;
}

void Image::fill_rect(int x0, int y0, int x1, int y1, Rgb c) {
  for (int y = std::max(y0, 0); y < std::min(y1, height_); ++y)
    for (int x = std::max(x0, 0); x < std::min(x1, width_); ++x) set(x, y, c);
}

namespace {

void put_u32(std::vector<uint8_t>& out, uint32_t v) {  // PNG integers are big-endian
  out.push_back(static_cast<uint8_t>(v >> 24));
  out.push_back(static_cast<uint8_t>(v >> 16));
  out.push_back(static_cast<uint8_t>(v >> 8));
  out.push_back(static_cast<uint8_t>(v));
}

// length, type, data, CRC-32 of type + data.
void put_chunk(std::vector<uint8_t>& out, const char type[4], const std::vector<uint8_t>& data) {
  put_u32(out, static_cast<uint32_t>(data.size()));
  const size_t type_at = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  const uLong crc = crc32(crc32(0L, Z_NULL, 0), out.data() + type_at, static_cast<uInt>(4 + data.size()));
  put_u32(out, static_cast<uint32_t>(crc));
}

}  // namespace

std::vector<uint8_t> encode_png(const Image& image) {
  const int w = image.width(), h = image.height();
  // Scanlines: a filter-type byte (0 = none) before each row of RGB bytes.
  std::vector<uint8_t> raw;
  raw.reserve(static_cast<size_t>(h) * (1 + 3 * static_cast<size_t>(w)));
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);
    const uint8_t* row = image.rgb().data() + static_cast<size_t>(y) * w * 3;
    raw.insert(raw.end(), row, row + static_cast<size_t>(w) * 3);
  }
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::vector<uint8_t> packed(packed_size);
  const int z = compress2(packed.data(), &packed_size, raw.data(), static_cast<uLong>(raw.size()), Z_BEST_COMPRESSION);
  MOE_CHECK(z == Z_OK, "encode_png: zlib compress2 failed (", z, ")");
  packed.resize(packed_size);

  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  put_u32(ihdr, static_cast<uint32_t>(w));
  put_u32(ihdr, static_cast<uint32_t>(h));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // bit depth 8, colour type 2 (RGB), deflate, filter 0, no interlace
  put_chunk(png, "IHDR", ihdr);
  put_chunk(png, "IDAT", packed);
  put_chunk(png, "IEND", {});
  return png;
}

void write_png(const std::string& path, const Image& image) {
  const std::vector<uint8_t> bytes = encode_png(image);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  MOE_CHECK(f.good(), "argument 'png': cannot open '", path, "' for writing");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  f.close();
  MOE_CHECK(!f.fail(), "argument 'png': writing '", path, "' failed");
}

}  // namespace moe::bench
