#include "common/crc32c.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>

namespace optimd {

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
  // ISA-L keeps the register uninverted: CRC-32C = ~crc32_iscsi(~init).
  // Its length is an int, so longer buffers go in pieces.
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t c = ~crc;
  while (n > 0) {
    const size_t piece = std::min<size_t>(n, INT_MAX & ~size_t{63});
    c = crc32_iscsi(p, static_cast<int>(piece), c);
    p += piece;
    n -= piece;
  }
  return ~c;
}

}  // namespace optimd
