#include "backends/cuda/device_plan_memory.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "common/status_macros.h"

namespace optimd {
namespace cuda {
namespace {

// Enqueues the copy of rows [first, end) of `host` into their places in
// `device`, its device copy.
template <typename T>
absl::Status UploadRows(cudaStream_t stream, const std::vector<T>& host,
                        const StateStorage& device, uint32_t first,
                        uint32_t end) {
  auto* rows_d = reinterpret_cast<T*>(device.data());
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(rows_d + first, &host[first],
                                              (end - first) * sizeof(T),
                                              cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

// Allocates the FP8 parameters' table, amax words and amax predictions,
// points each FP8 parameter at its words and each of its items at its
// table row, and uploads the table and the unit tasks (the items follow in
// UploadPlan).
absl::Status UploadFp8(int device, cudaStream_t stream, DevicePlan& plan) {
  OPTIMD_ASSIGN_OR_RETURN(
      plan.fp8_d, DeviceAlloc(device, std::max<uint64_t>(1, plan.fp8.size()) *
                                          sizeof(DeviceFp8Tensor)));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.fp8_amax_d,
      DeviceAlloc(device, std::max<uint64_t>(1, plan.fp8_amax_words) *
                              sizeof(uint32_t)));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(plan.fp8_amax_d.data(), 0,
                                              plan.fp8_amax_d.size(), stream));
  const uint64_t predictions = std::count_if(
      plan.fp8.begin(), plan.fp8.end(),
      [](const auto& t) { return t.pass == Fp8Pass::kTensorAmax; });
  OPTIMD_ASSIGN_OR_RETURN(
      plan.fp8_predictions_d,
      DeviceAlloc(device,
                  std::max<uint64_t>(1, predictions) * sizeof(Fp8Prediction)));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      plan.fp8_predictions_d.data(), 0, plan.fp8_predictions_d.size(), stream));
  auto* rows_d = reinterpret_cast<DeviceFp8Tensor*>(plan.fp8_d.data());
  auto* amax_d = reinterpret_cast<uint32_t*>(plan.fp8_amax_d.data());
  auto* prediction_d =
      reinterpret_cast<Fp8Prediction*>(plan.fp8_predictions_d.data());
  for (size_t f = 0; f < plan.fp8.size(); ++f) {
    DeviceFp8Tensor& t = plan.fp8[f];
    t.amax = HasEncodePass(t.pass) ? amax_d + t.amax_first : nullptr;
    t.prediction = t.pass == Fp8Pass::kTensorAmax ? prediction_d++ : nullptr;
    const auto [first, end] = plan.entry_items[t.entry];
    for (uint32_t c = first; c < end; ++c) plan.items[c].scales = rows_d + f;
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(plan.fp8_d.data(), plan.fp8.data(),
                      plan.fp8.size() * sizeof(DeviceFp8Tensor),
                      cudaMemcpyHostToDevice, stream));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.unit_tasks_d,
      DeviceAlloc(device, std::max<uint64_t>(1, plan.unit_tasks.size()) *
                              sizeof(UnitTask)));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(plan.unit_tasks_d.data(), plan.unit_tasks.data(),
                      plan.unit_tasks.size() * sizeof(UnitTask),
                      cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

}  // namespace

absl::Status UploadPlan(int device, cudaStream_t stream, DevicePlan& plan) {
  OPTIMD_RETURN_IF_ERROR(UploadFp8(device, stream, plan));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.items_d,
      DeviceAlloc(device, std::max<uint64_t>(1, plan.items.size()) *
                              sizeof(DeviceItem)));
  for (BlockTable& t : plan.tables) {
    OPTIMD_ASSIGN_OR_RETURN(
        t.blocks_d, DeviceAlloc(device, std::max<uint64_t>(1, t.blocks.size()) *
                                            sizeof(DeviceBlock)));
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
        t.blocks_d.data(), t.blocks.data(),
        t.blocks.size() * sizeof(DeviceBlock), cudaMemcpyHostToDevice, stream));
  }
  // One partial per work block of the statistics pass.
  OPTIMD_ASSIGN_OR_RETURN(
      plan.partials_d,
      DeviceAlloc(device, std::max<uint64_t>(1, plan.tables[1].blocks.size()) *
                              sizeof(double)));
  OPTIMD_ASSIGN_OR_RETURN(plan.state_d,
                          DeviceAlloc(device, sizeof(DeviceGroupState)));
  OPTIMD_ASSIGN_OR_RETURN(plan.scalars_d,
                          DeviceAlloc(device, sizeof(DeviceScalars)));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      plan.items_d.data(), plan.items.data(),
      plan.items.size() * sizeof(DeviceItem), cudaMemcpyHostToDevice, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      plan.state_d.data(), 0, sizeof(DeviceGroupState), stream));
  const uint64_t entries = plan.entry_items.size();
  OPTIMD_ASSIGN_OR_RETURN(
      plan.missed_d,
      DeviceAlloc(device, std::max<uint64_t>(1, entries) * sizeof(uint32_t)));
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(plan.missed_d.data(), 0, plan.missed_d.size(), stream));
  OPTIMD_ASSIGN_OR_RETURN(
      plan.absent_d, DeviceAlloc(device, (entries + 1) * sizeof(uint32_t)));
  return UploadAbsent(stream, plan);
}

