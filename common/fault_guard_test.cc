#include "common/fault_guard.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gtest/gtest.h"

namespace optimd {
namespace {

// A shared mapping of a file the test makes in its own scratch directory;
// shrinking the file under the mapping makes the pages past its end fault
// (SIGBUS), as a trainer shrinking its shared memory does to the daemon.
TEST(FaultGuardTest, ShrunkMappingFaultIsAnError) {
  const char* dir = getenv("TEST_TMPDIR");
  std::string path =
      std::string(dir != nullptr ? dir : "/tmp") + "/fault_guard_test.XXXXXX";
  const int fd = mkstemp(path.data());
  ASSERT_GE(fd, 0);
  unlink(path.c_str());
  const size_t size = 1 << 20;
  ASSERT_EQ(ftruncate(fd, size), 0);
  void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  uint8_t* p = static_cast<uint8_t*>(map);
  ASSERT_TRUE(GuardMemoryFaults([&] { p[100] = 1; }, "write").ok());
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  volatile uint8_t sink = 0;
  absl::Status s = GuardMemoryFaults([&] { sink = p[512 * 1024]; }, "read");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("read"), absl::string_view::npos);
  // Still guarded afterwards, and nested guards unwind to the inner one.
  absl::Status inner;
  absl::Status outer = GuardMemoryFaults(
      [&] { inner = GuardMemoryFaults([&] { p[900 * 1024] = 2; }, "inner"); },
      "outer");
  EXPECT_TRUE(outer.ok());
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition);
  // Pages below the new end still work.
  EXPECT_TRUE(GuardMemoryFaults([&] { p[10] = 3; }, "ok").ok());
  (void)sink;
  munmap(map, size);
  close(fd);
}

}  // namespace
}  // namespace optimd
