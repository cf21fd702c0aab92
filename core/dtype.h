// Element types optimd understands, and exact conversions between them.
// Plain C++ so that the CPU reference kernels and the checkpoint code share
// one definition of rounding.
#ifndef OPTIMD_CORE_DTYPE_H_
#define OPTIMD_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/strings/string_view.h"

namespace optimd {

enum class DType : uint8_t {
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  // Optimizer state only: one 8-bit code per element plus one fp32 scale
  // per block of elements (core/block8.h). Never a parameter or gradient.
  kBlock8 = 4,
  // A float64 parameter, its gradient and its moments: stepped in float64,
  // never mixed with the narrower types (ResolveLayout).
  kFloat64 = 5,
  // FP8 parameters only (core/fp8.h), each with a scaling recipe.
  kFloat8E4M3 = 6,
  kFloat8E5M2 = 7,
};

inline bool IsFp8(DType t) {
  return t == DType::kFloat8E4M3 || t == DType::kFloat8E5M2;
}

// Bytes per element; for kBlock8 the code alone (its scales are counted by
// Layout::StateBytes).
inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kFloat64:
      return 8;
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kBlock8:
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
  }
  return 4;
}

// Lower-case names as used in errors, metrics and checkpoints ("float32",
// "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
// matching torch's dtype names, and "block8").
absl::string_view DTypeName(DType t);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float BFloat16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

// Round to nearest, ties to even; NaN stays NaN (quiet), as torch rounds.
// Branch-free so that loops over it vectorize.
inline uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const uint32_t nan = u | 0x00400000u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>((is_nan ? nan : rounded) >> 16);
}

// IEEE binary16 to binary32, exact (subnormals included).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: value = mant * 2^-24, exactly representable in fp32.
    float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// IEEE binary32 to binary16, round to nearest, ties to even.
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow rounds to inf
  if (abs < 0x38800000u) {                        // below 2^-14: subnormal
    if (abs < 0x33000000u) return sign;           // below half of 2^-24
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14..24 (+ 10 mantissa)
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

}  // namespace optimd

#endif  // OPTIMD_CORE_DTYPE_H_
