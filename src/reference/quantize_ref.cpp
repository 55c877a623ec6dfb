#include "reference/quantize_ref.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "moe/error.h"
#include "moe/float_convert.h"

namespace moe::ref {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

constexpr double kE2M1Grid[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

// Largest grid index c with grid[c] <= a (a in [0, 6)).
int e2m1_floor_index(double a) {
  int c = 0;
  while (c < 7 && kE2M1Grid[c + 1] <= a) ++c;
  return c;
}

}  // namespace

uint8_t e4m3_from_double(double x) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7E;  // saturate (also inf): nothing above 448 is finite
  // The spacing of E4M3 numbers around a: 2^-9 among subnormals (a < 2^-6), 2^(floor(log2 a) - 3) above.
  double quantum;
  if (a < std::ldexp(1.0, -6)) {
    quantum = std::ldexp(1.0, -9);
  } else {
    int ex;
    std::frexp(a, &ex);  // a = m * 2^ex, m in [0.5, 1): floor(log2 a) = ex - 1
    quantum = std::ldexp(1.0, ex - 1 - 3);
  }
  const double v = std::nearbyint(a / quantum) * quantum;  // exact; ties to even (default mode)
  if (v < std::ldexp(1.0, -6)) return sign | static_cast<uint8_t>(v / std::ldexp(1.0, -9));  // 8 is 2^-6
  int ex;
  std::frexp(v, &ex);
  const int E = ex - 1 + 7;
  const int M = static_cast<int>((v / std::ldexp(1.0, ex - 1) - 1.0) * 8.0);
  return sign | static_cast<uint8_t>(E << 3 | M);
}

double e4m3_to_double(uint8_t code) {
  const int E = (code >> 3) & 0xF, M = code & 7;
  if (E == 15 && M == 7) return std::nan("");
  const double mag = E == 0 ? std::ldexp(M, -9) : std::ldexp(1.0 + M / 8.0, E - 7);
  return (code & 0x80) ? -mag : mag;
}

uint8_t e2m1_from_float_rn(float v) {
  if (std::isnan(v)) return 0;
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= 6.0) return sign | 7;
  const int c = e2m1_floor_index(a);
  const double lo = kE2M1Grid[c], hi = kE2M1Grid[c + 1], mid = (lo + hi) / 2;
  int r;
  if (a < mid)
    r = c;
  else if (a > mid)
    r = c + 1;
  else
    r = (c % 2 == 0) ? c : c + 1;  // tie: the even code
  return sign | static_cast<uint8_t>(r);
}

uint8_t e2m1_from_float_sr(float v, uint32_t rbits) {
  if (std::isnan(v)) return 0;
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const double a = std::fabs(static_cast<double>(v));
  if (a >= 6.0) return sign | 7;
  const int c = e2m1_floor_index(a);
  const double frac = (a - kE2M1Grid[c]) / (kE2M1Grid[c + 1] - kE2M1Grid[c]);  // exact
  const bool up = static_cast<double>(rbits >> 8) < frac * 16777216.0;
  return sign | static_cast<uint8_t>(up ? c + 1 : c);
}

double e2m1_to_double(uint8_t nibble) {
  const double mag = kE2M1Grid[nibble & 7];
  return (nibble & 8) ? -mag : mag;
}

uint8_t e8m0_from_amax(float amax) {
  if (std::isnan(amax)) return 255;
  if (std::isinf(amax)) return 254;
  const float v = amax / 448.0f;  // one fp32 division, as the rule says
  if (v == 0.0f) return 0;
  int ex;
  const double m = std::frexp(static_cast<double>(v), &ex);  // v = m * 2^ex exactly
  int c = (m == 0.5) ? ex - 1 : ex;                          // ceil(log2 v)
  if (c < -127) c = -127;
  if (c > 127) c = 127;
  return static_cast<uint8_t>(c + 127);
}

double e8m0_to_double(uint8_t e) { return e == 255 ? std::nan("") : std::ldexp(1.0, e - 127); }

float abs_max(const float* v, int64_t n, int64_t stride) {
  uint32_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = float_bits(v[i * stride]) & 0x7FFFFFFFu;
    if (b > best) best = b;
  }
  return float_from_bits(best);
}

