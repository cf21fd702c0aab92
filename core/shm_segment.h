// POSIX shared-memory segments as the CPU backend sees trainer buffers.
// A segment is opened and mapped once per name and shared by every tensor
// that lives in it; the mapping is released when the last user lets go.
#ifndef OPTIMD_CORE_SHM_SEGMENT_H_
#define OPTIMD_CORE_SHM_SEGMENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/buffer.h"

namespace optimd {

// One mapped segment. Immutable after Open; safe to share across threads.
class SharedMemorySegment {
 public:
  // Opens and maps `name` read-write. NOT_FOUND-free: a missing or
  // unreadable segment is INVALID_ARGUMENT, since the name came from a client.
  static absl::StatusOr<std::shared_ptr<SharedMemorySegment>> Open(
      const std::string& name);

  SharedMemorySegment(const SharedMemorySegment&) = delete;
  SharedMemorySegment& operator=(const SharedMemorySegment&) = delete;
  ~SharedMemorySegment();

  const std::string& name() const { return name_; }
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Checks that the segment has not been shrunk under the mapping since it
  // was opened (touching pages past the end of a shrunk file faults).
  absl::Status CheckStillMapped() const;

 private:
  SharedMemorySegment(std::string name, int fd, uint8_t* data, uint64_t size)
      : name_(std::move(name)), fd_(fd), data_(data), size_(size) {}

  const std::string name_;
  const int fd_;
  uint8_t* const data_;
  const uint64_t size_;
};

// Caches open segments by name. Thread-safe.
class SegmentCache {
 public:
  SegmentCache() = default;
  SegmentCache(const SegmentCache&) = delete;
  SegmentCache& operator=(const SegmentCache&) = delete;

  // Returns a region of a segment, bounds- and alignment-checked against the
  // segment's real size. `what` names the tensor in error messages.
  absl::StatusOr<BufferRef> Resolve(const BufferHandle& handle,
                                    uint64_t alignment, const std::string& what)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Number of segments currently mapped (held by at least one BufferRef).
  int OpenSegments() const ABSL_LOCKS_EXCLUDED(mu_);

  // Segments opened since start (a repeat name while mapped does not count).
  uint64_t opens() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::weak_ptr<SharedMemorySegment>> segments_
      ABSL_GUARDED_BY(mu_);
  uint64_t opens_ ABSL_GUARDED_BY(mu_) = 0;
};

// Validates a client-supplied segment name: "/" followed by 1-250 characters
// from [A-Za-z0-9._-].
absl::Status ValidateSegmentName(const std::string& name);

}  // namespace optimd

#endif  // OPTIMD_CORE_SHM_SEGMENT_H_
