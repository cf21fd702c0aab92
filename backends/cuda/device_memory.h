// Memory the CUDA backend allocates for itself: device memory and pinned
// host memory, each owned by a StateStorage whose deleter frees it, so that
// nothing is released by hand. A failed allocation is RESOURCE_EXHAUSTED
// naming the size, and leaves no sticky CUDA error behind. Thread-safe.
#ifndef OPTIMD_BACKENDS_CUDA_DEVICE_MEMORY_H_
#define OPTIMD_BACKENDS_CUDA_DEVICE_MEMORY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/buffer.h"

namespace optimd {

// `bytes` of memory on GPU `device` (the caller's current device), freed
// on that device; empty for 0 bytes.
absl::StatusOr<StateStorage> DeviceAlloc(int device, uint64_t bytes);

// `bytes` of pinned host memory (at least one byte is allocated, so that a
// staging buffer always has an address).
absl::StatusOr<StateStorage> PinnedHostAlloc(uint64_t bytes);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_DEVICE_MEMORY_H_