float fp8_block_scale(float amax, bool pow2) {
  if (amax == 0.0f || !std::isfinite(amax)) return 1.0f;
  float s = 448.0f / amax;
  if (std::isinf(s)) s = FLT_MAX;
  if (pow2) s = float_from_bits(float_bits(s) & 0xFF800000u);  // s is a positive normal number
  return s;
}

float nvfp4_global_scale(float global_amax) {
  if (global_amax == 0.0f || !std::isfinite(global_amax)) return 1.0f;
  float s = 2688.0f / global_amax;
  if (std::isinf(s)) s = FLT_MAX;
  return s;
}

uint8_t nvfp4_block_scale(float block_amax, float S) {
  const float t = block_amax * S;
  const float sf = t / 6.0f;
  return e4m3_from_double(sf);
}

void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {  // the key schedule bumps the key before rounds 2..10
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0;
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c0 = n0;
    c1 = static_cast<uint32_t>(p1);
    c2 = n2;
    c3 = static_cast<uint32_t>(p0);
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

uint32_t sr_random_bits(uint64_t seed, uint64_t offset, int copy, uint64_t index) {
  const uint64_t g = index / 4;
  const uint32_t ctr[4] = {static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32) | (uint32_t(copy) << 31),
                           static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
  const uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  uint32_t out[4];
  philox4x32_10(ctr, key, out);
  return out[index % 4];
}

int64_t scale_index(ScaleLayout layout, int64_t r, int64_t j, int64_t block_rows, int64_t block_cols) {
  switch (layout) {
    case ScaleLayout::kRowMajor: return r * block_cols + j;
    case ScaleLayout::kMNMajor: return j * round_up(block_rows, 4) + r;
    case ScaleLayout::kSwizzled128x4: {
      const int64_t tiles_per_row = round_up(block_cols, 4) / 4;
      const int64_t tile = (r / 128) * tiles_per_row + j / 4;
      return tile * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4;
    }
  }
  detail::throw_error("scale_index: unknown layout");
}

namespace {

struct CopyGeometry {
  int64_t rows, cols;              // storage of one matrix's copy
  int64_t block_rows, block_cols;  // blocks (2-D: row blocks)
  int64_t scale_entries;           // per matrix, including layout padding
  ScaleLayout layout;              // of the scales
  int scale_bytes;                 // per entry
  int64_t data_bytes;              // per matrix
};

CopyGeometry geometry(const QuantConfig& c, bool columnwise, int64_t M, int64_t K) {
  CopyGeometry g;
  g.rows = columnwise ? K : M;
  g.cols = columnwise ? M : K;
  const int64_t b = quant_block_size(c.format);
  g.block_rows = c.blocking == QuantBlocking::k2D ? ceil_div(g.rows, b) : g.rows;
  g.block_cols = ceil_div(g.cols, b);
  const ScaleShape s = scale_shape(c, g.rows, g.cols, columnwise);
  g.layout = copy_scale_layout(c, columnwise);
  g.scale_entries = s.rows * s.cols;
  g.scale_bytes = c.format == QuantFormat::kFP8Block ? 4 : 1;
  g.data_bytes = c.format == QuantFormat::kNVFP4 ? (g.rows * g.cols + 1) / 2 : g.rows * g.cols;
  return g;
}

}  // namespace

Quantized quantize(const QuantConfig& c, const std::vector<uint16_t>& x, int64_t B, int64_t M, int64_t K) {
  std::vector<float> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf16_bits_to_float(x[i]);
  return quantize_fp32(c, xf, B, M, K);
}

Quantized quantize_fp32(const QuantConfig& c, const std::vector<float>& xf, int64_t B, int64_t M, int64_t K) {
  validate_quant_config(c);
  MOE_CHECK(static_cast<int64_t>(xf.size()) == B * M * K, "ref::quantize: x has ", xf.size(), " elements, expected ",
            B * M * K);
  const int64_t b = quant_block_size(c.format);
  const bool two_d = c.blocking == QuantBlocking::k2D;

  Quantized q;
  std::vector<float> S(B, 1.0f);
  if (c.format == QuantFormat::kNVFP4) {
    q.global_amax.resize(B);
    for (int64_t m = 0; m < B; ++m) {
      q.global_amax[m] = abs_max(xf.data() + m * M * K, M * K);
      S[m] = nvfp4_global_scale(q.global_amax[m]);
    }
  }

  for (int copy = 0; copy < 2; ++copy) {
    const bool columnwise = copy == 1;
    if (columnwise ? !c.columnwise : !c.rowwise) continue;
    const CopyGeometry g = geometry(c, columnwise, M, K);
    std::vector<uint8_t>& data = columnwise ? q.columnwise_data : q.rowwise_data;
    std::vector<uint8_t>& scales = columnwise ? q.columnwise_scale : q.rowwise_scale;
    data.assign(B * g.data_bytes, 0);
    scales.assign(B * g.scale_entries * g.scale_bytes, 0);
    // Element (r, col) of this copy of matrix m, and its flat position in the source x.
    auto src = [&](int64_t m, int64_t r, int64_t col) {
      return columnwise ? (m * M + col) * K + r : (m * M + r) * K + col;
    };
    for (int64_t m = 0; m < B; ++m) {
      for (int64_t br = 0; br < g.block_rows; ++br) {
        const int64_t r0 = two_d ? br * b : br, r1 = two_d ? std::min(g.rows, r0 + b) : br + 1;
        for (int64_t j = 0; j < g.block_cols; ++j) {
          const int64_t c0 = j * b, c1 = std::min(g.cols, c0 + b);
          uint32_t amax_bits = 0;
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t col = c0; col < c1; ++col) {
              const float v = xf[src(m, r, col)];
              amax_bits = std::max(amax_bits, float_bits(v) & 0x7FFFFFFFu);  // as abs_max
            }
          const float amax = float_from_bits(amax_bits);
          // The block's encode rule and its stored scale bytes.
          uint8_t scale_bytes[4] = {0, 0, 0, 0};
          float fp8_scale = 1.0f, mx_factor = 1.0f, nv_enc = 0.0f;
          if (c.format == QuantFormat::kFP8Block) {
            fp8_scale = fp8_block_scale(amax, c.pow2_scale);
            const float scale_inv = 1.0f / fp8_scale;
            std::memcpy(scale_bytes, &scale_inv, 4);
          } else if (c.format == QuantFormat::kMXFP8) {
            const uint8_t e = e8m0_from_amax(amax);
            mx_factor = static_cast<float>(std::ldexp(1.0, 127 - e));  // 2^-128 .. 2^127, exact in fp32
            scale_bytes[0] = e;
          } else {
            const uint8_t s = nvfp4_block_scale(amax, S[m]);
            const float sf = static_cast<float>(e4m3_to_double(s));
            nv_enc = sf > 0.0f ? S[m] / sf : 0.0f;  // a zero (or NaN) block scale encodes everything as 0
            scale_bytes[0] = s;
          }
          const int64_t si = m * g.scale_entries + scale_index(g.layout, br, j, g.block_rows, g.block_cols);
          std::memcpy(&scales[si * g.scale_bytes], scale_bytes, g.scale_bytes);
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t col = c0; col < c1; ++col) {
              const float v = xf[src(m, r, col)];
              const int64_t pos = r * g.cols + col;  // within this matrix's copy
              if (c.format == QuantFormat::kFP8Block) {
                data[m * g.data_bytes + pos] = e4m3_from_double(v * fp8_scale);
              } else if (c.format == QuantFormat::kMXFP8) {
                data[m * g.data_bytes + pos] = e4m3_from_double(v * mx_factor);
              } else {
                const float scaled = v * nv_enc;
                uint8_t nib;
                if (c.stochastic_rounding) {
                  // 2-D blocks: both copies round with the bits of the rowwise position, so the
                  // columnwise copy stays the exact transpose of the rowwise one.
                  const bool from_rowwise = two_d || !columnwise;
                  const uint64_t index = from_rowwise ? static_cast<uint64_t>(src(m, r, col))
                                                      : static_cast<uint64_t>(m * g.rows * g.cols + pos);
                  nib = e2m1_from_float_sr(scaled, sr_random_bits(c.seed, c.offset, from_rowwise ? 0 : 1, index));
                } else {
                  nib = e2m1_from_float_rn(scaled);
                }
                uint8_t& byte = data[m * g.data_bytes + pos / 2];
                byte = (pos % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0) | nib)
                                      : static_cast<uint8_t>((byte & 0x0F) | (nib << 4));
              }
            }
        }
      }
    }
  }
  return q;
}

