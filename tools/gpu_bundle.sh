#!/usr/bin/env bash
# Builds the GPU tests, benchmarks and the daemon here, and bundles them with
# their shared libraries into .gpu/ (the Python client and its stubs travel
# in the tree), for a GPU machine that has the CUDA driver but no Bazel,
# gRPC or Abseil. Then, on that machine, from the repository root:
# tools/gpu_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${BUNDLE_TOOL:-../shared/tools/gpu-bundle}
# --tests_only leaves out the two C++ benchmarks: the device machine takes
# the tree and the bundle together up to 64 MiB, and the full bundle is
# close to that.
targets=(//tests:cuda_backend_test //tests:cuda_math_test //server:optimd
  //client:liboptimd_step_channel.so)
if [ "${1:-}" != "--tests_only" ]; then
  targets+=(//bench:cuda_step_bench //bench:step_latency)
fi
bazel build "${targets[@]}"
rm -rf .gpu
binaries=()
for t in "${targets[@]}"; do binaries+=("bazel-bin/$(echo "${t#//}" | tr : /)"); done
"$bundle" .gpu "${binaries[@]}"
# NCCL (over 200 MB) is not bundled: the GPU machine has torch's own
# (nvidia-nccl-cu13), which tools/gpu_test.sh puts on the library path.
rm -f .gpu/lib/libnccl.so*
echo "== bundled into .gpu; on the GPU machine run tools/gpu_test.sh [--bench]"
