// CUDA IPC allocations as the CUDA backend sees trainer buffers. An
// allocation is opened once per device and shared by every tensor that
// lives in it; it is closed when the last user lets go. The peer of the CPU
// backend's shared-memory segments (backends/cpu/shm_segment.h).
#ifndef OPTIMD_BACKENDS_CUDA_IPC_MAPPING_H_
#define OPTIMD_BACKENDS_CUDA_IPC_MAPPING_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "backends/cuda/mapping_reaper.h"
#include "common/mutex.h"
#include "common/weak_cache.h"
#include "core/buffer.h"

namespace optimd {

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// One opened IPC allocation, closed when it is destroyed. The cache hands
// it out with a MappingReaper as its deleter, so that it is destroyed only
// after the device's stream has finished the steps that use it. Immutable;
// safe to share across threads.
class IpcMapping {
 public:
  IpcMapping(int device, uint8_t* base, uint64_t size)
      : device_(device), base_(base), size_(size) {}
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  ~IpcMapping() {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }
  uint8_t* base() const { return base_; }
  uint64_t size() const { return size_; }

 private:
  const int device_;
  uint8_t* const base_;
  const uint64_t size_;
};

// OK when a buffer the request puts on GPU `buffer_device` is on this
// session's GPU `device`; `what` names the tensor. Shared with the
// mappings of cuMemCreate's memory (vmm_mapping.h).
absl::Status CheckBufferDevice(int buffer_device, int device,
                               const std::string& what);

// Caches the IPC allocations opened on one device by their handles.
// Thread-safe.
class IpcMappingCache {
 public:
  // Mappings on `device`, closed through `reaper` once the device's
  // stream has passed the work queued before they were let go; the size
  // of an allocation comes from the driver's cuMemGetAddressRange.
  IpcMappingCache(int device, std::shared_ptr<MappingReaper> reaper,
                  MemGetAddressRangeFn mem_get_address_range)
      : device_(device),
        reaper_(std::move(reaper)),
        mem_get_address_range_(mem_get_address_range) {}
  IpcMappingCache(const IpcMappingCache&) = delete;
  IpcMappingCache& operator=(const IpcMappingCache&) = delete;

  // Returns a region of an IPC allocation of this device, bounds- and
  // alignment-checked against the allocation's real size. `what` names
  // the tensor in error messages.
  absl::StatusOr<BufferRef> Resolve(const BufferHandle& handle,
                                    uint64_t alignment, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Opens the allocation of `handle` (checked) and caches it.
  absl::StatusOr<std::shared_ptr<IpcMapping>> Open(const BufferHandle& handle,
                                                   const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const int device_;
  const std::shared_ptr<MappingReaper> reaper_;
  const MemGetAddressRangeFn mem_get_address_range_;

  Mutex mu_;
  WeakCache<IpcMapping> mappings_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_IPC_MAPPING_H_
