// A stand-in trainer process for GPU tests: a forked child that owns CUDA
// allocations, exports their IPC handles, and copies data between them and
// a shared-memory staging area on request. CUDA IPC handles cannot be opened
// by the process that created them, so the daemon-side code under test must
// live in another process than the buffers, as in production.
//
// Start() must run before the parent makes any CUDA call (fork). Not
// thread-safe.
#ifndef OPTIMD_TESTING_IPC_TRAINER_H_
#define OPTIMD_TESTING_IPC_TRAINER_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/shm_tensor.h"

namespace optimd {

class IpcTrainer {
 public:
  // `staging_bytes`: size of the shared staging area.
  static absl::StatusOr<std::unique_ptr<IpcTrainer>> Start(
      int device, uint64_t staging_bytes);
  ~IpcTrainer();

  struct Allocation {
    int id = -1;
    std::string ipc_handle;  // 64 bytes
  };
  // Device memory with every byte set to `fill`.
  absl::StatusOr<Allocation> Alloc(uint64_t bytes, uint8_t fill = 0);
  // staging[staging_offset, +bytes) -> allocation id at offset.
  absl::Status Upload(int id, uint64_t offset, uint64_t bytes,
                      uint64_t staging_offset);
  // allocation id at offset -> staging[staging_offset, +bytes).
  absl::Status Download(int id, uint64_t offset, uint64_t bytes,
                        uint64_t staging_offset);
  uint8_t* staging() const { return staging_->data(); }

 private:
  IpcTrainer() = default;
  absl::Status Call(const void* request, size_t n, void* reply, size_t m);

  pid_t pid_ = -1;
  int fd_ = -1;
  std::unique_ptr<SharedMemoryRegion> staging_;
};

}  // namespace optimd

#endif  // OPTIMD_TESTING_IPC_TRAINER_H_
