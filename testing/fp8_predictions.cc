#include "testing/fp8_predictions.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/device_plan.h"

namespace optimd {

absl::StatusOr<std::vector<cuda::Fp8Prediction>> ReadFp8Predictions(
    Session& session) {
  return session.WithGroups(
      [](const auto& groups)
          -> absl::StatusOr<std::vector<cuda::Fp8Prediction>> {
        if (groups.empty()) {
          return absl::FailedPreconditionError("the session has no group");
        }
        const cuda::DevicePlan* plan = cuda::PlanOf(*groups.front());
        std::vector<cuda::Fp8Prediction> out(std::count_if(
            plan->fp8.begin(), plan->fp8.end(), [](const auto& t) {
              return t.pass == cuda::Fp8Pass::kTensorAmax;
            }));
        const cudaError_t e = cudaMemcpy(
            out.data(), plan->fp8_predictions_d.data(),
            out.size() * sizeof(cuda::Fp8Prediction), cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
          return absl::InternalError(absl::StrCat(
              "reading the amax predictions: ", cudaGetErrorString(e)));
        }
        return out;
      });
}

}  // namespace optimd
