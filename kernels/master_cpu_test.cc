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

// Elements whose parameter differs from what the master gives take the
// parameter's value; the others keep their masters' extra precision, and
// a zero's sign counts as a write.
TEST(MasterCpuTest, WrittenParameterElementsSetTheirMasters) {
  Layout bf16;
  bf16.param_dtype = DType::kBFloat16;
  bf16.master = MasterKind::kFp32;
  std::vector<float> master = {1.0001f, 2.5f, -3.0f, 0.0f};
  std::vector<uint16_t> param(4);
  TensorPointers t;
  t.param = param.data();
  t.master = master.data();
  WriteParamFromMasterRange(bf16, t, 0, 4);
  param[1] = FloatToBFloat16(7.0f);
  param[3] = FloatToBFloat16(-0.0f);
  AdoptWrittenParamRange(bf16, t, 0, 4);
  EXPECT_EQ(master[0], 1.0001f);  // kept: rounds to its parameter
  EXPECT_EQ(master[1], 7.0f);
  EXPECT_EQ(master[2], -3.0f);
  EXPECT_TRUE(std::signbit(master[3]));

  Layout fp32 = bf16;  // master_weights over fp32 parameters
  fp32.param_dtype = DType::kFloat32;
  std::vector<float> p32 = {1.5f, 2.0f};
  std::vector<float> m32 = {1.5f, 4.0f};
  t.param = p32.data();
  t.master = m32.data();
  AdoptWrittenParamRange(fp32, t, 0, 2);
  EXPECT_EQ(m32, (std::vector<float>{1.5f, 2.0f}));

  Layout fp16 = bf16;
  fp16.param_dtype = DType::kFloat16;
  std::vector<float> m16 = {std::nanf(""), 1.0f, 3.0f};
  std::vector<uint16_t> p16 = {FloatToHalf(-std::nanf("")),
                               FloatToHalf(std::nanf("")), FloatToHalf(3.0f)};
  t.param = p16.data();
  t.master = m16.data();
  AdoptWrittenParamRange(fp16, t, 0, 3);
  EXPECT_TRUE(std::isnan(m16[0]) && !std::signbit(m16[0]));  // NaN stays
  EXPECT_TRUE(std::isnan(m16[1]));                           // written NaN
  EXPECT_EQ(m16[2], 3.0f);

  // A remainder layout keeps its remainders, but under a written +-0 or
  // +-inf: with a negative remainder, +0 read back as a NaN master (and
  // the weight stayed 0 for good), +inf as a finite one.
  Layout remainder = bf16;
  remainder.master = MasterKind::kRemainder;
  std::vector<uint16_t> high = {
      FloatToBFloat16(1.0f), FloatToBFloat16(0.0f), FloatToBFloat16(-0.0f),
      FloatToBFloat16(INFINITY), FloatToBFloat16(-INFINITY)};
  std::vector<int16_t> rest = {-5, -6, -7, -8, 9};
  t.param = high.data();
  t.master = rest.data();
  AdoptWrittenParamRange(remainder, t, 0, 5);
  EXPECT_EQ(rest, (std::vector<int16_t>{-5, 0, 0, 0, 0}));
}

}  // namespace
}  // namespace optimd