std::vector<float> dequantize(const QuantConfig& c, const Quantized& q, bool columnwise, int64_t B, int64_t M,
                              int64_t K) {
  validate_quant_config(c);
  const CopyGeometry g = geometry(c, columnwise, M, K);
  const std::vector<uint8_t>& data = columnwise ? q.columnwise_data : q.rowwise_data;
  const std::vector<uint8_t>& scales = columnwise ? q.columnwise_scale : q.rowwise_scale;
  MOE_CHECK(static_cast<int64_t>(data.size()) == B * g.data_bytes &&
                static_cast<int64_t>(scales.size()) == B * g.scale_entries * g.scale_bytes,
            "ref::dequantize: the ", columnwise ? "columnwise" : "rowwise", " copy is missing or has the wrong size");
  const int64_t b = quant_block_size(c.format);
  const bool two_d = c.blocking == QuantBlocking::k2D;
  std::vector<float> out(B * g.rows * g.cols);
  for (int64_t m = 0; m < B; ++m) {
    const float S = c.format == QuantFormat::kNVFP4 ? nvfp4_global_scale(q.global_amax.at(m)) : 1.0f;
    for (int64_t r = 0; r < g.rows; ++r)
      for (int64_t col = 0; col < g.cols; ++col) {
        const int64_t br = two_d ? r / b : r, j = col / b;
        const int64_t si = m * g.scale_entries + scale_index(g.layout, br, j, g.block_rows, g.block_cols);
        const int64_t pos = r * g.cols + col;
        float d, v;
        if (c.format == QuantFormat::kFP8Block) {
          std::memcpy(&d, &scales[si * 4], 4);
          v = static_cast<float>(e4m3_to_double(data[m * g.data_bytes + pos]));
        } else if (c.format == QuantFormat::kMXFP8) {
          d = static_cast<float>(e8m0_to_double(scales[si]));
          v = static_cast<float>(e4m3_to_double(data[m * g.data_bytes + pos]));
        } else {
          d = static_cast<float>(e4m3_to_double(scales[si])) / S;
          const uint8_t byte = data[m * g.data_bytes + pos / 2];
          v = static_cast<float>(e2m1_to_double(pos % 2 == 0 ? byte & 0xF : byte >> 4));
        }
        out[m * g.rows * g.cols + pos] = v * d;
      }
  }
  return out;
}

