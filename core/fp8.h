// FP8 parameters (docs/fp8_parameters.md): the element codecs of
// float8_e4m3fn and float8_e5m2, and the rules that turn a scaling unit's
// amax into its scale. Host-device functions written with integer
// operations and correctly rounded fp32 operations only, so that the CPU
// reference and the CUDA kernel (-fmad=false) give the same bits.
//
// Pure functions; thread-compatible.
#ifndef OPTIMD_CORE_FP8_H_
#define OPTIMD_CORE_FP8_H_

#include <cstdint>

#include "core/block8.h"
#include "core/step_math.h"

namespace optimd {

// One FP8 format: exponent bias, mantissa bits, its largest finite code
// (sign bit clear) and value, and the code a NaN gets.
struct Fp8Format {
  uint32_t bias;
  uint32_t mantissa_bits;
  uint32_t max_code;
  float max_value;
  uint32_t nan_code;
};

// float8_e4m3fn: no infinities, S.1111.111 is NaN, largest 448.
inline constexpr Fp8Format kE4M3 = {7, 3, 0x7e, 448.0f, 0x7f};
// float8_e5m2: IEEE-like, largest finite 57344 (codes 0x7c.. are inf/NaN).
inline constexpr Fp8Format kE5M2 = {15, 2, 0x7b, 57344.0f, 0x7f};

// x rounded to nearest (ties to even) in format F, saturating: a finite
// value or infinity beyond the largest finite value becomes the largest
// finite value of its sign; NaN becomes F.nan_code with x's sign.
template <const Fp8Format& F>
OPTIMD_HOST_DEVICE inline uint8_t EncodeFp8(float x) {
  const uint32_t u = block8::Bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | F.nan_code);
  const uint32_t shift = 23 - F.mantissa_bits;
  const uint32_t min_normal_exp = 128 - F.bias;  // fp32 exponent of 2^(1-bias)
  uint32_t code;
  if ((a >> 23) >= min_normal_exp) {
    // Normal: round the mantissa on the bits (a carry bumps the exponent),
    // then rebias; infinity and overflow end above max_code.
    const uint32_t r = a + ((1u << (shift - 1)) - 1) + ((a >> shift) & 1u);
    code = (r >> shift) - ((127u - F.bias) << F.mantissa_bits);
    if (code > F.max_code) code = F.max_code;
  } else {
    // Subnormal: multiples of 2^(1 - bias - mantissa_bits). q is |x| times a
    // power of two (exact), below 2^mantissa_bits; its integer part and
    // fraction are exact. Rounding up out of this range gives the smallest
    // normal code, as it should.
    const float q =
        block8::FromBits(a) *
        block8::FromBits((127u + F.bias - 1 + F.mantissa_bits) << 23);
    const uint32_t whole = static_cast<uint32_t>(q);
    const float frac = q - static_cast<float>(whole);
    const bool up = frac > 0.5f || (frac == 0.5f && (whole & 1u) != 0);
    code = whole + (up ? 1u : 0u);
  }
  return static_cast<uint8_t>(sign | code);
}

// The value of an FP8 code, exactly (every FP8 value is an fp32 value).
template <const Fp8Format& F>
OPTIMD_HOST_DEVICE inline float DecodeFp8(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t mag = c & 0x7fu;
  const uint32_t e = mag >> F.mantissa_bits;
  const uint32_t m = mag & ((1u << F.mantissa_bits) - 1);
  if (mag > F.max_code) {
    // e4m3fn: only 0x7f (NaN); e5m2: 0x7c is infinity, above it NaN.
    const bool inf = F.bias == 15 && mag == 0x7cu;
    return block8::FromBits(sign | (inf ? 0x7f800000u : 0x7fc00000u));
  }
  if (e == 0) {
    const float v =
        static_cast<float>(m) *
        block8::FromBits((127u + 1 - F.bias - F.mantissa_bits) << 23);
    return sign ? -v : v;
  }
  return block8::FromBits(sign | ((e + 127u - F.bias) << 23) |
                          (m << (23 - F.mantissa_bits)));
}

// A scaling unit's running amax: the larger of `running` and |x|, NaN
// winning, the same in any order (the rule of Block8Max).
OPTIMD_HOST_DEVICE inline float Fp8Amax(float running, float x) {
  return Block8Max(running, x);
}

// The fp32 scale of a unit (per-tensor and block recipes): values are
// stored as Encode(x * scale), read as Decode(code) * scale_inv with
// scale_inv = 1 / scale. scale = max_value / amax, correctly rounded;
// an infinite quotient (tiny amax) becomes the largest finite float;
// with `pow2` it is then rounded down to a power of two. An amax of zero,
// infinity or NaN gives scale 1.
OPTIMD_HOST_DEVICE inline float Fp8Scale(float amax, float max_value,
                                         bool pow2) {
  if (!(amax > 0.0f) || amax == block8::FromBits(0x7f800000u)) return 1.0f;
  float scale = max_value / amax;
  if (scale == block8::FromBits(0x7f800000u))
    scale = block8::FromBits(0x7f7fffffu);
  if (pow2) scale = block8::FromBits(block8::Bits(scale) & 0xff800000u);
  return scale;
}

// MXFP8's shared exponent (an e8m0 code, biased by 127) of a 32-element
// block whose amax is `amax`, as Transformer Engine chooses it: the
// power of two at or above amax * (1 / max_value), so that no element
// saturates. NaN gives 0xff (the e8m0 NaN), infinity 0xfe, zero 0.
OPTIMD_HOST_DEVICE inline uint8_t Fp8E8M0(float amax, float max_value) {
  if (amax != amax) return 0xff;
  if (amax == block8::FromBits(0x7f800000u)) return 0xfe;
  const float v = amax * (1.0f / max_value);
  if (v == 0.0f) return 0;
  const uint32_t u = block8::Bits(v);
  uint32_t exponent = u >> 23;
  const uint32_t mantissa = u & 0x7fffffu;
  // Round the exponent up unless v is a power of two; a subnormal v of at
  // most 2^-127 stays at code 0, and 0xfe is the largest code.
  if (mantissa > 0 && exponent != 0xfe &&
      !(exponent == 0 && mantissa <= 0x400000u)) {
    ++exponent;
  }
  return static_cast<uint8_t>(exponent);
}

// 2^(code - 127), the value an e8m0 code stands for (NaN for 0xff).
OPTIMD_HOST_DEVICE inline float E8M0Value(uint8_t code) {
  if (code == 0xff) return block8::FromBits(0x7fc00000u);
  if (code == 0) return block8::FromBits(0x00400000u);  // 2^-127, subnormal
  return block8::FromBits(static_cast<uint32_t>(code) << 23);
}

// What MXFP8 multiplies a block's values by before encoding them:
// 2^(127 - code), exact (1 for the NaN code: the block reads back as NaN
// through its scale anyway).
OPTIMD_HOST_DEVICE inline float E8M0Multiplier(uint8_t code) {
  if (code == 0xff) return 1.0f;
  if (code == 0xfe) return block8::FromBits(0x00400000u);  // 2^-127
  return block8::FromBits((254u - code) << 23);
}

}  // namespace optimd

#endif  // OPTIMD_CORE_FP8_H_
