// Device arithmetic shared by the step kernels and their tests.
#ifndef OPTIMD_KERNELS_CUDA_MATH_CUH_
#define OPTIMD_KERNELS_CUDA_MATH_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace optimd {
namespace cuda {

// a / b rounded to nearest even, as IEEE division gives it, for b > 0 and
// rb == RN(1 / b), in three operations instead of a division.
//
// Markstein's theorem: if rb is the correctly rounded reciprocal of b and
// q is within one ulp of a / b, then r = a - b * q is exact (one fma) and
// RN(q + r * rb) is the correctly rounded quotient, unless something
// overflows or r underflows. q = RN(a * rb) is within one ulp. Here a is a
// square root of a float (0 <= a < 2^64), so neither happens: r is at
// least about a * 2^-24 when not zero, a normal
// number for every a >= 2^-75 (and a below that is 0, the square root of
// a subnormal being above 2^-75). b = sqrt(1 - beta2^t) lies in
// (2^-27, 1] for every beta2 in [0, 1) (1 - beta2^t is at least 2^-53 in
// double), so q < 2^91 never overflows. Infinite or NaN a passes through q.
// tests/cuda_math_test (tests/cuda_math_check.cu) compares it with IEEE
// division on every non-negative float for many b.
__device__ __forceinline__ float DivByRecip(float a, float b, float rb) {
  const float q = __fmul_rn(a, rb);
  const float r = __fmaf_rn(-b, q, a);
  const float q1 = __fmaf_rn(r, rb, q);
  return isfinite(q) ? q1 : q;
}

// The bits of the floats SqrtInRange takes: every normal float from 2^-101
// up to the largest finite one, the range in which the hardware's
// reciprocal square root refined by one Newton step and one correction is
// the correctly rounded square root (tests/cuda_math_test compares it with
// IEEE square root on every float of the range).
constexpr uint32_t kSqrtInRangeLow = 0x0d000000u;   // 2^-101
constexpr uint32_t kSqrtInRangeHigh = 0x7f7fffffu;  // FLT_MAX

// sqrt(x), correctly rounded, for x whose bits lie in [kSqrtInRangeLow,
// kSqrtInRangeHigh]: the operations of IEEE square root's common case
// without its per-element range test and branch, which a caller makes once
// for many elements (any other x gives an unspecified result). They are the
// instructions nvcc emits for sqrtf (sm_90: MUFU.RSQ, FMUL.FTZ x * y,
// FMUL.FTZ y * 0.5, FFMA -s * s + x, FFMA r * h + s) where its own test,
// (bits - 0x0d000000) <= 0x727fffff unsigned, passes: the same range.
__device__ __forceinline__ float SqrtInRange(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  const float root = __fmul_rn(x, y);
  const float half_y = __fmul_rn(y, 0.5f);
  const float r = __fmaf_rn(-root, root, x);
  return __fmaf_rn(r, half_y, root);
}

// DivByRecip for a finite a (a square root SqrtInRange took, at most
// 2^64), whose quotient is then finite too: no test of it.
__device__ __forceinline__ float DivByRecipFinite(float a, float b, float rb) {
  const float q = __fmul_rn(a, rb);
  const float r = __fmaf_rn(-b, q, a);
  return __fmaf_rn(r, rb, q);
}

// x rounded to bfloat16, to nearest even, keeping a NaN's sign and payload
// (quieted), bit for bit as the CPU reference rounds.
__device__ __forceinline__ uint16_t Bf16FromFloat(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>((is_nan ? (u | 0x00400000u) : rounded) >> 16);
}

// The fp32 master from its bf16 high half and its 16-bit remainder, as the
// CPU reference's ReconstructFromRemainder gives it, in one multiply-add:
// the remainder is the master's low half read as signed, and the high half
// was rounded up exactly when that is negative, so the master's bits are
// hi * 65536 + remainder modulo 2^32.
__device__ __forceinline__ float ReconstructFromRemainder(uint16_t hi,
                                                          int16_t rem) {
  return __uint_as_float((static_cast<uint32_t>(hi) << 16) +
                         static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

// The inverse, as the CPU reference's SplitToRemainder: adding 0x8000
// carries into the high half exactly when the low half is negative as a
// signed number (modulo 2^32, as the reference's 16-bit wrap-around).
__device__ __forceinline__ void SplitToRemainder(float master, uint16_t* hi,
                                                 int16_t* rem) {
  const uint32_t u = __float_as_uint(master);
  *hi = static_cast<uint16_t>((u + 0x8000u) >> 16);
  *rem = static_cast<int16_t>(static_cast<uint16_t>(u));
}

// Two elements packed in one 32-bit word, the one at the lower address in
// the low half, as a lane of a step kernel loads and stores them.

// RN(lo) and RN(hi) to bfloat16 in one conversion instruction (the same
// rounding as cvt.rn.bf16.f32 of each; tests/cuda_math_test checks it
// against Bf16FromFloat).
__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  uint32_t w;
  memcpy(&w, &b, sizeof(w));
  return w;
}

__device__ __forceinline__ void UnpackBf16x2(uint32_t w, float* lo, float* hi) {
  *lo = __uint_as_float(w << 16);
  *hi = __uint_as_float(w & 0xffff0000u);
}

// The same for IEEE half precision.
__device__ __forceinline__ uint32_t PackF16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  return w;
}

__device__ __forceinline__ void UnpackF16x2(uint32_t w, float* lo, float* hi) {
  __half2 h;
  memcpy(&h, &w, sizeof(w));
  const float2 f = __half22float2(h);
  *lo = f.x;
  *hi = f.y;
}

// SplitToRemainder of two masters: `hi` gets both bfloat16 high halves,
// `rem` both remainders (one add each and a byte permutation per word).
__device__ __forceinline__ void SplitToRemainder2(float lo_master,
                                                  float hi_master, uint32_t* hi,
                                                  uint32_t* rem) {
  const uint32_t a = __float_as_uint(lo_master);
  const uint32_t b = __float_as_uint(hi_master);
  *hi = __byte_perm(a + 0x8000u, b + 0x8000u, 0x7632);
  *rem = __byte_perm(a, b, 0x5410);
}

// ReconstructFromRemainder of two masters from their packed high halves and
// remainders.
__device__ __forceinline__ void ReconstructFromRemainder2(uint32_t hi,
                                                          uint32_t rem,
                                                          float* lo_master,
                                                          float* hi_master) {
  *lo_master =
      __uint_as_float((hi << 16) + static_cast<uint32_t>(
                                       static_cast<int32_t>(rem << 16) >> 16));
  *hi_master =
      __uint_as_float((hi & 0xffff0000u) +
                      static_cast<uint32_t>(static_cast<int32_t>(rem) >> 16));
}

// ReconstructFromRemainder2 of a tile lane's 8 masters: h and r as LoadTile
// gives a 2-byte stream's words.
__device__ __forceinline__ void ReconstructFromRemainder8(const uint32_t* h,
                                                          const uint32_t* r,
                                                          float* x) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    ReconstructFromRemainder2(h[j], r[j], &x[2 * j], &x[2 * j + 1]);
  }
}

