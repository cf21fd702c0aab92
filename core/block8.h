// Blockwise 8-bit optimizer state (DType::kBlock8): the code of one
// element, and the block rule every backend, state read and checkpoint
// converter follows. See docs/block8_moments.md for the design.
//
// A state slot of kBlock8 holds one byte per element and, per block of
// kBlock8Elements consecutive elements of a tensor (the last block may be
// shorter), one fp32 scale: the largest magnitude in the block. An element
// is stored as an 8-bit minifloat of value * (1 / scale), which lies in
// [-1, 1] (the reciprocal is rounded once per block, Block8MultiplierOf):
//  - signed slots (exp_avg): a sign bit and a 7-bit magnitude with 4
//    exponent and 3 mantissa bits, values down to 2^-17;
//  - unsigned slots (exp_avg_sq, never negative): 5 exponent and 3 mantissa
//    bits, values down to 2^-33, since the second moment spans a far wider
//    range within a block than the first.
// Rounding is to nearest, ties to even, by integer operations on the
// float's bits (and, below the normal range, one exact fp32 addition);
// the value read back is the code's value times the scale
// (one fp32 multiply). Every step is exact or one correctly rounded IEEE
// operation, so plain C++ and CUDA (-fmad=false) give the same bits.
//
// Pure functions; thread-compatible.
#ifndef OPTIMD_CORE_BLOCK8_H_
#define OPTIMD_CORE_BLOCK8_H_

#include <cstdint>

#include "core/dtype.h"
#include "core/step_math.h"

namespace optimd {

// Elements per scale. Plans split tensors at multiples of it (BuildPlan),
// so one unit of work always holds whole blocks.
inline constexpr uint64_t kBlock8Elements = 256;

// Blocks (scales per slot) of a tensor of `n` elements.
OPTIMD_HOST_DEVICE inline uint64_t Block8Blocks(uint64_t n) {
  return (n + kBlock8Elements - 1) / kBlock8Elements;
}

namespace block8 {

OPTIMD_HOST_DEVICE inline uint32_t Bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return FloatBits(f);
#endif
}

OPTIMD_HOST_DEVICE inline float FromBits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return BitsToFloat(u);
#endif
}

constexpr int kMantissaBits = 3;

// The code of |x| (sign ignored; NaN and values above 1 read as 1) in an
// unsigned minifloat with kExp exponent bits and 3 mantissa bits, whose
// largest exponent holds [1, 2): codes 0 .. (2^kExp - 1) << 3. Both
// roundings are computed and one is selected, with no branch: a branch
// that lanes of a warp take differently costs the CUDA kernels both paths
// and their reconvergence.
template <int kExp>
OPTIMD_HOST_DEVICE inline uint32_t EncodeUnit(float x) {
  constexpr uint32_t kMaxExp = (1u << kExp) - 1;
  constexpr int kShift = 23 - kMantissaBits;
  uint32_t u = Bits(x) & 0x7fffffffu;
  if (!(u <= 0x3f800000u)) u = 0x3f800000u;  // NaN or above 1: 1
  // Normal: round the mantissa to 3 bits (a carry bumps the exponent),
  // then rebias the exponent from 127 to kMaxExp.
  const uint32_t r = u + ((1u << (kShift - 1)) - 1) + ((u >> kShift) & 1u);
  const uint32_t normal = (r >> kShift) - ((127u - kMaxExp) << kMantissaBits);
  // Subnormal: multiples of 2^(1 - kMaxExp - 3). q is |x| scaled by a
  // power of two (exact), at most 8 there; adding 2^23 rounds it to an
  // integer, to nearest even, which the sum's low mantissa bits then hold.
  const float q =
      FromBits(u) * FromBits((127u + kMaxExp - 1 + kMantissaBits) << 23);
  const uint32_t subnormal = Bits(q + 8388608.0f) - 0x4b000000u;
  return (u >> 23) >= 128 - kMaxExp ? normal : subnormal;
}

