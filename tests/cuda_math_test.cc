// GPU: the division by a reciprocal of kernels/cuda_math.cuh equals IEEE
// division for every dividend the step kernels can meet (the square root of
// any non-negative float) and the bias-correction divisors b they use (and
// more).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tests/cuda_math_check.h"

namespace optimd {
namespace testing {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// b as the step kernels derive it: sqrt(1 - beta2^t) in double, then float.
float Bc2(double beta2, double t) {
  return static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
}

TEST(CudaMathTest, DivisionByRecipEqualsIeeeDivision) {
  std::vector<float> divisors;
  for (double beta2 :
       {0.999, 0.99, 0.95, 0.9999, 0.5, 0.0, 1.0 - std::ldexp(1.0, -53)}) {
    for (double t : {1.0, 2.0, 3.0, 7.0, 10.0, 100.0, 1000.0, 12345.0, 1e6}) {
      divisors.push_back(Bc2(beta2, t));
    }
  }
  // Significands at the edges: 1, the largest float below 1, all-ones and
  // alternating bit patterns, powers of two.
  for (uint32_t bits : {0x3f800000u, 0x3f7fffffu, 0x3effffffu, 0x3caaaaabu,
                        0x3d555555u, 0x3e000000u, 0x32800000u, 0x3a7fffffu}) {
    divisors.push_back(FromBits(bits));
  }
  std::mt19937 rng(20261129);
  std::uniform_int_distribution<uint32_t> in_range(0x32000000u, 0x3f800000u);
  for (int i = 0; i < 16; ++i) divisors.push_back(FromBits(in_range(rng)));

  for (float b : divisors) {
    ASSERT_GT(b, 0.0f);
    const MathCheck c = CheckDivisionByRecip(b);
    ASSERT_TRUE(c.error.empty()) << c.error;
    ASSERT_EQ(c.compared, 0x7fc00001ull);
    EXPECT_EQ(c.mismatches, 0u)
        << "b = " << b << " (bits 0x" << std::hex << ToBits(b)
        << "): first differing a = sqrt(x), x with bits 0x" << c.first_bad_bits;
  }
}

// The block8 step takes square roots by SqrtInRange where a warp's second
// moments all lie in its range: it must be IEEE square root on all of it.
TEST(CudaMathTest, SqrtInRangeEqualsIeeeSquareRoot) {
  const MathCheck c = CheckSqrtInRange();
  ASSERT_TRUE(c.error.empty()) << c.error;
  ASSERT_EQ(c.compared, 0x7f7fffffull - 0x0d000000ull + 1);
  EXPECT_EQ(c.mismatches, 0u) << "first differing x: bits 0x" << std::hex
                              << (c.first_bad_bits + 0x0d000000u);
}

// The block8 step reads moments back by the code's bits, the CPU by its
// decode functions: the same values for every code and scale.
TEST(CudaMathTest, ArithmeticBlock8DecodeEqualsTheReference) {
  const MathCheck c = CheckDecode8();
  ASSERT_TRUE(c.error.empty()) << c.error;
  ASSERT_EQ(c.compared, uint64_t{1} << 32);
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing u: 0x" << std::hex << c.first_bad_bits;
}

// The block8 step decodes a block's moments by the scale folded with the
// codes' powers of two where the scale lies below the fold limit: the same
// values as the reference for every code and every such scale tried.
TEST(CudaMathTest, FoldedBlock8DecodeEqualsTheReference) {
  const MathCheck c = CheckFoldedDecode8();
  ASSERT_TRUE(c.error.empty()) << c.error;
  ASSERT_EQ(c.compared, uint64_t{1} << 32);
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing u: 0x" << std::hex << c.first_bad_bits;
}

// Where a warp's second moments span few binades, the block8 step encodes
// them without the subnormal arm: the reference's code on the whole range.
TEST(CudaMathTest, NormalUnsigned8EncodeEqualsTheReference) {
  const MathCheck c = CheckUnsigned8Normal();
  ASSERT_TRUE(c.error.empty()) << c.error;
  ASSERT_EQ(c.compared, 0x7f800000ull - (97ull << 23) + 1);
  EXPECT_EQ(c.mismatches, 0u) << "first differing x: bits 0x" << std::hex
                              << (c.first_bad_bits + (97u << 23));
}

// The step kernels round results of GPU arithmetic to bfloat16 with one
// conversion instruction; it must agree with the reference rounding on
// every float (NaNs aside, of which GPU arithmetic makes only the
// canonical one).
TEST(CudaMathTest, HardwareBf16RoundingEqualsTheReference) {
  const MathCheck c = CheckBf16Rounding();
  ASSERT_TRUE(c.error.empty()) << c.error;
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing float: bits 0x" << std::hex << c.first_bad_bits;
}

// The remainder layout's split and reconstruction in the step kernels (two
// integer operations each) equal the CPU reference's definitions.
TEST(CudaMathTest, RemainderSplitEqualsTheReference) {
  const MathCheck c = CheckRemainderSplit();
  ASSERT_TRUE(c.error.empty()) << c.error;
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing float: bits 0x" << std::hex << c.first_bad_bits;
}

// The step kernels convert and split two 16-bit elements per instruction
// where a lane holds them in one word.
TEST(CudaMathTest, PackedPairsEqualSingleElements) {
  const MathCheck c = CheckPackedPairs();
  ASSERT_TRUE(c.error.empty()) << c.error;
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing float: bits 0x" << std::hex << c.first_bad_bits;
}

// The block8 kernel encodes exp_avg two codes per conversion instruction.
TEST(CudaMathTest, HardwareSigned8CodesEqualTheReference) {
  const MathCheck c = CheckSigned8Pairs();
  ASSERT_TRUE(c.error.empty()) << c.error;
  EXPECT_EQ(c.mismatches, 0u)
      << "first differing float: bits 0x" << std::hex << c.first_bad_bits;
}

}  // namespace
}  // namespace testing
}  // namespace optimd
