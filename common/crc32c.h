// CRC-32C (Castagnoli), as stored per tensor in checkpoints. Computed by
// ISA-L (Debian's libisal: crc32_iscsi, which picks the fastest of its
// SSE4.2/PCLMUL/AVX-512 versions at run time); the values are the standard
// CRC-32C, so checkpoints written before still verify.
#ifndef OPTIMD_COMMON_CRC32C_H_
#define OPTIMD_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace optimd {

// Extends `crc` (0 to start) over `n` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

}  // namespace optimd

#endif  // OPTIMD_COMMON_CRC32C_H_