absl::Status UploadAbsent(cudaStream_t stream, DevicePlan& plan) {
  std::vector<uint32_t> absent = AbsentEntries(plan);
  if (absent == plan.absent) return absl::OkStatus();
  plan.absent = std::move(absent);
  // Pageable: staged when enqueued, so plan.absent may change right after.
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      plan.absent_d.data(), plan.absent.data(),
      plan.absent.size() * sizeof(uint32_t), cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status UploadTableChanges(cudaStream_t stream,
                                const TableChanges& changes, DevicePlan& plan) {
  // Copies from pageable memory are staged when enqueued, so the host
  // tables may change again at once; stream order puts them after the
  // steps already queued and before the next.
  for (const auto& [first, end] : changes.items) {
    OPTIMD_RETURN_IF_ERROR(
        UploadRows(stream, plan.items, plan.items_d, first, end));
  }
  // The work blocks holding those items, recounted.
  for (int t = 0; t < 2; ++t) {
    const BlockTable& table = plan.tables[t];
    for (const auto& [first, end] : changes.blocks[t]) {
      OPTIMD_RETURN_IF_ERROR(
          UploadRows(stream, table.blocks, table.blocks_d, first, end));
    }
  }
  // The absent list walks every entry: only when some absence changed, so
  // that moved gradients cost the host about their own number.
  if (changes.absence_changed)
    OPTIMD_RETURN_IF_ERROR(UploadAbsent(stream, plan));
  return absl::OkStatus();
}

absl::Status ReadGroupCounters(cudaStream_t stream, const DevicePlan& plan,
                               Group& group) {
  DeviceGroupState state;
  std::vector<uint32_t> missed(group.plan.entries.size());
  // On the daemon's stream (non-blocking, so not ordered with the legacy
  // stream a plain cudaMemcpy takes), then waited for.
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(&state, plan.state_d.data(),
                                              sizeof(state),
                                              cudaMemcpyDeviceToHost, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      missed.data(), plan.missed_d.data(), missed.size() * sizeof(uint32_t),
      cudaMemcpyDeviceToHost, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  group.step = state.step;
  for (uint32_t e = 0; e < missed.size(); ++e) {
    group.tensors[group.plan.tensor_index[e]].missed_steps = missed[e];
  }
  return absl::OkStatus();
}

absl::Status WriteGroupCounters(cudaStream_t stream, DevicePlan& plan,
                                Group& group, uint64_t step) {
  DeviceGroupState state;
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(&state, plan.state_d.data(),
                                              sizeof(state),
                                              cudaMemcpyDeviceToHost, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  state.step = step;
  std::vector<uint32_t> missed(group.plan.entries.size());
  for (uint32_t e = 0; e < missed.size(); ++e) {
    missed[e] = static_cast<uint32_t>(std::min<uint64_t>(
        group.tensors[group.plan.tensor_index[e]].missed_steps,
        std::numeric_limits<uint32_t>::max()));
  }
  // Copies from pageable memory on the daemon's stream: the next step's
  // kernels (on that stream) read the new counters, and the host buffers
  // stay alive until the copies are done (the wait below).
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(plan.state_d.data(), &state,
                                              sizeof(state),
                                              cudaMemcpyHostToDevice, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(
      plan.missed_d.data(), missed.data(), missed.size() * sizeof(uint32_t),
      cudaMemcpyHostToDevice, stream));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  group.step = step;
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace optimd
