// Host entry to the exhaustive check of kernels/cuda_math.cuh on the GPU.
#ifndef OPTIMD_TESTS_CUDA_MATH_CHECK_H_
#define OPTIMD_TESTS_CUDA_MATH_CHECK_H_

#include <cstdint>
#include <string>

namespace optimd {
namespace testing {

struct DivisionCheck {
  uint64_t compared = 0;
  uint64_t mismatches = 0;
  uint32_t first_bad_bits = 0;  // the smallest x (as bits) that differed
  std::string error;            // a CUDA call failed: its name and error
};

// Compares DivByRecip(a, b, RN(1/b)) with IEEE division a / b on the GPU for
// a = sqrt(x) (the step kernels divide square roots) and every float x from
// +0 up to the first quiet NaN: all non-negative finite numbers, subnormal
// ones included, +infinity and the signalling NaNs. Equal means the same
// bits, or both NaN.
DivisionCheck CheckDivisionByRecip(float b);

}  // namespace testing
}  // namespace optimd

#endif  // OPTIMD_TESTS_CUDA_MATH_CHECK_H_
