#include "backends/cuda/step_graph.h"

#include "backends/cuda/cuda_status.h"
#include "common/status_macros.h"

namespace optimd {

absl::StatusOr<cudaGraphExec_t> CaptureStepGraph(
    cudaStream_t capture_stream,
    const std::function<absl::Status(cudaStream_t)>& enqueue) {
  // Thread-local mode: other threads' CUDA calls (another device's worker)
  // neither join nor break this capture.
  OPTIMD_RETURN_IF_CUDA_ERROR(
      cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeThreadLocal));
  const absl::Status enqueued = enqueue(capture_stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(capture_stream, &graph);
  if (!enqueued.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return enqueued;
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(ended);
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  OPTIMD_RETURN_IF_CUDA_ERROR(made);
  return exec;
}

absl::Status LaunchStepGraph(
    cudaGraphExec_t* exec, cudaStream_t capture_stream, cudaStream_t stream,
    const std::function<absl::Status(cudaStream_t)>& enqueue) {
  if (*exec == nullptr) {
    OPTIMD_ASSIGN_OR_RETURN(*exec, CaptureStepGraph(capture_stream, enqueue));
  }
  OPTIMD_RETURN_IF_CUDA_ERROR(cudaGraphLaunch(*exec, stream));
  return absl::OkStatus();
}

}  // namespace optimd
