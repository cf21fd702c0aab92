// Trainer memory made with cuMemCreate and mapped with cuMemMap (torch's
// expandable segments), which CUDA IPC handles cannot share, as the CUDA
// backend sees it: each physical chunk imported once from the POSIX file
// descriptor its trainer passed over the descriptor socket (common/
// fd_store.h), and each region's chunks mapped one after the other at an
// address of the daemon's, as the trainer maps them. Chunks and regions
// are shared while anyone uses them, and released when the last user lets
// go. The peer of ipc_mapping.h for cudaMalloc's memory.
#ifndef OPTIMD_BACKENDS_CUDA_VMM_MAPPING_H_
#define OPTIMD_BACKENDS_CUDA_VMM_MAPPING_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "backends/cuda/mapping_reaper.h"
#include "common/fd_store.h"
#include "common/mutex.h"
#include "common/weak_cache.h"
#include "core/buffer.h"

namespace optimd {

// The driver's virtual memory entry points (found by driver_fns.h).
struct VmmDriverFns {
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*,
                            CUmemAllocationHandleType) = nullptr;
  CUresult (*get_properties)(CUmemAllocationProp*,
                             CUmemGenericAllocationHandle) = nullptr;
  CUresult (*release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                              unsigned long long) = nullptr;  // NOLINT
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long) = nullptr;  // NOLINT
  CUresult (*unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*,
                         size_t) = nullptr;
};

// One physical allocation imported from its descriptor; released when
// the last region over it goes.
class VmmChunkImport;
// One region's chunks mapped contiguously; unmapped through the cache's
// MappingReaper once the device's stream has passed the steps that use it.
class VmmRegion;

// Regions of trainer memory on one device, by their chunks. Thread-safe.
class VmmMappingCache {
 public:
  static constexpr size_t kMaxChunks = 65536;
  // cuMemCreate's granularity on every GPU the daemon serves (torch's
  // chunks are 2 MiB and 20 MiB): chunk sizes and reservations are
  // multiples of it.
  static constexpr uint64_t kChunkGranularity = uint64_t{2} << 20;

  // `fd_store` may be null: then every kCudaVmm handle is refused (a
  // daemon that listens on TCP takes no descriptors).
  VmmMappingCache(int device, std::shared_ptr<MappingReaper> reaper,
                  const VmmDriverFns& driver, const FdStore* fd_store)
      : device_(device),
        reaper_(std::move(reaper)),
        driver_(driver),
        fd_store_(fd_store) {}
  VmmMappingCache(const VmmMappingCache&) = delete;
  VmmMappingCache& operator=(const VmmMappingCache&) = delete;

  // The region of a kCudaVmm handle, bounds- and alignment-checked; `what`
  // names the tensor in error messages.
  absl::StatusOr<BufferRef> Resolve(const BufferHandle& handle,
                                    uint64_t alignment, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The handle's bounds, ids and device checked; its chunks' total size.
  absl::StatusOr<uint64_t> Check(const BufferHandle& handle,
                                 const std::string& what) const;
  // Maps the handle's chunks, `total` bytes (Check's), one after the other.
  absl::StatusOr<std::shared_ptr<VmmRegion>> Map(const BufferHandle& handle,
                                                 uint64_t total,
                                                 const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<VmmChunkImport>> Import(
      const VmmChunk& chunk, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int device_;
  const std::shared_ptr<MappingReaper> reaper_;
  const VmmDriverFns driver_;
  const FdStore* const fd_store_;

  Mutex mu_;
  WeakCache<VmmChunkImport> chunks_ ABSL_GUARDED_BY(mu_);
  WeakCache<VmmRegion> regions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_VMM_MAPPING_H_
