#include "core/block8.h"

#include <cmath>
#include <cstdint>
#include <limits>
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

// Every code an encoder writes, from any float under any block multiplier,
// is one Block8CodeIsValid accepts (the checkpoint loader refuses others).
TEST(Block8Test, EveryWrittenCodeIsValid) {
  const Block8Multiplier ks[] = {Block8MultiplierOf(1.0f),
                                 Block8MultiplierOf(0x1p-100f),
                                 Block8MultiplierOf(0.0f)};
  for (uint64_t u = 0; u <= 0xffffffffu; u += 65521) {
    const float x = BitsToFloat(static_cast<uint32_t>(u));
    for (const Block8Multiplier& k : ks) {
      ASSERT_TRUE(Block8CodeIsValid(true, Block8Encode<true>(x, k))) << u;
      ASSERT_TRUE(Block8CodeIsValid(false, Block8Encode<false>(x, k))) << u;
    }
  }
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

// The codec as first written, with a branch per range (integer part and
// fraction compared by hand below the normal range): the branch-free
// EncodeUnit and DecodeUnit must give the same codes and values.
template <int kExp>
uint32_t BranchingEncodeUnit(float x) {
  constexpr uint32_t kMaxExp = (1u << kExp) - 1;
  uint32_t u = FloatBits(x) & 0x7fffffffu;
  if (!(u <= 0x3f800000u)) u = 0x3f800000u;
  if ((u >> 23) >= 128 - kMaxExp) {
    const uint32_t r = u + ((1u << 19) - 1) + ((u >> 20) & 1u);
    return (r >> 20) - ((127u - kMaxExp) << 3);
  }
  const float q = BitsToFloat(u) * BitsToFloat((127u + kMaxExp + 2) << 23);
  const uint32_t whole = static_cast<uint32_t>(q);
  const float frac = q - static_cast<float>(whole);
  return whole + ((frac > 0.5f || (frac == 0.5f && (whole & 1u))) ? 1u : 0u);
}

template <int kExp>
float BranchingDecodeUnit(uint32_t c) {
  constexpr uint32_t kMaxExp = (1u << kExp) - 1;
  const uint32_t e = c >> 3, m = c & 7u;
  if (e != 0) return BitsToFloat(((e + 127u - kMaxExp) << 23) | (m << 20));
  return static_cast<float>(m) * BitsToFloat((127u - kMaxExp - 2) << 23);
}

template <int kExp>
void ExpectCodecAsBranching() {
  constexpr uint32_t kCodes = ((1u << kExp) - 1) << 3;
  for (uint32_t c = 0; c <= kCodes; ++c) {
    ASSERT_EQ(FloatBits(block8::DecodeUnit<kExp>(c)),
              FloatBits(BranchingDecodeUnit<kExp>(c)))
        << c;
  }
  // Every code's neighbourhood of its midpoints with the next (ties and
  // the floats either side), then a stride through all of [0, 1] and a
  // little beyond.
  std::vector<uint32_t> inputs;
  for (uint32_t c = 0; c < kCodes; ++c) {
    const double mid = (static_cast<double>(BranchingDecodeUnit<kExp>(c)) +
                        BranchingDecodeUnit<kExp>(c + 1)) /
                       2;
    const uint32_t m = FloatBits(static_cast<float>(mid));
    for (uint32_t d = 0; d <= 8; ++d) inputs.push_back(m + d - 4);
  }
  for (uint32_t u = 0; u <= 0x3f900000u; u += 4099) inputs.push_back(u);
  for (uint32_t u : inputs) {
    const float x = BitsToFloat(u);
    ASSERT_EQ(block8::EncodeUnit<kExp>(x), BranchingEncodeUnit<kExp>(x)) << u;
  }
}

TEST(Block8Test, BranchFreeCodecEqualsTheBranchingOne) {
  ExpectCodecAsBranching<4>();
  ExpectCodecAsBranching<5>();
}

// Encoding multiplies by the block's reciprocal: the element that set the
// scale reads back as itself, and a zero scale gives zero codes.
TEST(Block8Test, EncodeMultipliesByTheReciprocal) {
  for (float scale : {3.0f, 0.1f, 1e30f, 5.5e-20f}) {
    const Block8Multiplier k = Block8MultiplierOf(scale);
    EXPECT_EQ(k.pre, 1.0f);
    EXPECT_EQ(k.mul, 1.0f / scale);
    EXPECT_EQ(Block8Decode<false>(Block8Encode<false>(scale, k), scale), scale);
    EXPECT_EQ(Block8Decode<true>(Block8Encode<true>(-scale, k), scale), -scale);
    EXPECT_EQ(Block8Encode<false>(scale * 0.3f, k),
              EncodeUnsigned8(scale * 0.3f * k.mul));
  }
  EXPECT_EQ(Block8MultiplierOf(0.0f).mul, 0.0f);
  EXPECT_EQ(Block8Encode<true>(0.0f, Block8MultiplierOf(0.0f)), 0);
}

// Scales too small for their reciprocal (below 2^-64, subnormal ones
// included) are taken up by 2^64 first: the block's values still read back
// within the code's precision.
TEST(Block8Test, TinyScalesKeepTheirValues) {
  for (float top : {2e-39f, 3e-30f, 1e-45f * 7}) {
    const std::vector<float> x = {top, top / 2, 0.0f, -top / 2, top / 3};
    std::vector<uint8_t> codes(x.size());
    const float scale = QuantizeBlock8(true, x.data(), x.size(), codes.data());
    EXPECT_EQ(scale, top);
    EXPECT_EQ(Block8MultiplierOf(scale).pre, std::ldexp(1.0f, 64));
    std::vector<float> back(x.size());
    DequantizeBlock8(true, codes.data(), x.size(), scale, back.data());
    for (size_t i = 0; i < x.size(); ++i) {
      // Subnormal products round to the nearest multiple of 2^-149 too.
      EXPECT_LE(std::fabs(back[i] - x[i]),
                std::fabs(x[i]) / 16 + std::ldexp(1.0f, -149))
          << top << " " << i;
    }
    EXPECT_EQ(codes[2], 0);
  }
}

// An infinite value sets an infinite scale: it keeps its sign (and reads
// back as itself), a finite one in its block reads as zero code; a NaN
// value's code has no sign bit.
TEST(Block8Test, InfiniteAndNaNValuesHaveOneCode) {
  const float inf = std::numeric_limits<float>::infinity();
  const Block8Multiplier k = Block8MultiplierOf(inf);
  EXPECT_EQ(Block8Encode<true>(inf, k), 0x78);
  EXPECT_EQ(Block8Encode<true>(-inf, k), 0xf8);
  EXPECT_EQ(Block8Decode<true>(0x78, inf), inf);
  EXPECT_EQ(Block8Encode<true>(1.0f, k), 0);
  EXPECT_EQ(Block8Encode<true>(-1.0f, k), 0x80);
  EXPECT_EQ(Block8Encode<false>(inf, k), 0xf8);
  const float nan = BitsToFloat(0xffc00000u);  // sign bit set
  EXPECT_EQ(Block8Encode<true>(nan, Block8MultiplierOf(2.0f)), 0x78);
  EXPECT_EQ(Block8Encode<true>(0.5f, Block8MultiplierOf(nan)), 0x78);
  EXPECT_EQ(Block8Encode<true>(-0.5f, Block8MultiplierOf(nan)), 0xf8);
}

// The CUDA step's one-multiplication decode equals the codec's decode for
// every code under scales below the fold limits: zero, the smallest
// subnormal, the largest below each limit, and a spread of bit patterns.
TEST(Block8Test, FoldedDecodeEqualsTheDecode) {
  const auto check = [](bool is_signed, float limit) {
    const uint32_t top = FloatBits(limit);
    std::vector<uint32_t> scales = {0, 1, 0x00800000u, top - 1};
    for (uint32_t s = 0; s < top; s += 65521) scales.push_back(s);
    for (const uint32_t s : scales) {
      const float scale = BitsToFloat(s);
      for (uint32_t c = 0; c < 256; ++c) {
        const uint8_t code = static_cast<uint8_t>(c);
        const float got =
            is_signed
                ? DecodeSigned8Folded(code, FoldedSigned8Scale(scale))
                : DecodeUnsigned8Folded(code, FoldedUnsigned8Scale(scale));
        const float want = is_signed ? Block8Decode<true>(code, scale)
                                     : Block8Decode<false>(code, scale);
        ASSERT_EQ(FloatBits(got), FloatBits(want))
            << (is_signed ? "signed" : "unsigned") << " code " << c
            << " scale bits 0x" << std::hex << s;
      }
    }
  };
  check(true, kSigned8FoldLimit);
  check(false, kUnsigned8FoldLimit);
}

// EncodeUnsigned8Normal equals EncodeUnsigned8 from 2^-30 up to infinity:
// at every rounding tie and its neighbours in every binade and mantissa
// step, and on a spread of other floats.
TEST(Block8Test, NormalRangeEncodeEqualsTheEncode) {
  std::vector<uint32_t> xs;
  for (uint32_t e = 97; e <= 255; ++e) {
    for (uint32_t m = 0; m < 8; ++m) {
      for (const uint32_t low :
           {0u, 1u, 0x7ffffu, 0x80000u, 0x80001u, 0xfffffu}) {
        const uint32_t u = (e << 23) | (m << 20) | low;
        if (u <= 0x7f800000u) xs.push_back(u);
      }
    }
  }
  for (uint32_t u = kUnsigned8NormalLow; u <= 0x7f800000u; u += 4093) {
    xs.push_back(u);
  }
  for (const uint32_t u : xs) {
    ASSERT_EQ(EncodeUnsigned8Normal(BitsToFloat(u)),
              EncodeUnsigned8(BitsToFloat(u)))
        << "bits 0x" << std::hex << u;
  }
}

}  // namespace
}  // namespace optimd
