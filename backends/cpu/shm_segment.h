// POSIX shared-memory segments as the CPU backend sees trainer buffers.
// A segment is opened and mapped once and shared by every tensor that lives
// in it; the mapping is released when the last user lets go. Mappings are
// identified by the object (device and inode), not the name: a trainer that
// recreates its segment under the same name gets the new one.
#ifndef OPTIMD_BACKENDS_CPU_SHM_SEGMENT_H_
#define OPTIMD_BACKENDS_CPU_SHM_SEGMENT_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/mutex.h"
#include "common/weak_cache.h"
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

  // Segments open in this process (each holds a descriptor).
  static int64_t OpenCount();

  const std::string& name() const { return name_; }
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Checks that the segment has not been shrunk under the mapping since it
  // was opened (touching pages past the end of a shrunk file faults), and
  // that its name, if it still exists, still names this object (a trainer
  // that recreated the segment must point its tensors at the new one).
  absl::Status CheckStillMapped() const;

  // True when the segment's name still names this object.
  bool StillNamed() const;

  // True when the segment's file is still the size it was mapped at.
  bool SizeUnchanged() const;

 private:
  SharedMemorySegment(std::string name, int fd, uint8_t* data, uint64_t size,
                      dev_t dev, ino_t ino)
      : name_(std::move(name)),
        fd_(fd),
        data_(data),
        size_(size),
        dev_(dev),
        ino_(ino) {}

  const std::string name_;
  const int fd_;
  uint8_t* const data_;
  const uint64_t size_;
  // The object mapped, as fstat saw it at Open.
  const dev_t dev_;
  const ino_t ino_;
};

// Caches open segments by name, re-checking at every Resolve that the name
// still names the cached object. Thread-safe.
class SegmentCache {
 public:
  // At most `max_open` segments open in the process (each holds a
  // descriptor): past it, a new one is RESOURCE_EXHAUSTED.
  static constexpr int64_t kDefaultMaxOpen = 65536;
  explicit SegmentCache(int64_t max_open = kDefaultMaxOpen)
      : max_open_(max_open) {}
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
  const int64_t max_open_;
  mutable Mutex mu_;
  WeakCache<SharedMemorySegment> segments_ ABSL_GUARDED_BY(mu_);
  uint64_t opens_ ABSL_GUARDED_BY(mu_) = 0;
};

// Validates a client-supplied segment name: "/" followed by 1-250 characters
// from [A-Za-z0-9._-].
absl::Status ValidateSegmentName(const std::string& name);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CPU_SHM_SEGMENT_H_
