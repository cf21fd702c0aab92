#!/usr/bin/env bash
# Builds the GPU tests, benchmarks and the daemon here, and bundles them with
# their shared libraries into .gpu/ (the Python client and its stubs travel
# in the tree), for a GPU machine that has the CUDA driver but no Bazel,
# gRPC or Abseil. Then, on that machine, from the repository root:
# tools/gpu_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${BUNDLE_TOOL:-../shared/tools/gpu-bundle}
targets=(//tests:cuda_backend_test //tests:cuda_math_test
         //bench:cuda_step_bench //bench:step_latency //server:optimd)
bazel build "${targets[@]}"
rm -rf .gpu
"$bundle" .gpu bazel-bin/tests/cuda_backend_test bazel-bin/tests/cuda_math_test \
    bazel-bin/bench/cuda_step_bench bazel-bin/bench/step_latency \
    bazel-bin/server/optimd
# NCCL (over 200 MB) is not bundled: the GPU machine has torch's own
# (nvidia-nccl-cu13), which tools/gpu_test.sh puts on the library path.
rm -f .gpu/lib/libnccl.so*
echo "== bundled into .gpu; on the GPU machine run tools/gpu_test.sh [--bench]"
