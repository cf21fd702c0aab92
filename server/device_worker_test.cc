#include "server/device_worker.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(DeviceWorkerTest, RunsTasksInOrderOnOneThread) {
  std::vector<int> order;
  std::thread::id id;
  std::atomic<bool> one_thread{true};
  {
    DeviceWorker worker("test");
    for (int i = 0; i < 100; ++i) {
      worker.Post([&, i] {
        if (i == 0) id = std::this_thread::get_id();
        if (std::this_thread::get_id() != id) one_thread = false;
        order.push_back(i);
      });
    }
  }  // the destructor drains the queue
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_TRUE(one_thread.load());
}

TEST(DeviceWorkerTest, PendingCountsQueuedAndRunning) {
  DeviceWorker worker("test");
  absl::Notification release, started;
  worker.Post([&] {
    started.Notify();
    release.WaitForNotification();
  });
  worker.Post([] {});
  started.WaitForNotification();
  EXPECT_EQ(worker.pending(), 2);
  release.Notify();
}

}  // namespace
}  // namespace optimd
