// The POSIX file work of checkpoints: errno as a Status of the right code,
// whole reads and writes at an offset, a directory's fsync, and a writer
// that gathers many pieces into large pwritev calls.
//
// Thread-compatible: the functions share no state; a BatchWriter has one
// user at a time (its own thread writes the batch in flight).
#ifndef OPTIMD_CHECKPOINT_FILE_IO_H_
#define OPTIMD_CHECKPOINT_FILE_IO_H_

#include <sys/uio.h>

#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace optimd {

// "<what>: <strerror>" with the code that says what to do about `err`:
// NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED (a full disk),
// FAILED_PRECONDITION (a directory, or an existing entry, in the way),
// INVALID_ARGUMENT (a path too long or looping through links) or INTERNAL.
absl::Status ErrnoStatus(int err, const std::string& what);

// Writes all `n` bytes at `offset` (retrying short writes and EINTR).
absl::Status WriteAll(int fd, const void* data, uint64_t n, uint64_t offset,
                      const std::string& path);

// Reads all `n` bytes at `offset`; DATA_LOSS when the file ends first.
absl::Status ReadAll(int fd, void* data, uint64_t n, uint64_t offset,
                     const std::string& path);

// Makes a rename in `dir` durable.
absl::Status FsyncDir(const std::string& dir);

// Gathers writes into large pwritev calls (storage is much faster with
// writes of tens of megabytes than with one call per tensor).
class BatchWriter {
 public:
  BatchWriter(int fd, const std::string& path);
  BatchWriter(const BatchWriter&) = delete;
  BatchWriter& operator=(const BatchWriter&) = delete;
  // Waits for the batch in flight (its outcome is lost: call Wait first).
  ~BatchWriter();

  // Queues [data, data + n) for the file at `offset` (which must follow the
  // previous queued byte). The memory must stay valid until Flush.
  absl::Status Append(const uint8_t* data, uint64_t n, uint64_t offset);

  // Starts writing the queued bytes on a thread of its own (after the
  // previous batch finished) so that checksums of the next batch overlap
  // with the disk. The queued memory must stay valid until the next Flush
  // or Wait returns.
  absl::Status Flush();

  // Waits for the batch in flight.
  absl::Status Wait();

 private:
  absl::Status WriteIov(std::vector<iovec>* iov, uint64_t offset);

  static constexpr uint64_t kBatchBytes = uint64_t{64} << 20;
  static constexpr size_t kMaxIov = 512;
  const int fd_;
  const std::string path_;
  std::vector<iovec> iov_;
  std::vector<iovec> inflight_iov_;
  std::future<absl::Status> inflight_;
  uint64_t queued_ = 0;
  uint64_t start_ = 0;
};

}  // namespace optimd

#endif  // OPTIMD_CHECKPOINT_FILE_IO_H_