std::vector<float> fake_quantize_groups(const QuantConfig& c, bool columnwise, const std::vector<float>& x,
                                        int64_t rows, int64_t cols, const std::vector<int64_t>& offsets) {
  MOE_CHECK(c.blocking == QuantBlocking::k1D, "ref::fake_quantize_groups: token operands take 1-D blocks");
  MOE_CHECK(static_cast<int64_t>(x.size()) == rows * cols, "ref::fake_quantize_groups: x has ", x.size(),
            " elements, expected ", rows * cols);
  QuantConfig one = c;
  one.rowwise = !columnwise;
  one.columnwise = columnwise;
  one.scale_layout = ScaleLayout::kRowMajor;
  one.columnwise_scale_layout.reset();
  std::vector<float> out(x.size(), 0.0f);
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    MOE_CHECK(0 <= offsets[e] && offsets[e] <= offsets[e + 1] && offsets[e + 1] <= rows,
              "ref::fake_quantize_groups: offsets must be non-decreasing within [0, rows = ", rows, "], got offsets[",
              e, "] = ", offsets[e], ", offsets[", e + 1, "] = ", offsets[e + 1]);
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    const std::vector<float> m(x.begin() + r0 * cols, x.begin() + (r0 + n) * cols);
    const std::vector<float> d = dequantize(one, quantize_fp32(one, m, 1, n, cols), columnwise, 1, n, cols);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < cols; ++j) out[(r0 + r) * cols + j] = columnwise ? d[j * n + r] : d[r * cols + j];
  }
  return out;
}

}  // namespace moe::ref
