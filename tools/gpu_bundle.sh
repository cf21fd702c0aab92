#!/usr/bin/env bash
# Builds the GPU tests, benchmarks and the daemon here, and bundles them with
# their shared libraries into .gpu/ (the Python client and its stubs travel
# in the tree), for a GPU machine that has the CUDA driver but no Bazel,
# gRPC or Abseil. Then, on that machine, from the repository root:
# tools/gpu_test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${BUNDLE_TOOL:-../shared/tools/gpu-bundle}
# --tests_only leaves out the two C++ benchmarks (a smaller bundle).
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
# One xz archive (tools/gpu_test.sh unpacks it): the loose files come close
# to the 64 MiB the device machine takes with the tree.
(cd .gpu && chmod -R u+w . && tar -cf - -- * | xz -T0 -3 >../.gpu-bundle.tar.xz)
rm -rf .gpu && mkdir .gpu && mv .gpu-bundle.tar.xz .gpu/bundle.tar.xz
echo "== bundled into .gpu/bundle.tar.xz ($(du -h .gpu/bundle.tar.xz | cut -f1));" \
  "on the GPU machine run tools/gpu_test.sh [--part=1|2|3] [--bench]"
