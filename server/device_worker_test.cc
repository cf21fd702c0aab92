#include "server/device_worker.h"

#include <atomic>
#include <memory>
#include <string>
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
      worker.Post(nullptr, [&, i] {
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

// Posts a task of `owner` that holds the worker until `release` is
// notified; returns once it runs.
void HoldWorker(DeviceWorker& worker, const void* owner,
                absl::Notification* release) {
  auto started = std::make_shared<absl::Notification>();
  worker.Post(owner, [started, release] {
    started->Notify();
    release->WaitForNotification();
  });
  started->WaitForNotification();
}

// Posts `count` tasks of `owner`, the i-th appending `name` + i to *order.
void PostNamed(DeviceWorker& worker, const void* owner, const std::string& name,
               int count, std::vector<std::string>* order) {
  for (int i = 0; i < count; ++i) {
    worker.Post(owner, [=] { order->push_back(name + std::to_string(i)); });
  }
}

TEST(DeviceWorkerTest, PendingCountsQueuedAndRunning) {
  DeviceWorker worker("test");
  absl::Notification release;
  HoldWorker(worker, nullptr, &release);
  worker.Post(nullptr, [] {});
  EXPECT_EQ(worker.pending(), 2);
  release.Notify();
}

// One owner's many queued tasks (a session's concurrent requests) do not
// hold back another owner's task: owners take turns, one task each, and
// each owner's own tasks keep their order.
TEST(DeviceWorkerTest, OwnersTakeTurns) {
  const int a = 0, b = 0, c = 0;  // owners, by address
  std::vector<std::string> order;
  {
    DeviceWorker worker("test");
    absl::Notification release;
    HoldWorker(worker, &c, &release);
    PostNamed(worker, &a, "a", 10, &order);
    PostNamed(worker, &b, "b", 2, &order);
    EXPECT_EQ(worker.pending(), 13);
    release.Notify();
  }
  const std::vector<std::string> expected = {
      "a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9"};
  EXPECT_EQ(order, expected);
}

// A drained owner (a retired session) has its waiting tasks served before
// any other owner's, then takes turns again like any other.
TEST(DeviceWorkerTest, ADrainedOwnerGoesFirstUntilItsTasksAreDone) {
  const int a = 0, b = 0, c = 0;
  std::vector<std::string> order;
  {
    DeviceWorker worker("test");
    absl::Notification release;
    HoldWorker(worker, &c, &release);
    PostNamed(worker, &a, "a", 3, &order);
    PostNamed(worker, &b, "b", 4, &order);
    worker.Drain(&b);
    worker.Drain(&c);  // nothing of it waits: no effect
    release.Notify();
  }
  const std::vector<std::string> expected = {"b0", "b1", "b2", "b3",
                                             "a0", "a1", "a2"};
  EXPECT_EQ(order, expected);
}

}  // namespace
}  // namespace optimd
