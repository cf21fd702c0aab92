#include "backends/cuda/device_memory.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace optimd {

absl::StatusOr<StateStorage> DeviceAlloc(int device, uint64_t bytes) {
  if (bytes == 0) return StateStorage();
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes on GPU ", device, ": ",
                     cudaGetErrorString(e)));
  }
  return StateStorage(static_cast<uint8_t*>(p), bytes, [device](uint8_t* q) {
    cudaSetDevice(device);
    cudaFree(q);
  });
}

absl::StatusOr<StateStorage> PinnedHostAlloc(uint64_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMallocHost(&p, std::max<uint64_t>(bytes, 1));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes,
                     " bytes of pinned host memory: ", cudaGetErrorString(e)));
  }
  return StateStorage(static_cast<uint8_t*>(p), bytes,
                      [](uint8_t* q) { cudaFreeHost(q); });
}

}  // namespace optimd
