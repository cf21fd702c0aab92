// CRC-32C (Castagnoli), as stored per tensor in checkpoints. Uses the SSE4.2
// instruction (part of the x86-64-v2 baseline the project builds for).
#ifndef OPTIMD_CORE_CRC32C_H_
#define OPTIMD_CORE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace optimd {

// Extends `crc` (0 to start) over `n` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

}  // namespace optimd

#endif  // OPTIMD_CORE_CRC32C_H_
