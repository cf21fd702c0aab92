#include "core/fault_guard.h"

#include <unistd.h>

#include <cstring>
#include <string>

#include "client/shm_tensor.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(FaultGuardTest, ShrunkMappingFaultIsAnError) {
  auto seg = *SharedMemoryRegion::Create(1 << 20);
  uint8_t* p = seg->data();
  ASSERT_TRUE(GuardMemoryFaults([&] { p[100] = 1; }, "write").ok());
  ASSERT_EQ(truncate(("/dev/shm" + seg->name()).c_str(), 4096), 0);
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
}

}  // namespace
}  // namespace optimd
