#include "checkpoint/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/unique_fd.h"

namespace optimd {

absl::Status ErrnoStatus(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case EISDIR:
    case ENOTEMPTY:
    case EEXIST:
      return absl::FailedPreconditionError(msg);
    case ENAMETOOLONG:
    case ELOOP:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status WriteAll(int fd, const void* data, uint64_t n, uint64_t offset,
                      const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, std::min<uint64_t>(n, 1 << 30), offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path));
    }
    p += w;
    n -= w;
    offset += w;
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, uint64_t n, uint64_t offset,
                     const std::string& path) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = pread(fd, p, std::min<uint64_t>(n, 1 << 30), offset);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("reading ", path));
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat(path, " is truncated"));
    }
    p += r;
    n -= r;
    offset += r;
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  UniqueFd d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() < 0) return ErrnoStatus(errno, absl::StrCat("opening ", dir));
  if (fsync(d.get()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("syncing ", dir));
  }
  return absl::OkStatus();
}

BatchWriter::BatchWriter(int fd, const std::string& path)
    : fd_(fd), path_(path) {}

BatchWriter::~BatchWriter() { (void)Wait(); }

absl::Status BatchWriter::Append(const uint8_t* data, uint64_t n,
                                 uint64_t offset) {
  if (n == 0) return absl::OkStatus();
  if (iov_.empty()) start_ = offset;
  iov_.push_back({const_cast<uint8_t*>(data), n});
  queued_ += n;
  if (queued_ >= kBatchBytes || iov_.size() >= kMaxIov) return Flush();
  return absl::OkStatus();
}

absl::Status BatchWriter::Flush() {
  OPTIMD_RETURN_IF_ERROR(Wait());
  if (iov_.empty()) return absl::OkStatus();
  inflight_iov_.swap(iov_);
  iov_.clear();
  const uint64_t offset = start_;
  start_ += queued_;
  queued_ = 0;
  inflight_ = std::async(std::launch::async, [this, offset] {
    return WriteIov(&inflight_iov_, offset);
  });
  return absl::OkStatus();
}

absl::Status BatchWriter::Wait() {
  if (!inflight_.valid()) return absl::OkStatus();
  return inflight_.get();
}

absl::Status BatchWriter::WriteIov(std::vector<iovec>* iov, uint64_t offset) {
  size_t first = 0;
  while (first < iov->size()) {
    const int count =
        static_cast<int>(std::min<size_t>(iov->size() - first, kMaxIov));
    const ssize_t w = pwritev(fd_, iov->data() + first, count, offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("writing ", path_));
    }
    offset += w;
    uint64_t left = static_cast<uint64_t>(w);
    while (left > 0 && first < iov->size()) {
      iovec& v = (*iov)[first];
      if (left >= v.iov_len) {
        left -= v.iov_len;
        ++first;
      } else {
        v.iov_base = static_cast<uint8_t*>(v.iov_base) + left;
        v.iov_len -= left;
        left = 0;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace optimd
