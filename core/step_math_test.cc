#include "core/step_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace optimd {
namespace {

int64_t Ulps(double a, double b) {
  int64_t x, y;
  std::memcpy(&x, &a, 8);
  std::memcpy(&y, &b, 8);
  return x > y ? x - y : y - x;
}

TEST(StepMathTest, BetaPowerOfSmallExponentsIsExact) {
  EXPECT_EQ(BetaPower(0.9, 0), 1.0);
  EXPECT_EQ(BetaPower(0.9, 1), 0.9);
  EXPECT_EQ(BetaPower(0.5, 10), 1.0 / 1024);
  EXPECT_EQ(BetaPower(0.0, 3), 0.0);
  EXPECT_EQ(BetaPower(1.0, 123456789), 1.0);
}

// Within one ulp of the C library's pow (itself within an ulp of the true
// power) for every step a bias correction sees, and most often equal.
TEST(StepMathTest, BetaPowerIsWithinAnUlpOfPow) {
  for (const double beta : {0.9, 0.95, 0.99, 0.999, 0.9999}) {
    int differ = 0;
    for (uint64_t t = 1; t <= 200000; ++t) {
      const double want = std::pow(beta, static_cast<double>(t));
      const double got = BetaPower(beta, t);
      ASSERT_LE(Ulps(got, want), 1) << beta << "^" << t;
      differ += got != want;
    }
    EXPECT_LT(differ, 200000 / 50) << beta;
  }
}

}  // namespace
}  // namespace optimd
