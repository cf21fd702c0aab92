#include "backends/cuda/cuda_session.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/device_memory.h"
#include "common/status_macros.h"

namespace optimd {
namespace {

// The trainer's interprocess ready event into *ready (left null on
// failure, with no sticky CUDA error).
absl::Status OpenReadyEvent(int device, const std::string& ready_event,
                            cudaEvent_t* ready) {
  if (ready_event.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ready_event must be a ", sizeof(cudaIpcEventHandle_t),
                     "-byte cudaIpcEventHandle_t"));
  }
  cudaIpcEventHandle_t h;
  std::memcpy(&h, ready_event.data(), sizeof(h));
  const cudaError_t e = cudaIpcOpenEventHandle(ready, h);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *ready = nullptr;
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open the trainer's ready_event (", cudaGetErrorName(e),
        "); it must come from cudaIpcGetEventHandle on an event created "
        "with cudaEventInterprocess | cudaEventDisableTiming on GPU ",
        device));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaSession>> OpenCudaSession(
    int device, cudaStream_t stream, const std::string& ready_event,
    int step_records, bool blocking_sync, std::string* done_event) {
  auto s = std::make_unique<CudaSession>();
  s->stream = stream;
  if (!ready_event.empty()) {
    OPTIMD_RETURN_IF_ERROR(OpenReadyEvent(device, ready_event, &s->ready));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(
      &s->done, cudaEventDisableTiming | cudaEventInterprocess));
  cudaIpcEventHandle_t done_handle;
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaIpcGetEventHandle(&done_handle, s->done));
  done_event->assign(reinterpret_cast<const char*>(&done_handle),
                     sizeof(done_handle));
  OPTIMD_ASSIGN_OR_RETURN(s->totals_d,
                          DeviceAlloc(device, sizeof(cuda::DeviceGroupState)));
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(
      s->totals_d.data(), 0, sizeof(cuda::DeviceGroupState), stream));
  s->records.resize(std::max(2, step_records));
  const unsigned event_flags = blocking_sync ? cudaEventBlockingSync : 0u;
  for (StepRecord& record : s->records) {
    for (cudaEvent_t* e : {&record.queued, &record.began, &record.event}) {
      OPTIMD_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(e, event_flags));
    }
  }
  OPTIMD_ASSIGN_OR_RETURN(s->rescue, StepRescue::Create());
  s->last.known = false;
  return s;
}

}  // namespace optimd
