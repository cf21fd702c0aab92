// FdStore: file descriptors that trainers passed to the daemon over its
// descriptor socket (server/fd_socket.h), each under a 16-byte id the
// trainer chose: the POSIX descriptors of a trainer's CUDA memory made
// with cuMemCreate (torch's expandable segments), which CUDA IPC handles
// cannot share (BufferHandle::Kind::kCudaVmm). The CUDA backend imports a
// chunk from a duplicate (Dup) whenever a buffer names its id.
//
// Each descriptor belongs to the connection that brought it: when that
// connection ends, its descriptors still held are closed. The store holds
// at most `max_total` descriptors, and at most `max_per_owner` per
// connection. Thread-safe.
#ifndef OPTIMD_COMMON_FD_STORE_H_
#define OPTIMD_COMMON_FD_STORE_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "common/unique_fd.h"

namespace optimd {

class FdStore {
 public:
  static constexpr size_t kIdBytes = 16;

  FdStore(size_t max_total, size_t max_per_owner)
      : max_total_(max_total), max_per_owner_(max_per_owner) {}
  FdStore(const FdStore&) = delete;
  FdStore& operator=(const FdStore&) = delete;

  // Keeps every descriptor of `fds` under the id at the same index of
  // `ids`, for connection `owner`; all or none: an id of the wrong
  // length, an id given twice or already held, or more descriptors than
  // the bounds allow is refused (InvalidArgument, ResourceExhausted) and
  // every descriptor of `fds` is closed.
  absl::Status Put(uint64_t owner, const std::vector<std::string>& ids,
                   std::vector<UniqueFd> fds) ABSL_LOCKS_EXCLUDED(mu_);

  // A duplicate of the descriptor under `id` (close-on-exec), the
  // caller's, the store keeping its own: the daemon imports a trainer's
  // chunk of CUDA memory as often as it maps it anew. NotFound when no
  // connection brought it, or the one that did has ended.
  absl::StatusOr<UniqueFd> Dup(const std::string& id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK when a descriptor is held under `id`, else NotFound as Dup.
  absl::Status Held(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Closes the descriptors of `owner`.
  void DropOwner(uint64_t owner) ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    uint64_t owner;
    UniqueFd fd;
  };

  const size_t max_total_;
  const size_t max_per_owner_;
  mutable Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, size_t> per_owner_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimd

#endif  // OPTIMD_COMMON_FD_STORE_H_
