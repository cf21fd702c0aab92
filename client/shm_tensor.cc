#include "client/shm_tensor.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace optimd {

absl::StatusOr<std::unique_ptr<SharedMemoryRegion>> SharedMemoryRegion::Create(
    size_t bytes) {
  if (bytes == 0) {
    return absl::InvalidArgumentError("a shared-memory region needs > 0 bytes");
  }
  static std::atomic<uint64_t> counter{0};
  static const uint32_t salt = std::random_device{}();
  const std::string name =
      absl::StrCat("/optimd-", getpid(), "-", salt, "-", counter.fetch_add(1));
  const int fd =
      shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("shm_open('", name, "'): ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot size shared-memory segment to ", bytes,
                     " bytes: ", std::strerror(err)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map shared memory: ", std::strerror(err)));
  }
  return std::unique_ptr<SharedMemoryRegion>(
      new SharedMemoryRegion(name, static_cast<uint8_t*>(p), bytes));
}

SharedMemoryRegion::~SharedMemoryRegion() {
  munmap(data_, size_);
  shm_unlink(name_.c_str());
}

v1::BufferHandle SharedMemoryRegion::Handle(uint64_t offset,
                                            uint64_t bytes) const {
  v1::BufferHandle h;
  auto* s = h.mutable_shared_memory();
  s->set_segment_name(name_);
  s->set_offset(offset);
  s->set_size(bytes);
  return h;
}

}  // namespace optimd