// The value of code c of EncodeUnit<kExp>: the normal value from its bits,
// or below them m multiples of 2^(1 - kMaxExp - 3) (the difference of two
// normal values, exact); selected with no branch, as EncodeUnit.
template <int kExp>
OPTIMD_HOST_DEVICE inline float DecodeUnit(uint32_t c) {
  constexpr uint32_t kMaxExp = (1u << kExp) - 1;
  constexpr uint32_t kMinNormal = (128u - kMaxExp) << 23;
  const uint32_t e = c >> kMantissaBits;
  const uint32_t m = c & ((1u << kMantissaBits) - 1);
  const uint32_t mantissa = m << (23 - kMantissaBits);
  const float normal = FromBits(((e + 127u - kMaxExp) << 23) | mantissa);
  const float subnormal =
      FromBits(kMinNormal | mantissa) - FromBits(kMinNormal);
  return e != 0 ? normal : subnormal;
}

}  // namespace block8

// exp_avg's code: sign bit 7, magnitude EncodeUnit<4>. Zero keeps its sign
// bit only in the code; it reads back as zero.
OPTIMD_HOST_DEVICE inline uint8_t EncodeSigned8(float x) {
  const uint32_t sign = (block8::Bits(x) >> 24) & 0x80u;
  return static_cast<uint8_t>(sign | block8::EncodeUnit<4>(x));
}

OPTIMD_HOST_DEVICE inline float DecodeSigned8(uint8_t c) {
  const float mag = block8::DecodeUnit<4>(c & 0x7fu);
  return (c & 0x80u) != 0 ? -mag : mag;
}

// exp_avg_sq's code: EncodeUnit<5> of |x|.
OPTIMD_HOST_DEVICE inline uint8_t EncodeUnsigned8(float x) {
  return static_cast<uint8_t>(block8::EncodeUnit<5>(x));
}

OPTIMD_HOST_DEVICE inline float DecodeUnsigned8(uint8_t c) {
  return block8::DecodeUnit<5>(c);
}

// True when c is a code the encoders can write: magnitudes up to 1
// (0x78 signed, 0xf8 unsigned). Checkpoint loads refuse others: they
// would read back above their block's scale, which the block rule keeps
// the largest magnitude, and exp_avg's 0x7f and 0xff are NaN as e4m3fn
// codes; no writer produces any of them.
OPTIMD_HOST_DEVICE inline bool Block8CodeIsValid(bool is_signed, uint8_t c) {
  return is_signed ? (c & 0x7fu) <= 0x78u : c <= 0xf8u;
}

// The larger of a block's running maximum and |x|; NaN wins. Magnitudes
// only, so the result is the same in any order of the block's elements
// (NaNs are made canonical by Block8Scale).
OPTIMD_HOST_DEVICE inline float Block8Max(float running, float x) {
  const float a = block8::FromBits(block8::Bits(x) & 0x7fffffffu);
  return (a > running || a != a) ? a : running;
}

// The scale stored for a block whose Block8Max over its values is `max`:
// `max` itself, NaN made canonical.
OPTIMD_HOST_DEVICE inline float Block8Scale(float max) {
  return max != max ? block8::FromBits(0x7fc00000u) : max;
}

// What a block of scale `scale` multiplies its values by before encoding,
// in two steps: by `pre`, 2^64 for a scale below 2^-64 (whose reciprocal
// could overflow) and else 1, which is exact since the block's values are
// at most its scale; then by mul = 1 / (scale * pre), one division per
// block, so that an element costs two multiplies and no division. mul is
// 0 for a zero scale (an all-zero block, whose codes are then zeros) and
// for an infinite one.
struct Block8Multiplier {
  float pre;
  float mul;
};
OPTIMD_HOST_DEVICE inline Block8Multiplier Block8MultiplierOf(float scale) {
  const float pre = scale < block8::FromBits(0x1f800000u)  // 2^-64
                        ? block8::FromBits(0x5f800000u)    // 2^64
                        : 1.0f;
  return {pre, scale == 0.0f ? 0.0f : 1.0f / (scale * pre)};
}

