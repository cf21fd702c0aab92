// The CUDA backend's side of a session: its stream and interprocess events,
// the pinned step records of the steps in flight, and the key of the step
// graphs captured for them; opened here and released by its destructor.
// Filling and reading the records is step_records.h's; enqueuing the
// steps step_kernels.h's. Not thread-safe: used only by the device's
// worker, except `rescue` (trainer_gone.h).
#ifndef OPTIMD_BACKENDS_CUDA_CUDA_SESSION_H_
#define OPTIMD_BACKENDS_CUDA_CUDA_SESSION_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "backends/cuda/nccl_job.h"
#include "backends/cuda/trainer_gone.h"
#include "core/backend.h"
#include "core/buffer.h"
#include "core/group.h"
#include "kernels/cuda_step_types.h"

namespace optimd {

// Pinned records, one per step in flight: the step's arguments, which its
// kernels read, and its counters, which they write, so that a reply can
// report the last completed step without waiting. A record is reused only
// after its event has completed.
struct StepRecord {
  // Timing events on the device's stream: `queued` where it reached the
  // step, `began` after the wait for the trainer's ready flag, `event` at
  // its end (and what completion is waited on).
  cudaEvent_t queued = nullptr;
  cudaEvent_t began = nullptr;
  cudaEvent_t event = nullptr;
  void* memory = nullptr;                  // cudaHostAlloc'd: args, then host
  cuda::GroupStep* args = nullptr;         // [g]: group g's step arguments
  cuda::DeviceGroupState* host = nullptr;  // [0]: session totals, [1+g]: groups
  uint32_t capacity = 0;                   // groups
  uint32_t groups = 0;
  uint64_t sequence = 0;  // 0: never used
  // How its step was asked for: the norm it reports is unscaled by this
  // step's own grad_scale (NaN without the statistics pass).
  double grad_scale = 1;
  bool statistics = true;
  // Its launch failed part-way: what was enqueued may still run, so the
  // record is held until `event` (recorded after it) completes, and never
  // read as an outcome.
  bool failed = false;
  // The step's kernels as a CUDA graph bound to this record's memory, for the
  // session's current groups (CudaSession::graph_key); nullptr until built.
  cudaGraphExec_t exec = nullptr;
};

// The backend's side of one session (core's SessionContext). Written only
// by the backend's methods, on the device's worker.
class CudaSession : public SessionContext {
 public:
  ~CudaSession() override {
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (StepRecord& s : records) {
      for (cudaEvent_t e : {s.queued, s.began, s.event}) {
        if (e != nullptr) cudaEventDestroy(e);
      }
      if (s.memory != nullptr) cudaFreeHost(s.memory);
      if (s.exec != nullptr) cudaGraphExecDestroy(s.exec);
    }
    if (ready != nullptr) cudaEventDestroy(ready);
    if (done != nullptr) cudaEventDestroy(done);
  }

  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // the trainer's, opened by IPC
  cudaEvent_t done = nullptr;   // ours, exported by IPC
  StateStorage totals_d;        // DeviceGroupState
  std::vector<StepRecord> records;
  uint64_t sequence = 0;
  StepOutcome last;  // the newest outcome seen complete
  uint64_t last_sequence = 0;
  std::vector<uint64_t> last_group_steps;
  // What the records' graphs were built for: the statistics flag, the
  // backend's scratch generation, and each group's plan and update flavour.
  std::vector<uint64_t> graph_key;
  // The job's ranks agreeing on the device (JoinJob); null otherwise.
  std::shared_ptr<NcclJob> job;
  // The waits for the trainer's ready flag, let through if it dies (the
  // one member used from other threads: its own lock).
  std::unique_ptr<StepRescue> rescue;
};

// Opens the backend's side of a session on GPU `device` (current), which
// steps on `stream`: the trainer's `ready_event` (a cudaIpcEventHandle_t,
// or empty), the daemon's done event, exported into *done_event, the
// session's device totals (zeroed on `stream`) and `step_records` step
// records with their timing events (waited on blocking in the driver
// with `blocking_sync`, else spinning). INVALID_ARGUMENT for a ready event
// that cannot be opened. The caller waits for `stream` before the first
// step.
absl::StatusOr<std::unique_ptr<CudaSession>> OpenCudaSession(
    int device, cudaStream_t stream, const std::string& ready_event,
    int step_records, bool blocking_sync, std::string* done_event);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_CUDA_SESSION_H_