// Block8Decode<true>(c, scale) (core/block8.h) from the code's bits: the
// magnitude's 7 bits placed as a float's exponent and mantissa (4 and 3
// bits, whose fp32 subnormals are the code's subnormals, as ftz is off)
// and the sign bit as the float's, scaled exactly by 2^(127 - 15) to the
// code's value, then times the scale: one rounding, as the CPU's.
// tests/cuda_math_test compares both with Block8Decode on every code under
// many scales.
__device__ __forceinline__ float DecodeSigned8Times(uint8_t c, float scale) {
  const uint32_t u = c;
  const uint32_t bits = ((u & 0x7fu) << 20) | ((u & 0x80u) << 24);
  return __fmul_rn(__fmul_rn(__uint_as_float(bits), 0x1p112f), scale);
}

// Block8Decode<false>(c, scale) the same way: 5 exponent and 3 mantissa
// bits, scaled by 2^(127 - 31).
__device__ __forceinline__ float DecodeUnsigned8Times(uint8_t c, float scale) {
  const uint32_t bits = static_cast<uint32_t>(c) << 20;
  return __fmul_rn(__fmul_rn(__uint_as_float(bits), 0x1p96f), scale);
}

// Block8 exp_avg codes (Block8Encode<true>, core/block8.h) of lo and hi in
// a block of multiplier {pre, mul}, in the low and the high byte, by one
// conversion instruction. The signed code set is float8_e4m3fn's scaled
// down by 2^8, subnormals included (4 exponent and 3 mantissa bits; 1.0 is
// e4m3fn's 256): the magnitude's code is e4m3fn's code of 256 * min(|u|,
// 1) for u = (x * pre) * mul (exact scaling; NaN reads as 1, as in
// EncodeUnit), both rounding to nearest even, under x's sign bit (none for
// a NaN x). tests/cuda_math_test compares it with Block8Encode<true> on
// every float.
__device__ __forceinline__ uint32_t EncodeSigned8x2(float lo, float hi,
                                                    float pre, float mul) {
  const float ulo = (lo * pre) * mul, uhi = (hi * pre) * mul;
  const float2 mags = make_float2(fminf(fabsf(ulo), 1.0f) * 256.0f,
                                  fminf(fabsf(uhi), 1.0f) * 256.0f);
  const uint32_t codes =
      __nv_cvt_float2_to_fp8x2(mags, __NV_SATFINITE, __NV_E4M3);
  const uint32_t signs =
      (isnan(lo) ? 0u : (__float_as_uint(lo) >> 24) & 0x80u) |
      (isnan(hi) ? 0u : (__float_as_uint(hi) >> 16) & 0x8000u);
  return codes | signs;
}

// EncodeSigned8x2 for finite lo and hi in a block whose scale is finite and
// at least 2^-64 (pre 1, mul finite and positive): u = x * mul then has x's
// sign bit (a zero's and an underflow's too) and is no NaN, so e4m3fn's
// conversion of u clamped to [-1, 1], times 256, writes the sign with the
// magnitude (its rounding is symmetric), without the sign's own
// instructions. tests/cuda_math_test compares it with Block8Encode<true> on
// every finite float.
__device__ __forceinline__ uint32_t EncodeSigned8x2Finite(float lo, float hi,
                                                          float mul) {
  const float2 units =
      make_float2(fmaxf(fminf(lo * mul, 1.0f), -1.0f) * 256.0f,
                  fmaxf(fminf(hi * mul, 1.0f), -1.0f) * 256.0f);
  return __nv_cvt_float2_to_fp8x2(units, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_KERNELS_CUDA_MATH_CUH_
