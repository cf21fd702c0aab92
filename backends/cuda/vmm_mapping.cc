#include "backends/cuda/vmm_mapping.h"

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/cuda/ipc_mapping.h"
#include "common/status_macros.h"

namespace optimd {

class VmmChunkImport {
 public:
  VmmChunkImport(const VmmDriverFns& driver, CUmemGenericAllocationHandle h)
      : driver_(driver), handle_(h) {}
  VmmChunkImport(const VmmChunkImport&) = delete;
  VmmChunkImport& operator=(const VmmChunkImport&) = delete;
  ~VmmChunkImport() { driver_.release(handle_); }
  CUmemGenericAllocationHandle handle() const { return handle_; }

 private:
  const VmmDriverFns driver_;
  const CUmemGenericAllocationHandle handle_;
};

class VmmRegion {
 public:
  VmmRegion(const VmmDriverFns& driver, int device, CUdeviceptr base,
            uint64_t size)
      : driver_(driver), device_(device), base_(base), size_(size) {}
  VmmRegion(const VmmRegion&) = delete;
  VmmRegion& operator=(const VmmRegion&) = delete;
  ~VmmRegion() {
    if (mapped_ > 0) {
      cudaSetDevice(device_);
      driver_.unmap(base_, mapped_);
    }
    driver_.address_free(base_, size_);
  }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(base_); }
  uint64_t size() const { return size_; }

  // Maps `chunk` next, after those mapped before; keeps it while mapped.
  absl::Status MapNext(std::shared_ptr<VmmChunkImport> chunk, uint64_t bytes) {
    const CUresult r =
        driver_.map(base_ + mapped_, bytes, 0, chunk->handle(), 0);
    if (r != CUDA_SUCCESS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuMemMap refused a chunk of ", bytes, " bytes (CUresult ", r,
          "): is its size the trainer's?"));
    }
    mapped_ += bytes;
    chunks_.push_back(std::move(chunk));
    return absl::OkStatus();
  }

 private:
  const VmmDriverFns driver_;
  const int device_;
  const CUdeviceptr base_;
  const uint64_t size_;
  uint64_t mapped_ = 0;
  std::vector<std::shared_ptr<VmmChunkImport>> chunks_;
};

absl::StatusOr<uint64_t> VmmMappingCache::Check(const BufferHandle& handle,
                                                const std::string& what) const {
  if (fd_store_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": this daemon takes no file descriptors (it listens on TCP): "
        "cuda_vmm buffers need its Unix socket"));
  }
  OPTIMD_RETURN_IF_ERROR(CheckBufferDevice(handle.device, device_, what));
  const auto& chunks = handle.vmm_chunks;
  if (chunks.empty() || chunks.size() > kMaxChunks) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a cuda_vmm buffer has 1 to ", kMaxChunks,
                     " chunks, got ", chunks.size()));
  }
  uint64_t total = 0;
  std::set<std::string> ids;
  for (const VmmChunk& c : chunks) {
    if (c.fd_id.size() != FdStore::kIdBytes || c.size == 0 ||
        c.size % kChunkGranularity != 0 || c.size > (uint64_t{1} << 40)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": each cuda_vmm chunk needs a ", FdStore::kIdBytes,
          "-byte fd_id and a size that is a multiple of 2 MiB, up to 1 "
          "TiB"));
    }
    if (!ids.insert(c.fd_id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": a cuda_vmm buffer names one chunk twice"));
    }
    // The connection that brought it still holds it (a forgotten id is
    // not mapped again, even where an earlier mapping lives on).
    if (absl::Status held = fd_store_->Held(c.fd_id); !held.ok()) {
      return absl::Status(held.code(),
                          absl::StrCat(what, ": ", held.message()));
    }
    total += c.size;
  }
  if (handle.offset > total || handle.size > total - handle.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": region [", handle.offset, ", ", handle.offset, " + ",
        handle.size, ") lies past the end of its chunks (", total, " bytes)"));
  }
  return total;
}

absl::StatusOr<BufferRef> VmmMappingCache::Resolve(const BufferHandle& handle,
                                                   uint64_t alignment,
                                                   const std::string& what) {
  OPTIMD_ASSIGN_OR_RETURN(const uint64_t total, Check(handle, what));
  std::string key;
  for (const VmmChunk& c : handle.vmm_chunks) {
    absl::StrAppend(&key, c.fd_id, c.size, ";");
  }
  std::shared_ptr<VmmRegion> region;
  {
    MutexLock lock(&mu_);
    region = regions_.Find(key);
    if (region == nullptr) {
      OPTIMD_ASSIGN_OR_RETURN(region, Map(handle, total, what));
      regions_.Put(key, region);
    }
  }
  uint8_t* data = region->base() + handle.offset;
  if (alignment > 1 && reinterpret_cast<uint64_t>(data) % alignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": offset ", handle.offset, " is not element-aligned"));
  }
  BufferRef ref;
  ref.data = data;
  ref.size = handle.size;
  ref.mapping = std::move(region);
  return ref;
}

absl::StatusOr<std::shared_ptr<VmmRegion>> VmmMappingCache::Map(
    const BufferHandle& handle, uint64_t total, const std::string& what) {
  cudaSetDevice(device_);
  CUdeviceptr base = 0;
  // Aligned as cuMemCreate's chunks are (2 MiB), or the map is refused.
  const CUresult reserved =
      driver_.address_reserve(&base, total, kChunkGranularity, 0, 0);
  if (reserved != CUDA_SUCCESS) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": cannot reserve ", total,
                     " bytes of address space (CUresult ", reserved, ")"));
  }
  std::shared_ptr<VmmRegion> region(
      new VmmRegion(driver_, device_, base, total),
      [reaper = reaper_](VmmRegion* r) { reaper->Retire([r] { delete r; }); });
  for (const VmmChunk& c : handle.vmm_chunks) {
    OPTIMD_ASSIGN_OR_RETURN(std::shared_ptr<VmmChunkImport> chunk,
                            Import(c, what));
    const absl::Status mapped = region->MapNext(std::move(chunk), c.size);
    if (!mapped.ok()) {
      return absl::Status(mapped.code(),
                          absl::StrCat(what, ": ", mapped.message()));
    }
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult r = driver_.set_access(base, total, &access, 1);
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": cannot give GPU ",
                                                   device_,
                                                   " access to the buffer's "
                                                   "chunks (CUresult ",
                                                   r, ")"));
  }
  return region;
}

absl::StatusOr<std::shared_ptr<VmmChunkImport>> VmmMappingCache::Import(
    const VmmChunk& chunk, const std::string& what) {
  if (auto known = chunks_.Find(chunk.fd_id)) return known;
  absl::StatusOr<UniqueFd> fd = fd_store_->Dup(chunk.fd_id);
  if (!fd.ok()) {
    return absl::Status(fd.status().code(),
                        absl::StrCat(what, ": ", fd.status().message()));
  }
  CUmemGenericAllocationHandle h = 0;
  const CUresult r = driver_.import_handle(
      &h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd->get())),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        ": the descriptor is not CUDA memory the driver can import "
        "(CUresult ",
        r, ")"));
  }
  auto imported = std::make_shared<VmmChunkImport>(driver_, h);
  CUmemAllocationProp prop = {};
  if (driver_.get_properties(&prop, h) != CUDA_SUCCESS ||
      prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      prop.location.id != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a chunk is not memory of GPU ", device_,
                     ", where this session's state lives"));
  }
  chunks_.Put(chunk.fd_id, imported);
  return imported;
}

}  // namespace optimd
