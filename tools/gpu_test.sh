#!/usr/bin/env bash
# Runs every GPU test from a bundle made by tools/gpu_bundle.sh (on the GPU
# machine, from the repository root), and with --bench the GPU benchmarks
# too. Exits non-zero if any test fails.
set -uo pipefail
cd "$(dirname "$0")/.."
# torch's NCCL (the bundle has none of its own).
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=.gpu/lib${nccl_lib:+:$nccl_lib} OPTIMD_BINARY=.gpu/optimd
export PYTHONPATH=client/python
failed=0
run() {
  echo "== $*"
  if ! "$@"; then
    echo "== FAILED: $*"
    failed=1
  fi
}
run .gpu/cuda_math_test
run .gpu/cuda_backend_test
run python3 -m unittest -v tests/python/test_cuda_e2e.py
run python3 -m unittest -v tests/python/test_frameworks.py
run python3 -m unittest -v tests/python/test_cuda_ranks.py  # two GPUs: nvidia-h200-x2
run python3 -m unittest -v tests/python/test_cuda_zero.py  # two GPUs: nvidia-h200-x2
OPTIMD_TEST_DEVICE=cuda run python3 -m unittest tests.python.test_checkpoint
if [ "${1:-}" = "--bench" ]; then
  sock=$(mktemp -u /tmp/optimd-bench-XXXXXX.sock)
  .gpu/optimd --listen="unix:$sock" --backend=cuda &
  daemon=$!
  sleep 2
  run .gpu/step_latency --target="unix:$sock" --device=0 --stream
  run .gpu/step_latency --target="unix:$sock" --device=0
  kill "$daemon"
  wait "$daemon"
  run python3 bench/gpu_bench.py
fi
if [ "$failed" != 0 ]; then
  echo "== some GPU tests failed"
  exit 1
fi
echo "== all GPU tests passed"
