#include "core/dtype.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bfloat16");
  EXPECT_EQ(DTypeName(DType::kFloat64), "float64");
}

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even.
  EXPECT_EQ(FloatToBFloat16(1.0f + 0.00390625f), 0x3f80);
  // 1.0078125 + 2^-8 is halfway to 1.015625, whose mantissa is even.
  EXPECT_EQ(FloatToBFloat16(1.0078125f + 0.00390625f), 0x3f82);
  // Just above the tie rounds up.
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808001u)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(
      FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
}

TEST(DTypeTest, BFloat16RoundTripIsExactForAllValues) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToBFloat16(f), h) << std::hex << h;
  }
}

TEST(DTypeTest, HalfRoundTripIsExactForAllValues) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    EXPECT_EQ(FloatToHalf(f), h) << std::hex << h;
  }
}

TEST(DTypeTest, HalfKnownValuesAndRounding) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.5f), 0xc100);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(5.9604644775390625e-08f),
            0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(2.98023223876953125e-08f), 0x0000);  // tie to even (0)
  EXPECT_EQ(FloatToHalf(8.94069671630859375e-08f),
            0x0002);  // 1.5 ulp: tie to 2
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + 0.00048828125f), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * 0.00048828125f), 0x3c02);
  // Midpoints between every pair of adjacent finite halves round to even.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const double lo = HalfToFloat(static_cast<uint16_t>(h));
    const double hi = HalfToFloat(static_cast<uint16_t>(h + 1));
    const float mid = static_cast<float>((lo + hi) / 2);
    if (static_cast<double>(mid) != (lo + hi) / 2) continue;
    const uint16_t want = (h & 1) ? h + 1 : h;
    ASSERT_EQ(FloatToHalf(mid), want) << std::hex << h;
  }
}

}  // namespace
}  // namespace optimd
