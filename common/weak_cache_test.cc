#include "common/weak_cache.h"

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(WeakCacheTest, FindsWhatIsHeldAndForgetsWhatIsNot) {
  WeakCache<int> cache;
  auto a = std::make_shared<int>(1);
  cache.Put("a", a);
  EXPECT_EQ(cache.Find("a"), a);
  EXPECT_EQ(cache.Find("b"), nullptr);
  {
    auto b = std::make_shared<int>(2);
    cache.Put("b", b);
    EXPECT_EQ(cache.Live(), 2);
  }
  // Nobody holds b: not found, and dropped at the next Put.
  EXPECT_EQ(cache.Find("b"), nullptr);
  EXPECT_EQ(cache.Live(), 1);
  for (int i = 0; i < 1000; ++i) {
    cache.Put("c" + std::to_string(i), std::make_shared<int>(i));
  }
  EXPECT_EQ(cache.Live(), 1);
  // A new object under an old key replaces it.
  auto a2 = std::make_shared<int>(3);
  cache.Put("a", a2);
  EXPECT_EQ(*cache.Find("a"), 3);
}

}  // namespace
}  // namespace optimd
