#include "backends/cuda/ipc_mapping.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace optimd {

absl::Status CheckBufferDevice(int buffer_device, int device,
                               const std::string& what) {
  if (buffer_device == device) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": the buffer is on GPU ", buffer_device,
                   " but this session's state lives on GPU ", device,
                   "; one session's tensors must share its device"));
}

absl::StatusOr<BufferRef> IpcMappingCache::Resolve(const BufferHandle& handle,
                                                   uint64_t alignment,
                                                   const std::string& what) {
  if (handle.kind != BufferHandle::Kind::kCudaIpc) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": the CUDA backend needs a cuda_ipc buffer handle, not a "
                     "shared-memory one"));
  }
  if (handle.ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ipc_handle must be ", sizeof(cudaIpcMemHandle_t),
        " bytes (a cudaIpcMemHandle_t), got ", handle.ipc_handle.size()));
  }
  OPTIMD_RETURN_IF_ERROR(CheckBufferDevice(handle.device, device_, what));
  std::shared_ptr<IpcMapping> mapping;
  {
    MutexLock lock(&mu_);
    mapping = mappings_.Find(handle.ipc_handle);
    if (mapping == nullptr) {
      OPTIMD_ASSIGN_OR_RETURN(mapping, Open(handle, what));
    }
  }
  if (handle.offset > mapping->size() ||
      handle.size > mapping->size() - handle.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": region [", handle.offset, ", ", handle.offset, " + ",
        handle.size, ") lies past the end of its CUDA allocation (",
        mapping->size(), " bytes)"));
  }
  if (alignment > 1 &&
      (reinterpret_cast<uint64_t>(mapping->base()) + handle.offset) %
              alignment !=
          0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": offset ", handle.offset, " is not element-aligned"));
  }
  BufferRef ref;
  ref.data = mapping->base() + handle.offset;
  ref.size = handle.size;
  ref.mapping = std::move(mapping);
  return ref;
}

absl::StatusOr<std::shared_ptr<IpcMapping>> IpcMappingCache::Open(
    const BufferHandle& handle, const std::string& what) {
  cudaSetDevice(device_);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.ipc_handle.data(), sizeof(h));
  void* base = nullptr;
  const cudaError_t e =
      cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": cannot open the CUDA IPC handle (", cudaGetErrorName(e), ": ",
        cudaGetErrorString(e),
        "); is it stale (freed by the trainer), from another GPU or "
        "machine, or from this process?"));
  }
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  if (mem_get_address_range_(&range_base, &range_size,
                             reinterpret_cast<CUdeviceptr>(base)) !=
      CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(base);
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot query the size of the IPC allocation"));
  }
  const uint64_t usable =
      range_size - (reinterpret_cast<uint64_t>(base) - range_base);
  std::shared_ptr<IpcMapping> mapping(
      new IpcMapping(device_, static_cast<uint8_t*>(base), usable),
      [reaper = reaper_](IpcMapping* m) { reaper->Retire([m] { delete m; }); });
  mappings_.Put(handle.ipc_handle, mapping);
  return mapping;
}

}  // namespace optimd
