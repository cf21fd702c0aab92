// Step graphs: a step's kernels captured once into a CUDA graph, so that
// a step is one graph launch whatever its number of groups and layouts;
// the graph is replayed until its step record's key changes
// (RefreshGraphKey, step_records.h).
// Thread-compatible: the capture stream is the caller's alone.
#ifndef OPTIMD_BACKENDS_CUDA_STEP_GRAPH_H_
#define OPTIMD_BACKENDS_CUDA_STEP_GRAPH_H_

#include <cuda_runtime.h>

#include <functional>

#include "absl/status/statusor.h"

namespace optimd {

// Captures what `enqueue` enqueues on `capture_stream` (a stream that runs
// no work of its own) and instantiates it. A failure of `enqueue` or of the
// capture leaves nothing behind.
absl::StatusOr<cudaGraphExec_t> CaptureStepGraph(
    cudaStream_t capture_stream,
    const std::function<absl::Status(cudaStream_t)>& enqueue);

// Launches on `stream` the graph `*exec` of a step, first capturing it
// with `enqueue` (CaptureStepGraph) when *exec is null: a step record's
// graph is captured once and replayed by its later steps.
absl::Status LaunchStepGraph(
    cudaGraphExec_t* exec, cudaStream_t capture_stream, cudaStream_t stream,
    const std::function<absl::Status(cudaStream_t)>& enqueue);

}  // namespace optimd

#endif  // OPTIMD_BACKENDS_CUDA_STEP_GRAPH_H_
