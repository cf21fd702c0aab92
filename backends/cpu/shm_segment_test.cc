#include "backends/cpu/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace optimd {
namespace {

// Creates a named segment of `bytes` for the duration of a test.
class ScopedSegment {
 public:
  explicit ScopedSegment(size_t bytes) {
    name_ = "/optimd-shm-test-" + std::to_string(getpid()) + "-" +
            std::to_string(counter_++);
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, bytes), 0);
  }
  ~ScopedSegment() {
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }

 private:
  static inline int counter_ = 0;
  std::string name_;
  int fd_ = -1;
};

BufferHandle Shm(const std::string& name, uint64_t offset, uint64_t size) {
  BufferHandle h;
  h.kind = BufferHandle::Kind::kSharedMemory;
  h.segment_name = name;
  h.offset = offset;
  h.size = size;
  return h;
}

TEST(SegmentCacheTest, MapsOnceAndReleasesWhenUnused) {
  ScopedSegment seg(4096);
  SegmentCache cache;
  {
    auto a = cache.Resolve(Shm(seg.name(), 0, 1024), 4, "a");
    auto b = cache.Resolve(Shm(seg.name(), 1024, 1024), 4, "b");
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(cache.opens(), 1u);
    EXPECT_EQ(cache.OpenSegments(), 1);
    EXPECT_EQ(b->data - a->data, 1024);
    // Writes through the mapping reach the segment.
    reinterpret_cast<float*>(a->data)[0] = 3.5f;
    float v = 0;
    ASSERT_EQ(pread(seg.fd(), &v, 4, 0), 4);
    EXPECT_EQ(v, 3.5f);
  }
  EXPECT_EQ(cache.OpenSegments(), 0);
  auto c = cache.Resolve(Shm(seg.name(), 0, 8), 4, "c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(cache.opens(), 2u);
}

// Each open segment holds a descriptor: past the cache's bound a new one is
// RESOURCE_EXHAUSTED, naming the tensor, while segments already open still
// resolve; once one is let go, another opens.
TEST(SegmentCacheTest, SegmentsPastTheBoundAreResourceExhausted) {
  const int64_t before = SharedMemorySegment::OpenCount();
  SegmentCache cache(before + 2);
  ScopedSegment a(64), b(64), c(64);
  auto ra = cache.Resolve(Shm(a.name(), 0, 64), 4, "a");
  auto rb = cache.Resolve(Shm(b.name(), 0, 64), 4, "b");
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  auto rc = cache.Resolve(Shm(c.name(), 0, 64), 4, "c");
  EXPECT_EQ(rc.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(rc.status().message().find("c: "), std::string::npos)
      << rc.status();
  EXPECT_TRUE(cache.Resolve(Shm(a.name(), 0, 32), 4, "a again").ok());
  EXPECT_EQ(SharedMemorySegment::OpenCount(), before + 2);
  ra = absl::CancelledError();  // lets segment a go
  EXPECT_TRUE(cache.Resolve(Shm(c.name(), 0, 64), 4, "c").ok());
}

TEST(SegmentCacheTest, RejectsBadRegions) {
  ScopedSegment seg(4096);
  SegmentCache cache;
  auto past = cache.Resolve(Shm(seg.name(), 4000, 200), 4, "tensor 'w' grad");
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("tensor 'w' grad"),
            absl::string_view::npos);
  auto overflow = cache.Resolve(Shm(seg.name(), 8, ~uint64_t{0} - 4), 4, "w");
  EXPECT_EQ(overflow.status().code(), absl::StatusCode::kInvalidArgument);
  auto offset_past = cache.Resolve(Shm(seg.name(), 5000, 0), 4, "w");
  EXPECT_EQ(offset_past.status().code(), absl::StatusCode::kInvalidArgument);
  auto unaligned = cache.Resolve(Shm(seg.name(), 2, 8), 4, "w");
  EXPECT_EQ(unaligned.status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = cache.Resolve(Shm("/optimd-no-such-segment", 0, 8), 4, "w");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* name : {"", "noslash", "/a/b", "/", "/bad name"}) {
    auto bad = cache.Resolve(Shm(name, 0, 8), 4, "w");
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  BufferHandle cuda;
  cuda.kind = BufferHandle::Kind::kCudaIpc;
  EXPECT_EQ(cache.Resolve(cuda, 4, "w").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.OpenSegments(), 0);
}

TEST(SegmentCacheTest, DetectsShrunkSegment) {
  ScopedSegment seg(8192);
  auto opened = SharedMemorySegment::Open(seg.name());
  ASSERT_TRUE(opened.ok());
  EXPECT_TRUE((*opened)->CheckStillMapped().ok());
  ASSERT_EQ(ftruncate(seg.fd(), 100), 0);
  EXPECT_EQ((*opened)->CheckStillMapped().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SegmentCacheTest, FifoUnderDevShmIsRefusedAsNotARegularFile) {
  const std::string name = "/optimd-shm-test-fifo-" + std::to_string(getpid());
  const std::string path = "/dev/shm" + name;
  ASSERT_EQ(mkfifo(path.c_str(), 0600), 0);
  auto opened = SharedMemorySegment::Open(name);
  unlink(path.c_str());
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(opened.status().message().find("not a regular file"),
            std::string::npos)
      << opened.status();
}

TEST(SegmentCacheTest, EmptySegmentIsRefused) {
  ScopedSegment seg(0);
  auto opened = SharedMemorySegment::Open(seg.name());
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace optimd
