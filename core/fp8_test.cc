#include "core/fp8.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "core/fp8_recipe.h"
#include "gtest/gtest.h"
#include "testing/fp8_reference.h"

namespace optimd {
namespace {

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t B(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

using fp8_reference::Decode;
using fp8_reference::Encode;
using RefFormat = fp8_reference::Format;
const RefFormat& kRefE4M3 = fp8_reference::kE4M3;
const RefFormat& kRefE5M2 = fp8_reference::kE5M2;

template <const Fp8Format& Fmt>
void CheckFormat(const RefFormat& ref) {
  for (int c = 0; c < 256; ++c) {
    const double want = Decode(ref, c);
    const float got = DecodeFp8<Fmt>(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
    }
  }
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           INFINITY,
                           -INFINITY,
                           NAN,
                           -NAN,
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::denorm_min()};
  // Every code, its neighbours in fp32, and the midpoints between
  // consecutive codes (ties) with their neighbours.
  for (int c = 0; c < 127; ++c) {
    const double v = Decode(ref, c), w = Decode(ref, c + 1);
    if (!std::isfinite(v)) continue;
    for (double y : {v, std::isfinite(w) ? (v + w) / 2 : v * 1.0625}) {
      const float fy = static_cast<float>(y);
      for (float z :
           {fy, std::nextafter(fy, 0.0f), std::nextafter(fy, 1e30f)}) {
        xs.push_back(z);
        xs.push_back(-z);
      }
    }
  }
  std::mt19937 rng(17);
  for (int i = 0; i < 200000; ++i) {
    // Magnitudes around the format's range: exponents 2^-30 .. 2^20.
    const uint32_t exp = 97 + rng() % 51;
    xs.push_back(F((rng() & 0x80000000u) | (exp << 23) | (rng() & 0x7fffffu)));
  }
  for (float x : xs) {
    ASSERT_EQ(EncodeFp8<Fmt>(x), Encode(ref, x))
        << "x=" << x << " bits=" << std::hex << B(x);
  }
}

TEST(Fp8Test, E4M3MatchesNearestEvenSaturating) {
  CheckFormat<kE4M3>(kRefE4M3);
}

TEST(Fp8Test, E5M2MatchesNearestEvenSaturating) {
  CheckFormat<kE5M2>(kRefE5M2);
}

TEST(Fp8Test, LargestValues) {
  EXPECT_EQ(DecodeFp8<kE4M3>(0x7e), 448.0f);
  EXPECT_EQ(DecodeFp8<kE5M2>(0x7b), 57344.0f);
  EXPECT_EQ(EncodeFp8<kE4M3>(1e9f), 0x7e);
  EXPECT_EQ(EncodeFp8<kE5M2>(-INFINITY), 0xfb);
}

TEST(Fp8Test, ScalesFollowTheirRules) {
  std::mt19937 rng(5);
  std::vector<float> amaxes = {
      0.0f,           INFINITY,       NAN,    1.0f,
      448.0f,         1e-45f,         1e-40f, std::numeric_limits<float>::max(),
      F(0x00400000u), F(0x00400001u), 3.0f};
  for (int i = 0; i < 100000; ++i) amaxes.push_back(F(rng() & 0x7fffffffu));
  for (float a : amaxes) {
    for (float mx : {448.0f, 57344.0f}) {
      for (bool pow2 : {false, true}) {
        const float got = Fp8Scale(a, mx, pow2),
                    want = fp8_reference::Scale(a, mx, pow2);
        ASSERT_EQ(B(got), B(want)) << a << " " << mx << " " << pow2;
      }
      ASSERT_EQ(Fp8E8M0(a, mx), fp8_reference::E8M0(a, mx)) << a << " " << mx;
    }
  }
}

TEST(Fp8Test, E8M0ValuesAndMultipliersArePowersOfTwo) {
  for (int c = 0; c < 255; ++c) {
    EXPECT_EQ(static_cast<double>(E8M0Value(static_cast<uint8_t>(c))),
              std::ldexp(1.0, c - 127));
    EXPECT_EQ(static_cast<double>(E8M0Multiplier(static_cast<uint8_t>(c))),
              std::ldexp(1.0, std::max(127 - c, -127)));
  }
  EXPECT_TRUE(std::isnan(E8M0Value(0xff)));
  // A block of amax at most 448 * 2^(code-127) never saturates.
  for (float a : {1.0f, 3.5f, 448.0f, 449.0f, 1e-3f, 7e4f}) {
    const uint8_t c = Fp8E8M0(a, 448.0f);
    EXPECT_LE(a * E8M0Multiplier(c), 448.0f) << a;
  }
}

TEST(Fp8RecipeTest, UnitsOfEachRecipe) {
  const std::vector<uint64_t> shape = {300, 200};
  const Fp8Geometry t = Fp8Geometry::Of(Fp8Recipe::kTensor, 60000, shape);
  EXPECT_EQ(t.Units(), 1u);
  EXPECT_EQ(t.UnitOf(59999), 0u);
  EXPECT_EQ(t.ScaleBytes(), 4u);
  EXPECT_EQ(t.ItemAlignment(), 60000u);
  const Fp8Geometry r = Fp8Geometry::Of(Fp8Recipe::kBlock1x128, 60000, shape);
  EXPECT_EQ(r.Units(), 600u);  // 300 rows x 2
  EXPECT_EQ(r.UnitOf(200 + 130), 3u);
  EXPECT_EQ(r.ItemAlignment(), 200u);  // 200 % 128 != 0: whole rows
  const Fp8Geometry b = Fp8Geometry::Of(Fp8Recipe::kBlock128x128, 60000, shape);
  EXPECT_EQ(b.Units(), 6u);  // 3 x 2
  EXPECT_EQ(b.UnitOf(129 * 200 + 199), 3u);
  EXPECT_EQ(b.ItemAlignment(), 128u * 200);
  const Fp8Geometry m = Fp8Geometry::Of(Fp8Recipe::kMxfp8, 60000, shape);
  EXPECT_EQ(m.Units(), 300u * 7);
  EXPECT_EQ(m.ScaleBytes(), 2100u);
  EXPECT_EQ(m.UnitOf(201), 7u);
  EXPECT_EQ(Fp8Geometry::Of(Fp8Recipe::kMxfp8, 4096, {}).ItemAlignment(), 32u);
  EXPECT_EQ(Fp8Geometry::Of(Fp8Recipe::kBlock1x128, 0, {}).Units(), 0u);
}

}  // namespace
}  // namespace optimd