// The code of x in a block whose multiplier is `k` (kSigned: exp_avg): the
// code of (x * k.pre) * k.mul, which lies in [-1, 1] up to the product's
// rounding (above 1 and NaN read as 1), with x's sign bit (none for a NaN
// x): an infinite x in a block of infinite scale gives inf * 0, a NaN
// whose sign differs between machines.
template <bool kSigned>
OPTIMD_HOST_DEVICE inline uint8_t Block8Encode(float x, Block8Multiplier k) {
  const float unit = (x * k.pre) * k.mul;
  if (!kSigned) return EncodeUnsigned8(unit);
  const uint32_t sign = x == x ? (block8::Bits(x) >> 24) & 0x80u : 0u;
  return static_cast<uint8_t>(sign | block8::EncodeUnit<4>(unit));
}

template <bool kSigned>
OPTIMD_HOST_DEVICE inline float Block8Decode(uint8_t c, float scale) {
  return (kSigned ? DecodeSigned8(c) : DecodeUnsigned8(c)) * scale;
}

// Shortcuts the CUDA step takes where a test made once for a block shows
// that they give the codec's own bits (core/block8_test and, on the GPU,
// tests/cuda_math_test check them).
//
// Block8Decode in one multiplication: the code's bits placed as a float's
// exponent and mantissa (the signed code's sign bit as the float's; the
// codes' subnormals are the float's subnormals), times the scale folded
// with the power of two that takes those bits to the code's value
// (2^(127 - 15) signed, 2^(127 - 31) unsigned). That is the same real
// product, rounded once, so the same float as code value times scale,
// where the folded scale is exact: for scales below the limits (a
// power-of-two multiple of a finite float that stays finite).
inline constexpr float kSigned8FoldLimit = 0x1p16f;
inline constexpr float kUnsigned8FoldLimit = 0x1p32f;
OPTIMD_HOST_DEVICE inline float FoldedSigned8Scale(float scale) {
  return scale * 0x1p112f;
}
OPTIMD_HOST_DEVICE inline float FoldedUnsigned8Scale(float scale) {
  return scale * 0x1p96f;
}
OPTIMD_HOST_DEVICE inline float DecodeSigned8Folded(uint8_t c, float folded) {
  const uint32_t u = c;
  return block8::FromBits(((u & 0x7fu) << 20) | ((u & 0x80u) << 24)) * folded;
}
OPTIMD_HOST_DEVICE inline float DecodeUnsigned8Folded(uint8_t c, float folded) {
  return block8::FromBits(static_cast<uint32_t>(c) << 20) * folded;
}

// EncodeUnsigned8 of a unit of at least 2^-30 (the code set's normal range;
// not a NaN): EncodeUnit<5>'s integer rounding alone, without its subnormal
// arm and the choice between the two.
inline constexpr uint32_t kUnsigned8NormalLow = 97u << 23;  // 2^-30
OPTIMD_HOST_DEVICE inline uint8_t EncodeUnsigned8Normal(float unit) {
  uint32_t u = block8::Bits(unit);
  if (u > 0x3f800000u) u = 0x3f800000u;  // above 1: 1
  const uint32_t r = u + 0x7ffffu + ((u >> 20) & 1u);
  return static_cast<uint8_t>((r >> 20) - (96u << 3));
}

// Host helpers for state reads, writes and tests: one block of n <=
// kBlock8Elements values to codes and scale, and back.
inline float QuantizeBlock8(bool is_signed, const float* x, uint64_t n,
                            uint8_t* codes) {
  float max = 0.0f;
  for (uint64_t i = 0; i < n; ++i) max = Block8Max(max, x[i]);
  const float scale = Block8Scale(max);
  const Block8Multiplier k = Block8MultiplierOf(scale);
  for (uint64_t i = 0; i < n; ++i) {
    codes[i] =
        is_signed ? Block8Encode<true>(x[i], k) : Block8Encode<false>(x[i], k);
  }
  return scale;
}

inline void DequantizeBlock8(bool is_signed, const uint8_t* codes, uint64_t n,
                             float scale, float* x) {
  for (uint64_t i = 0; i < n; ++i) {
    x[i] = is_signed ? Block8Decode<true>(codes[i], scale)
                     : Block8Decode<false>(codes[i], scale);
  }
}

}  // namespace optimd

#endif  // OPTIMD_CORE_BLOCK8_H_
