// Where a trainer's buffer lives (BufferHandle), and a resolved, mapped view
// of it (BufferRef) that keeps its mapping alive while held.
#ifndef OPTIMD_CORE_BUFFER_H_
#define OPTIMD_CORE_BUFFER_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace optimd {

// A request's description of a trainer buffer. Plain data, not yet checked.
// kCudaVmm: one physical allocation under a region (CudaVmmChunk in the
// API).
struct VmmChunk {
  std::string fd_id;  // the descriptor's id in the daemon's FdStore
  uint64_t size = 0;
};

struct BufferHandle {
  enum class Kind { kNone, kSharedMemory, kCudaIpc, kCudaVmm };
  Kind kind = Kind::kNone;
  // kSharedMemory: the shm_open name.
  std::string segment_name;
  // kCudaIpc: the raw cudaIpcMemHandle_t bytes and the device they live on.
  std::string ipc_handle;
  int device = -1;
  // kCudaVmm: the chunks under the region, in address order (and `device`).
  std::vector<VmmChunk> vmm_chunks;
  // Byte region within the segment or allocation.
  uint64_t offset = 0;
  uint64_t size = 0;
};

// A region of a trainer buffer that the backend can read and write. `data` is
// a host pointer on the CPU backend and a device pointer on the CUDA backend.
// Holding a BufferRef keeps the underlying mapping open.
struct BufferRef {
  std::shared_ptr<const void> mapping;
  uint8_t* data = nullptr;
  uint64_t size = 0;
};

// Daemon-owned state memory (host or device), released on destruction.
// Move-only.
class StateStorage {
 public:
  using Deleter = std::function<void(uint8_t*)>;

  StateStorage() = default;
  StateStorage(uint8_t* data, uint64_t size, Deleter deleter)
      : data_(data), size_(size), deleter_(std::move(deleter)) {}
  StateStorage(StateStorage&& other) noexcept { *this = std::move(other); }
  StateStorage& operator=(StateStorage&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = other.data_;
      size_ = other.size_;
      deleter_ = std::move(other.deleter_);
      other.data_ = nullptr;
      other.size_ = 0;
    }
    return *this;
  }
  StateStorage(const StateStorage&) = delete;
  StateStorage& operator=(const StateStorage&) = delete;
  ~StateStorage() { Reset(); }

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void Reset() {
    if (data_ != nullptr && deleter_) deleter_(data_);
    data_ = nullptr;
    size_ = 0;
  }

  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  Deleter deleter_;
};

}  // namespace optimd

#endif  // OPTIMD_CORE_BUFFER_H_
