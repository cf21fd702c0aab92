// A group's device plan (device_plan.h) in device memory: its tables
// allocated and uploaded when the plan is built, brought up to date when
// buffers move, and the device-resident counters (the group's step, each
// entry's missed steps) read and written. Copies are enqueued on the
// device's stream; the caller synchronizes where it reads the results. Not
// thread-safe: used by the device's worker, under the session's lock.
#ifndef OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_MEMORY_H_
#define OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_MEMORY_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "backends/cuda/device_plan.h"
#include "core/group.h"

namespace optimd {
namespace cuda {

// Allocates on GPU `device` every device table of `plan`, whose host
// tables are built, and enqueues their upload on `stream`; the group's
// device state and missed steps start at zero.
absl::Status UploadPlan(int device, cudaStream_t stream, DevicePlan& plan);

// Uploads the list of the plan's entries without a gradient, if it
// changed.
absl::Status UploadAbsent(cudaStream_t stream, DevicePlan& plan);

// Uploads the parts of the host tables that `changes` (RefreshEntries)
// names, and the absent list if an absence changed.
absl::Status UploadTableChanges(cudaStream_t stream,
                                const TableChanges& changes, DevicePlan& plan);

// Reads the plan's step counter into group.step and each entry's missed
// steps into its tensor, copied on `stream` (the daemon's, whose steps
// write them) and waited for.
absl::Status ReadGroupCounters(cudaStream_t stream, const DevicePlan& plan,
                               Group& group);

// Writes `step` as the group's step counter (device and group.step) and
// each tensor's missed steps into the plan's, copied on `stream` (the
// daemon's, whose steps read them) and waited for.
absl::Status WriteGroupCounters(cudaStream_t stream, DevicePlan& plan,
                                Group& group, uint64_t step);

}  // namespace cuda
}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_DEVICE_PLAN_MEMORY_H_
