// A 5x7 pixel font for the labels of the benchmark charts: digits, letters (lower case drawn as
// upper case), space and - . , / : ( ) = % + _ ; any other character is drawn as a box.
#pragma once

#include <string>

#include "support/png_writer.h"

namespace moe::bench {

constexpr int kGlyphWidth = 5, kGlyphHeight = 7, kGlyphAdvance = 6;  // advance: glyph + one column

// Draws `text` with its top-left corner at (x, y), each font pixel a scale x scale square. With
// `vertical` the text is turned a quarter counter-clockwise and reads upwards from (x, y), which is
// then its bottom-left corner.
void draw_text(Image& image, int x, int y, const std::string& text, Rgb color, int scale = 1, bool vertical = false);
// Extent of draw_text along its reading direction, and across it.
inline int text_length(const std::string& text, int scale = 1) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * kGlyphAdvance - 1) * scale;
}
inline int text_height(int scale = 1) { return kGlyphHeight * scale; }

}  // namespace moe::bench
