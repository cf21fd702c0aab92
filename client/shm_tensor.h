// Shared-memory-backed buffers for trainers on the CPU backend: the trainer
// computes into them and the daemon reads gradients from and writes
// parameters to the same pages, with no copy.
#ifndef OPTIMD_CLIENT_SHM_TENSOR_H_
#define OPTIMD_CLIENT_SHM_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "optimd/v1/optimd.pb.h"

namespace optimd {

// One POSIX shared-memory segment created by the trainer. Owns it: the
// destructor unmaps and unlinks it (a daemon that mapped it keeps its
// mapping until it lets go). Not thread-safe; move-only via unique_ptr.
class SharedMemoryRegion {
 public:
  // Creates a fresh, zeroed segment of `bytes` (> 0) with a unique name.
  static absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> Create(
      size_t bytes);

  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;
  ~SharedMemoryRegion();

  const std::string& name() const { return name_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

  template <typename T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(data_ + byte_offset);
  }

  // A handle to [offset, offset + bytes) of this segment for the daemon.
  v1::BufferHandle Handle(uint64_t offset, uint64_t bytes) const;

 private:
  SharedMemoryRegion(std::string name, uint8_t* data, size_t size)
      : name_(std::move(name)), data_(data), size_(size) {}

  const std::string name_;
  uint8_t* const data_;
  const size_t size_;
};

}  // namespace optimd

#endif  // OPTIMD_CLIENT_SHM_TENSOR_H_
