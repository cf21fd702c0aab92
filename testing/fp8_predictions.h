// Reads back the CUDA backend's per-tensor FP8 amax predictions
// (cuda::Fp8Prediction), for tests and benchmarks that count how often the
// encode pass read the masters back.
#ifndef OPTIMD_TESTING_FP8_PREDICTIONS_H_
#define OPTIMD_TESTING_FP8_PREDICTIONS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "core/session.h"
#include "kernels/cuda_step_types.h"

namespace optimd {

// The predictions of the per-tensor-scaled FP8 parameters of `session`'s
// first group (a CUDA session), in plan order. Waits for the device.
absl::StatusOr<std::vector<cuda::Fp8Prediction>> ReadFp8Predictions(
    Session& session);

}  // namespace optimd

#endif  // OPTIMD_TESTING_FP8_PREDICTIONS_H_
