// Host entry to the exhaustive check of kernels/cuda_math.cuh on the GPU.
#ifndef OPTIMD_TESTS_CUDA_MATH_CHECK_H_
#define OPTIMD_TESTS_CUDA_MATH_CHECK_H_

#include <cstdint>
#include <string>

namespace optimd {
namespace testing {

struct MathCheck {
  uint64_t compared = 0;
  uint64_t mismatches = 0;
  uint32_t first_bad_bits = 0;  // the smallest x (as bits) that differed
  std::string error;            // a CUDA call failed: its name and error
};

// Compares DivByRecip(a, b, RN(1/b)) with IEEE division a / b on the GPU for
// a = sqrt(x) (the step kernels divide square roots) and every float x from
// +0 up to the first quiet NaN: all non-negative finite numbers, subnormal
// ones included, +infinity and the signalling NaNs. Equal means the same
// bits, or both NaN.
MathCheck CheckDivisionByRecip(float b);

// Compares SqrtInRange with IEEE square root on every float of its range
// (bits kSqrtInRangeLow to kSqrtInRangeHigh); first_bad_bits is the
// differing float's offset from kSqrtInRangeLow.
MathCheck CheckSqrtInRange();

// Compares DecodeSigned8Times and DecodeUnsigned8Times (kernels/cuda_math.cuh)
// with Block8Decode (core/block8.h) for every 32-bit u: code u & 0xff
// under a scale made of a bit permutation of u (the sign bit cleared).
MathCheck CheckDecode8();

// Compares DecodeSigned8Folded and DecodeUnsigned8Folded (core/block8.h),
// compiled for the GPU, under the folded scale with Block8Decode under the
// scale, for every 32-bit u: code u & 0xff under scales below the fold limits
// made of a bit permutation of u.
MathCheck CheckFoldedDecode8();
// Compares EncodeUnsigned8Normal with EncodeUnsigned8 (core/block8.h), both
// compiled for the GPU, on
// every float from 2^-30 (kUnsigned8NormalLow) up to +infinity;
// first_bad_bits is the differing float's offset from kUnsigned8NormalLow.
MathCheck CheckUnsigned8Normal();
// Compares the hardware conversion to bfloat16 (cvt.rn.bf16.f32) with
// Bf16FromFloat for every float: `mismatches` counts the floats other than
// NaNs where they differ, plus the canonical NaN 0x7fffffff if it differs.
MathCheck CheckBf16Rounding();

// Compares SplitToRemainder with kernels/adamw/adamw_cpu.h's definition for
// every float, and ReconstructFromRemainder with the float it came from (the
// split is a bijection, so this covers every high half and remainder).
MathCheck CheckRemainderSplit();

// Checks the packed two-element forms against the one-element ones for
// every float x paired with another float y (a bit permutation of x):
// PackBf16x2/UnpackBf16x2 against cvt.rn.bf16.f32 (and Bf16FromFloat for
// x not NaN), PackF16x2/UnpackF16x2 against cvt.rn.f16.f32, and
// SplitToRemainder2/ReconstructFromRemainder2 against SplitToRemainder
// and the original bits.
MathCheck CheckPackedPairs();

// Compares EncodeSigned8x2 (kernels/cuda_math.cuh) with Block8Encode<true>
// (core/block8.h) for every float x paired with another float y (a bit
// permutation of x), both bytes, under three block multipliers, and
// EncodeSigned8x2Finite for the finite pairs under three others.
MathCheck CheckSigned8Pairs();

}  // namespace testing
}  // namespace optimd

#endif  // OPTIMD_TESTS_CUDA_MATH_CHECK_H_
