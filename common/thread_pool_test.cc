#include "common/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  EXPECT_EQ(pool.size(), 4);
  for (uint64_t n : {0u, 1u, 3u, 1000u}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](uint64_t i, int worker) {
      EXPECT_GE(worker, 0);
      EXPECT_LT(worker, 4);
      hits[i].fetch_add(1);
    });
    for (uint64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1);
  }
}

TEST(ThreadPoolTest, ManyConsecutiveLoops) {
  ThreadPool pool(3);
  std::atomic<uint64_t> sum{0};
  for (int round = 0; round < 500; ++round) {
    pool.ParallelFor(7, [&](uint64_t i, int) { sum.fetch_add(i); });
  }
  EXPECT_EQ(sum.load(), 500u * 21u);
}

}  // namespace
}  // namespace optimd
