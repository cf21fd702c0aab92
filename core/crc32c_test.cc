#include "core/crc32c.h"

#include <string>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(Crc32cTest, KnownValues) {
  // RFC 3720, B.4: 32 bytes of zeros, and the ASCII check string.
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32cExtend(0, zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(Crc32cExtend(0, "123456789", 9), 0xe3069283u);
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
