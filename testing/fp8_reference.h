// FP8 written out from the formats' definitions and the recipes' rules in
// double arithmetic, independently of core/fp8.h: what tests check the
// codecs, scales and quantized steps against.
//
// Pure functions; thread-compatible.
#ifndef OPTIMD_TESTING_FP8_REFERENCE_H_
#define OPTIMD_TESTING_FP8_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <limits>

namespace optimd {
namespace fp8_reference {

// (exponent bits, mantissa bits, bias); e4m3fn has no infinities and one
// NaN per sign (S.1111.111).
struct Format {
  int exp_bits, man_bits, bias;
  bool fn;
  double max_value;
};
inline constexpr Format kE4M3 = {4, 3, 7, true, 448.0};
inline constexpr Format kE5M2 = {5, 2, 15, false, 57344.0};

// NaN for NaN codes, the signed infinity for e5m2's.
inline double Decode(const Format& f, int code) {
  const int sign = code >> 7;
  const int e = (code >> f.man_bits) & ((1 << f.exp_bits) - 1);
  const int m = code & ((1 << f.man_bits) - 1);
  const int emax = (1 << f.exp_bits) - 1;
  double v;
  if (f.fn && e == emax && m == (1 << f.man_bits) - 1) {
    v = std::nan("");
  } else if (!f.fn && e == emax) {
    v = m == 0 ? INFINITY : std::nan("");
  } else if (e == 0) {
    v = std::ldexp(m, 1 - f.bias - f.man_bits);
  } else {
    v = std::ldexp((1 << f.man_bits) + m, e - f.bias - f.man_bits);
  }
  return sign ? -v : v;
}

// The nearest finite code by exhaustive search, ties to the even code;
// beyond the largest finite value (infinity included) saturates; NaN is
// code 0x7f with x's sign.
inline int Encode(const Format& f, float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  int best = -1;
  double best_d = 0;
  for (int c = 0; c < 128; ++c) {
    const double v = Decode(f, c);
    if (!std::isfinite(v)) continue;
    if (v == f.max_value && a > v) return sign | c;
    const double d = std::fabs(v - a);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | best;
}

// Per-tensor and block scales: max / amax rounded to float (the largest
// float if that overflows), for block recipes 2^floor(log2) of it; 1 for
// an amax of zero, infinity or NaN.
inline float Scale(float amax, double max_value, bool pow2) {
  if (!(amax > 0) || std::isinf(amax)) return 1.0f;
  float s = static_cast<float>(max_value / amax);
  if (std::isinf(s)) s = std::numeric_limits<float>::max();
  if (pow2) {
    int e;
    std::frexp(s, &e);
    s = std::ldexp(1.0f, e - 1);
  }
  return s;
}

// MXFP8's e8m0 code as Transformer Engine chooses it:
// clamp(ceil(log2(amax * (1 / max))) + 127, 0, 254), the product rounded
// to float; 0xff for NaN, 0xfe for infinity.
inline int E8M0(float amax, double max_value) {
  if (std::isnan(amax)) return 0xff;
  if (std::isinf(amax)) return 0xfe;
  const float v = amax * (1.0f / static_cast<float>(max_value));
  if (v == 0) return 0;
  int e;
  const double m = std::frexp(static_cast<double>(v), &e);
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return std::min(254, std::max(0, ceil_log2 + 127));
}

}  // namespace fp8_reference
}  // namespace optimd

#endif  // OPTIMD_TESTING_FP8_REFERENCE_H_
