#include "common/crc32c.h"

#include <sys/mman.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(Crc32cTest, KnownValues) {
  // RFC 3720, B.4: 32 bytes of zeros, and the ASCII check string.
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32cExtend(0, zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(Crc32cExtend(0, "123456789", 9), 0xe3069283u);
}

// The bitwise definition (reflected polynomial 0x82F63B78), against which
// the library's values are checked at every length and alignment up to a
// few cache lines.
uint32_t Reference(uint32_t crc, const unsigned char* p, size_t n) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k)
      crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1)));
  }
  return ~crc;
}

TEST(Crc32cTest, EqualsTheBitwiseDefinition) {
  std::mt19937 rng(7);
  std::vector<unsigned char> buf(4096 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t offset = 0; offset < 16; ++offset) {
    for (size_t n = 0; n < 600; n += (n < 80 ? 1 : 37)) {
      EXPECT_EQ(Crc32cExtend(0x12345678u, buf.data() + offset, n),
                Reference(0x12345678u, buf.data() + offset, n))
          << offset << " " << n;
    }
  }
  EXPECT_EQ(Crc32cExtend(0, buf.data(), buf.size()),
            Reference(0, buf.data(), buf.size()));
}

TEST(Crc32cTest, BuffersOver2GiB) {
  // The library takes an int length: longer buffers go in pieces. Zero
  // pages of an anonymous mapping cost no memory.
  const size_t n = (size_t{1} << 31) + 4099;
  void* m = mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  uint32_t pieces = 0;
  const size_t step = size_t{1} << 26;
  for (size_t at = 0; at < n; at += step) {
    pieces = Crc32cExtend(pieces, static_cast<char*>(m) + at,
                          std::min(step, n - at));
  }
  EXPECT_EQ(Crc32cExtend(0, m, n), pieces);
  munmap(m, n);
}

TEST(Crc32cTest, ExtendsInPieces) {
  const std::string s = "optimd checkpoints are exact to the bit";
  const uint32_t whole = Crc32cExtend(0, s.data(), s.size());
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    uint32_t c = Crc32cExtend(0, s.data(), cut);
    c = Crc32cExtend(c, s.data() + cut, s.size() - cut);
    EXPECT_EQ(c, whole) << cut;
  }
}

}  // namespace
}  // namespace optimd
