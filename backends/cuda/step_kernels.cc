#include "backends/cuda/step_kernels.h"

#include <algorithm>
#include <utility>

#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/device_plan.h"
#include "common/status_macros.h"
#include "kernels/fp8_cuda.h"
#include "kernels/step_cuda.h"

namespace optimd {
namespace {

using cuda::DeviceGroupState;
using cuda::Launch;
using cuda::LaunchWork;
using cuda::PlanOf;

// The update of one launch. FP8 parameters whose units its warp blocks do
// not hold whole (cuda::Fp8Pass) have their amax words zeroed before it
// and an encode pass after it.
absl::Status LaunchUpdate(const Group& group, const Launch& launch,
                          cudaStream_t stream) {
  const auto* plan = PlanOf(group);
  auto* scalars =
      reinterpret_cast<cuda::DeviceScalars*>(plan->scalars_d.data());
  const bool encode = launch.fp8_amax_words > 0;
  if (encode) {
    auto* amax = reinterpret_cast<uint32_t*>(plan->fp8_amax_d.data());
    OPTIMD_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(amax + launch.fp8_amax_first, 0,
                        launch.fp8_amax_words * sizeof(uint32_t), stream));
  }
  OPTIMD_RETURN_IF_ERROR(cuda::LaunchUpdate(group.hyper, launch.layout,
                                            LaunchWork(*plan, launch, 0),
                                            scalars, stream));
  if (!encode) return absl::OkStatus();
  return cuda::LaunchFp8Encode(launch.layout.param_dtype == DType::kFloat8E5M2,
                               launch.layout.fp8_recipe,
                               LaunchWork(*plan, launch, 1), scalars, stream);
}

// The updates of every group stage by stage, writing *progress = s + 1
// after stage s (past every stage after the last).
absl::Status EnqueueStagedUpdates(const std::vector<Group*>& groups,
                                  uint32_t* progress, cudaStream_t stream) {
  // Each plan's launches are sorted by stage: walk them all in step.
  std::vector<size_t> next(groups.size(), 0);
  const auto launches = [&](size_t g) -> const std::vector<Launch>& {
    return PlanOf(*groups[g])->launches;
  };
  for (;;) {
    uint32_t stage = kMaxStage + 1;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (next[g] < launches(g).size()) {
        stage = std::min(stage, launches(g)[next[g]].stage);
      }
    }
    if (stage > kMaxStage) break;
    uint32_t later = kMaxStage + 1;  // the next stage after this one
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::vector<Launch>& launches_of = launches(g);
      for (;
           next[g] < launches_of.size() && launches_of[next[g]].stage == stage;
           ++next[g]) {
        OPTIMD_RETURN_IF_ERROR(
            LaunchUpdate(*groups[g], launches_of[next[g]], stream));
      }
      if (next[g] < launches_of.size())
        later = std::min(later, launches_of[next[g]].stage);
    }
    // After the last stage: past every stage, so that a wait for a stage
    // without steppable tensors (frozen, no gradient) ends too.
    OPTIMD_RETURN_IF_ERROR(cuda::LaunchWriteProgress(
        progress, later > kMaxStage ? kPastEveryStage : stage + 1, stream));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GrowStepScratch(int device, uint32_t groups,
                             StepScratch& scratch) {
  if (groups <= scratch.capacity) return absl::OkStatus();
  const uint32_t cap = std::max<uint32_t>(groups, 2 * scratch.capacity);
  // Each group's sum, then the job's total, non-finite and rank counts.
  // Both are allocated before either replaces the old one: a failure
  // leaves the scratch as it was, which the cached step graphs (keyed on
  // its generation) still point at.
  OPTIMD_ASSIGN_OR_RETURN(StateStorage sums_d,
                          DeviceAlloc(device, (cap + 3) * sizeof(double)));
  OPTIMD_ASSIGN_OR_RETURN(StateStorage steps_d,
                          DeviceAlloc(device, cap * sizeof(cuda::GroupStep)));
  scratch.sums_d = std::move(sums_d);
  scratch.steps_d = std::move(steps_d);
  scratch.capacity = cap;
  ++scratch.generation;
  return absl::OkStatus();
}

absl::Status EnqueueStepKernels(const CudaSession& s,
                                const std::vector<Group*>& groups,
                                const StepRecord& record,
                                const StepScratch& scratch, bool statistics,
                                uint32_t* progress, NcclJob::Lease* lease,
                                cudaStream_t stream) {
  const uint32_t n = static_cast<uint32_t>(groups.size());
  double* sums = reinterpret_cast<double*>(scratch.sums_d.data());
  auto* steps = reinterpret_cast<cuda::GroupStep*>(scratch.steps_d.data());
  for (uint32_t g = 0; g < (statistics ? n : 0); ++g) {
    auto* plan = PlanOf(*groups[g]);
    auto* partials = reinterpret_cast<double*>(plan->partials_d.data());
    for (const Launch& launch : plan->whole_launches) {
      OPTIMD_RETURN_IF_ERROR(cuda::LaunchGradSumSquares(
          launch.layout.grad_dtype, LaunchWork(*plan, launch, 1),
          partials + launch.first_block[1], stream));
    }
  }
  OPTIMD_RETURN_IF_ERROR(cuda::LaunchReduceSums(
      record.args, steps, n, statistics,
      s.job == nullptr || s.job->contributes_norm(), sums, stream));
  if (lease != nullptr) {
    OPTIMD_RETURN_IF_ERROR(lease->EnqueueAllReduce(sums + n, stream));
  }
  const uint32_t ranks = s.job == nullptr ? 1 : s.job->world_size();
  OPTIMD_RETURN_IF_ERROR(
      cuda::LaunchMakeScalars(steps, n, sums, ranks, stream));
  if (progress != nullptr) {
    OPTIMD_RETURN_IF_ERROR(EnqueueStagedUpdates(groups, progress, stream));
  } else {
    for (const Group* g : groups) {
      for (const Launch& launch : PlanOf(*g)->whole_launches) {
        OPTIMD_RETURN_IF_ERROR(LaunchUpdate(*g, launch, stream));
      }
    }
  }
  return cuda::LaunchCommitSteps(
      steps, n, sums, ranks,
      reinterpret_cast<DeviceGroupState*>(s.totals_d.data()), record.host,
      stream);
}

}  // namespace optimd
