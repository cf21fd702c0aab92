#include "core/block8.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

// Every code reads back as a value that encodes to the same code, and the
// values increase with the code (so rounding to nearest is well defined).
TEST(Block8Test, CodesRoundTripAndIncrease) {
  float last = -1;
  for (uint32_t c = 0; c <= 0x78; ++c) {
    const float x = DecodeSigned8(static_cast<uint8_t>(c));
    EXPECT_GT(x, last) << c;
    EXPECT_EQ(EncodeSigned8(x), c) << c;
    EXPECT_EQ(EncodeSigned8(-x), c | 0x80u) << c;
    EXPECT_EQ(DecodeSigned8(static_cast<uint8_t>(c | 0x80u)), -x);
    last = x;
  }
  EXPECT_EQ(DecodeSigned8(0x78), 1.0f);
  last = -1;
  for (uint32_t c = 0; c <= 0xf8; ++c) {
    const float x = DecodeUnsigned8(static_cast<uint8_t>(c));
    EXPECT_GT(x, last) << c;
    EXPECT_EQ(EncodeUnsigned8(x), c) << c;
    last = x;
  }
  EXPECT_EQ(DecodeUnsigned8(0xf8), 1.0f);
  EXPECT_EQ(DecodeUnsigned8(1), std::ldexp(1.0f, -33));
  EXPECT_EQ(DecodeSigned8(1), std::ldexp(1.0f, -17));
}

// The nearest code by search, ties to the even code.
uint32_t Nearest(float x, uint32_t max_code, float (*decode)(uint8_t)) {
  uint32_t best = 0;
  for (uint32_t c = 1; c <= max_code; ++c) {
    const double d = std::fabs(static_cast<double>(decode(c)) - x);
    const double b = std::fabs(static_cast<double>(decode(best)) - x);
    if (d < b || (d == b && (c & 1u) == 0)) best = c;
  }
  return best;
}

TEST(Block8Test, RoundsToNearestEven) {
  // Every float in [2^-40, 1] whose low 13 mantissa bits are zero, plus the
  // midpoints between codes (ties).
  for (uint32_t u = 0x2b800000u; u <= 0x3f800000u; u += 1u << 13) {
    const float x = BitsToFloat(u);
    ASSERT_EQ(EncodeUnsigned8(x), Nearest(x, 0xf8, DecodeUnsigned8)) << x;
    ASSERT_EQ(EncodeSigned8(x), Nearest(x, 0x78, DecodeSigned8)) << x;
  }
  for (uint32_t c = 0; c < 0xf8; ++c) {
    const float mid = (DecodeUnsigned8(c) + DecodeUnsigned8(c + 1)) / 2;
    EXPECT_EQ(EncodeUnsigned8(mid), (c & 1u) ? c + 1 : c) << c;
  }
}

TEST(Block8Test, OutOfRangeAndNaNReadAsOne) {
  EXPECT_EQ(EncodeUnsigned8(std::nanf("")), 0xf8);
  EXPECT_EQ(EncodeUnsigned8(2.0f), 0xf8);
  EXPECT_EQ(EncodeSigned8(-2.0f), 0xf8);
  EXPECT_EQ(EncodeUnsigned8(-0.0f), 0);
}

TEST(Block8Test, BlockScaleIsTheLargestMagnitude) {
  std::vector<float> x(200);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = std::sin(static_cast<float>(i)) * 0.01f;
  }
  x[77] = -0.5f;
  std::vector<uint8_t> codes(x.size());
  const float scale = QuantizeBlock8(true, x.data(), x.size(), codes.data());
  EXPECT_EQ(scale, 0.5f);
  std::vector<float> back(x.size());
  DequantizeBlock8(true, codes.data(), x.size(), scale, back.data());
  EXPECT_EQ(back[77], -0.5f);
  for (size_t i = 0; i < x.size(); ++i) {
    // 3 mantissa bits: within 1/16 relative, or below the smallest code.
    EXPECT_LE(std::fabs(back[i] - x[i]),
              std::fabs(x[i]) / 16 + scale * std::ldexp(1.0f, -18))
        << i;
  }
}

TEST(Block8Test, ZeroAndNaNBlocks) {
  std::vector<float> x(10, 0.0f);
  std::vector<uint8_t> codes(10, 0xff);
  EXPECT_EQ(QuantizeBlock8(false, x.data(), 10, codes.data()), 0.0f);
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
  x[3] = std::nanf("");
  const float scale = QuantizeBlock8(false, x.data(), 10, codes.data());
  EXPECT_EQ(FloatBits(scale), 0x7fc00000u);
}

TEST(Block8Test, BlockCounts) {
  EXPECT_EQ(Block8Blocks(0), 0u);
  EXPECT_EQ(Block8Blocks(1), 1u);
  EXPECT_EQ(Block8Blocks(256), 1u);
  EXPECT_EQ(Block8Blocks(257), 2u);
}

}  // namespace
}  // namespace optimd
