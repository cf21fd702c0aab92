#include "backends/cpu/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace optimd {
namespace {

// Where glibc's shm_open keeps segments.
constexpr char kShmDirectory[] = "/dev/shm";

// Segments open in this process, each holding a descriptor.
std::atomic<int64_t> open_segments{0};

}  // namespace

int64_t SharedMemorySegment::OpenCount() {
  return open_segments.load(std::memory_order_relaxed);
}

absl::Status ValidateSegmentName(const std::string& name) {
  if (name.size() < 2 || name.size() > 251 || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory segment name '", name,
                     "' must be '/' followed by 1 to 250 characters"));
  }
  for (size_t i = 1; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("shared-memory segment name '", name,
                       "' may only hold letters, digits, '.', '_' and '-' "
                       "after its leading '/'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<SharedMemorySegment>> SharedMemorySegment::Open(
    const std::string& name) {
  absl::Status valid = ValidateSegmentName(name);
  if (!valid.ok()) return valid;
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot open shared-memory segment '", name,
          "': the daemon is out of file descriptors (", std::strerror(err),
          "); register tensors in fewer segments, or raise its open-files "
          "limit"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open shared-memory segment '", name, "': ", std::strerror(err),
        err == ENOENT ? " (does the trainer still hold it?)" : ""));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("cannot stat shared-memory segment '", name,
                     "': ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory segment '", name,
                     "' is not a regular file (a FIFO, device or directory "
                     "under /dev/shm); name the trainer's segment"));
  }
  if (st.st_size <= 0) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory segment '", name,
                     "' is empty; size it (ftruncate) "
                     "before registering buffers in it"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot map shared-memory segment '", name, "': ", std::strerror(err)));
  }
  open_segments.fetch_add(1, std::memory_order_relaxed);
  return std::shared_ptr<SharedMemorySegment>(new SharedMemorySegment(
      name, fd, static_cast<uint8_t*>(p), size, st.st_dev, st.st_ino));
}

bool SharedMemorySegment::StillNamed() const {
  // glibc's shm_open opens "/dev/shm" + name; the name is validated to hold
  // no further '/'.
  struct stat st;
  return stat(absl::StrCat(kShmDirectory, name_).c_str(), &st) == 0 &&
         st.st_dev == dev_ && st.st_ino == ino_;
}

bool SharedMemorySegment::SizeUnchanged() const {
  struct stat st;
  return fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) == size_;
}

SharedMemorySegment::~SharedMemorySegment() {
  munmap(data_, size_);
  close(fd_);
  open_segments.fetch_sub(1, std::memory_order_relaxed);
}

absl::Status SharedMemorySegment::CheckStillMapped() const {
  struct stat st;
  if (fstat(fd_, &st) != 0 || static_cast<uint64_t>(st.st_size) < size_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory segment '", name_, "' shrank below its registered size ",
        size_, " bytes; re-register the buffers that live in it"));
  }
  struct stat named;
  if (stat(absl::StrCat(kShmDirectory, name_).c_str(), &named) == 0 &&
      (named.st_dev != dev_ || named.st_ino != ino_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory segment '", name_, "' was recreated after its ",
        "buffers were registered; the daemon still holds the old segment. ",
        "Point the tensors at the new one (UpdateBuffers) or re-register"));
  }
  return absl::OkStatus();
}

absl::StatusOr<BufferRef> SegmentCache::Resolve(const BufferHandle& handle,
                                                uint64_t alignment,
                                                const std::string& what) {
  if (handle.kind != BufferHandle::Kind::kSharedMemory) {
    return absl::InvalidArgumentError(
        absl::StrCat(what,
                     ": the CPU backend needs a shared_memory buffer "
                     "handle, not a CUDA one (cuda_ipc or cuda_vmm)"));
  }
  std::shared_ptr<SharedMemorySegment> segment;
  {
    MutexLock lock(&mu_);
    segment = segments_.Find(handle.segment_name);
    // A name unlinked, recreated or resized since it was cached: open what
    // it names now, at its size now (tensors registered earlier keep their
    // own mapping, checked at each step).
    if (segment != nullptr &&
        (!segment->StillNamed() || !segment->SizeUnchanged())) {
      segment = nullptr;
    }
    if (segment == nullptr) {
      if (SharedMemorySegment::OpenCount() >= max_open_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            what, ": the daemon holds ", max_open_,
            " shared-memory segments open, its bound (from its open-files "
            "limit); register tensors in fewer, larger segments, or close "
            "sessions that hold others"));
      }
      auto opened = SharedMemorySegment::Open(handle.segment_name);
      if (!opened.ok()) {
        return absl::Status(
            opened.status().code(),
            absl::StrCat(what, ": ", opened.status().message()));
      }
      segment = *std::move(opened);
      segments_.Put(handle.segment_name, segment);
      ++opens_;
    }
  }
  if (handle.offset > segment->size() ||
      handle.size > segment->size() - handle.offset) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": region [", handle.offset, ", ", handle.offset,
                     " + ", handle.size, ") lies past the end of segment '",
                     handle.segment_name, "' (", segment->size(), " bytes)"));
  }
  if (alignment > 1 && handle.offset % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": offset ", handle.offset,
                     " is not a multiple of the element size ", alignment));
  }
  BufferRef ref;
  ref.data = segment->data() + handle.offset;
  ref.size = handle.size;
  ref.mapping = std::move(segment);
  return ref;
}

int SegmentCache::OpenSegments() const {
  MutexLock lock(&mu_);
  return segments_.Live();
}

uint64_t SegmentCache::opens() const {
  MutexLock lock(&mu_);
  return opens_;
}

}  // namespace optimd
