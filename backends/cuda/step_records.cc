#include "backends/cuda/step_records.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_plan.h"
#include "common/status_macros.h"

namespace optimd {

using cuda::DeviceGroupState;
using cuda::PlanOf;

absl::Status ReadRecord(CudaSession& s, StepRecord& record,
                        const std::vector<Group*>& groups, StepOutcome* out) {
  const DeviceGroupState& totals = record.host[0];
  out->known = true;
  out->skipped = totals.last_skipped != 0;
  out->grad_norm = record.statistics
                       ? std::sqrt(totals.last_sumsq) / record.grad_scale
                       : std::numeric_limits<double>::quiet_NaN();
  out->steps_applied = totals.step;
  out->steps_skipped = totals.skipped;
  // The step has completed: its events can be read.
  float wait_ms = 0, run_ms = 0;
  if (cudaEventElapsedTime(&wait_ms, record.queued, record.began) ==
          cudaSuccess &&
      cudaEventElapsedTime(&run_ms, record.began, record.event) ==
          cudaSuccess) {
    out->device_wait_seconds = wait_ms * 1e-3;
    out->device_seconds = run_ms * 1e-3;
  } else {
    cudaGetLastError();  // not sticky; the outcome is untimed
  }
  if (record.groups == groups.size()) {
    for (uint32_t g = 0; g < record.groups; ++g) {
      groups[g]->step = record.host[1 + g].step;
    }
  }
  s.last = *out;
  s.last_sequence = record.sequence;
  return absl::OkStatus();
}

void RefreshGraphKey(CudaSession& s, const std::vector<Group*>& groups,
                     bool statistics, uint64_t scratch_generation,
                     uint32_t* progress) {
  const uint32_t n = static_cast<uint32_t>(groups.size());
  const auto key_at = [&](size_t i) -> uint64_t {
    if (i == 0) return statistics ? 1 : 0;
    if (i == 1) return scratch_generation;
    if (i == 2) return reinterpret_cast<uintptr_t>(progress);
    const Group* g = groups[(i - 3) / 2];
    // The plan, and what picks the update kernel beside the plan's layouts.
    return (i % 2 == 1) ? PlanOf(*g)->id
                        : (static_cast<uint64_t>(g->hyper.kind) << 1) |
                              (g->hyper.adamw ? 1 : 0);
  };
  const size_t key_size = 3 + 2 * static_cast<size_t>(n);
  bool same_key = s.graph_key.size() == key_size;
  for (size_t i = 0; same_key && i < key_size; ++i) {
    same_key = s.graph_key[i] == key_at(i);
  }
  if (!same_key) {
    for (StepRecord& r : s.records) {
      if (r.exec != nullptr) cudaGraphExecDestroy(r.exec);
      r.exec = nullptr;
    }
    s.graph_key.resize(key_size);
    for (size_t i = 0; i < key_size; ++i) s.graph_key[i] = key_at(i);
  }
}

absl::Status FillRecord(StepRecord& record, const std::vector<Group*>& groups,
                        const StepOptions& options, bool apply_nonfinite,
                        uint64_t ticket,
                        const volatile cuda::AbandonedSteps* abandoned) {
  const uint32_t n = static_cast<uint32_t>(groups.size());
  if (record.capacity < n || record.memory == nullptr) {
    if (record.memory != nullptr) cudaFreeHost(record.memory);
    record.memory = nullptr;
    if (record.exec != nullptr) cudaGraphExecDestroy(record.exec);
    record.exec = nullptr;
    const uint32_t cap = std::max<uint32_t>(n, 1);
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaHostAlloc(
        &record.memory,
        cap * sizeof(cuda::GroupStep) + (cap + 1) * sizeof(DeviceGroupState),
        cudaHostAllocMapped));
    record.args = static_cast<cuda::GroupStep*>(record.memory);
    record.host = reinterpret_cast<DeviceGroupState*>(record.args + cap);
    record.capacity = cap;
  }
  for (uint32_t g = 0; g < n; ++g) {
    auto* plan = PlanOf(*groups[g]);
    const OptimizerHyper& h = groups[g]->hyper;
    cuda::GroupStep& a = record.args[g];
    a.hyper = {h.lr,
               h.beta1,
               h.beta2,
               h.eps,
               h.weight_decay,
               options.grad_scale,
               options.max_grad_norm,
               h.momentum,
               h.dampening,
               static_cast<int32_t>(h.kind),
               h.adamw ? 1 : 0,
               h.bias_correction ? 1 : 0,
               h.maximize ? 1 : 0,
               h.nesterov ? 1 : 0,
               apply_nonfinite ? 1 : 0};
    a.partials = reinterpret_cast<const double*>(plan->partials_d.data());
    a.num_partials = static_cast<uint32_t>(plan->tables[1].blocks.size());
    a.flag_sequence = options.step_flags != nullptr ? options.sequence : 0;
    a.ticket = ticket;
    a.abandoned = abandoned;
    a.state = reinterpret_cast<DeviceGroupState*>(plan->state_d.data());
    a.scalars = reinterpret_cast<cuda::DeviceScalars*>(plan->scalars_d.data());
    a.absent = reinterpret_cast<const uint32_t*>(plan->absent_d.data());
    a.missed = reinterpret_cast<uint32_t*>(plan->missed_d.data());
  }
  return absl::OkStatus();
}

absl::Status WaitForStep(const CudaSession& s, cudaEvent_t event) {
  if (s.job != nullptr) return s.job->Wait(event);
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event));
  return absl::OkStatus();
}

absl::Status RecycleRecord(CudaSession& s, StepRecord& record,
                           const std::vector<Group*>& groups) {
  if (record.sequence != 0) {
    OPTIMD_RETURN_IF_ERROR(WaitForStep(s, record.event));
    if (record.sequence > s.last_sequence && !record.failed) {
      StepOutcome ignored;
      OPTIMD_RETURN_IF_ERROR(ReadRecord(s, record, groups, &ignored));
    }
    record.sequence = 0;
    record.failed = false;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOutcome> ReadOutcome(CudaSession& s, StepRecord& record,
                                        const std::vector<Group*>& groups,
                                        bool wait, uint64_t seq) {
  StepOutcome out;
  if (wait) {
    OPTIMD_RETURN_IF_ERROR(WaitForStep(s, record.event));
    OPTIMD_RETURN_IF_ERROR(ReadRecord(s, record, groups, &out));
    out.current = true;
    out.timing_fresh = true;
  } else {
    // Steps complete in stream order: the oldest unread record first, up to
    // the first one still running.
    StepRecord* newest = nullptr;
    for (uint64_t q = s.last_sequence + 1; q <= seq; ++q) {
      StepRecord& r = s.records[q % s.records.size()];
      if (r.sequence != q) continue;
      const cudaError_t e = cudaEventQuery(r.event);
      if (e == cudaErrorNotReady) break;
      OPTIMD_RETURN_IF_CUDA_ERROR(e);
      if (!r.failed) newest = &r;
    }
    if (newest != nullptr) {
      OPTIMD_RETURN_IF_ERROR(ReadRecord(s, *newest, groups, &out));
    }
    out = s.last;
    out.current = s.last_sequence == seq;
    out.timing_fresh = newest != nullptr;
  }
  return out;
}

}  // namespace optimd
