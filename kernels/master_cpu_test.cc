#include "kernels/master_cpu.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(MasterCpuTest, SumSquaresFlagsNonFinite) {
  std::vector<float> g = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  EXPECT_DOUBLE_EQ(GradSumSquaresRange(DType::kFloat32, g.data(), 0, 11), 506);
  EXPECT_DOUBLE_EQ(GradSumSquaresRange(DType::kFloat32, g.data(), 2, 4), 25);
  g[9] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(
      std::isfinite(GradSumSquaresRange(DType::kFloat32, g.data(), 0, 11)));
  g[9] = std::nanf("");
  EXPECT_FALSE(
      std::isfinite(GradSumSquaresRange(DType::kFloat32, g.data(), 0, 11)));
  std::vector<uint16_t> h = {FloatToHalf(3.0f), FloatToHalf(4.0f)};
  EXPECT_DOUBLE_EQ(GradSumSquaresRange(DType::kFloat16, h.data(), 0, 2), 25);
}

// float64 gradients are read as doubles: squares far below fp32's range
// still count.
TEST(MasterCpuTest, Float64GradientSumOfSquares) {
  const std::vector<double> g = {1e-30, -2e-30, 3.0, -4.0};
  EXPECT_EQ(GradSumSquaresRange(DType::kFloat64, g.data(), 0, 2),
            1e-30 * 1e-30 + 2e-30 * 2e-30);
  EXPECT_EQ(GradSumSquaresRange(DType::kFloat64, g.data(), 2, 4), 25.0);
}

}  // namespace
}  // namespace optimd
