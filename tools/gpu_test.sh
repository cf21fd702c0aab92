#!/usr/bin/env bash
# Runs every GPU test from a bundle made by tools/gpu_bundle.sh (on the GPU
# machine, from the repository root), and with --bench the GPU benchmarks
# too. Exits non-zero if any test fails.
#
#   tools/gpu_test.sh [--part=1|2|3] [--bench]
#
# The tests take over ten minutes on one GPU; --part=1 (the C++ tests, the
# CUDA end-to-end and FSDP suites, the two-GPU suites), --part=2
# (frameworks, checkpoints, drop-in rows, several devices, the FP8
# examples) and --part=3 (the benchmarks alone) each fit in one device
# call. Without --part it runs parts 1 and 2; --bench adds part 3 to any.
set -uo pipefail
cd "$(dirname "$0")/.."
part=all
bench=0
for arg in "$@"; do
  case "$arg" in
    --part=1 | --part=2 | --part=3) part=${arg#--part=} ;;
    --bench) bench=1 ;;
    *)
      echo "usage: tools/gpu_test.sh [--part=1|2|3] [--bench]" >&2
      exit 2
      ;;
  esac
done
# shellcheck source=tools/gpu_env.sh
source tools/gpu_env.sh
failed=0
started=$(date +%s)
run() {
  echo "== [$(($(date +%s) - started)) s] $*"
  if ! "$@"; then
    echo "== FAILED: $*"
    failed=1
  fi
}
part1() {
  run .gpu/cuda_math_test
  run .gpu/cuda_backend_test
  run python3 -m unittest -v tests/python/test_cuda_e2e.py
  run python3 -m unittest -v tests/python/test_cuda_trainer_gone.py
  # FSDP2 (DTensor parameters): one CUDA rank, one and two CPU ranks, and two
  # CUDA ranks on nvidia-h200-x2.
  run python3 -m unittest -v tests/python/test_fsdp2.py
  # The one CUDA rank again where CUDA IPC cannot share torch's allocations
  # (expandable segments): the daemon maps the shards' chunks from the
  # descriptors the client passes over its descriptor socket.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run python3 -m unittest -v \
    tests.python.test_fsdp2.Fsdp2Test.test_one_cuda_rank_matches_torch_in_place
  # FSDP1 (FlatParameters, both use_orig_params): one CUDA rank; two on
  # nvidia-h200-x2.
  run python3 -m unittest -v tests/python/test_fsdp1.py
  run python3 -m unittest -v tests/python/test_cuda_ranks.py  # two GPUs: nvidia-h200-x2
  run python3 -m unittest -v tests/python/test_cuda_zero.py  # two GPUs: nvidia-h200-x2
}

part2() {
  run python3 -m unittest -v tests/python/test_frameworks.py
  OPTIMD_TEST_DEVICE=cuda run python3 -m unittest tests.python.test_checkpoint
  # The drop-in rows (torch and optimd side by side) on CUDA tensors.
  OPTIMD_TEST_DEVICE=cuda run python3 -m unittest tests.python.test_dropin
  # One optimizer over CPU and CUDA parameters (a part per device).
  run python3 -m unittest -v tests/python/test_several_devices.py
  # FP8 weights trained through the CUDA backend, every recipe (the loss must
  # fall to below half its first value).
  fp8_sock=$(mktemp -u /tmp/optimd-fp8-XXXXXX.sock)
  .gpu/optimd --listen="unix:$fp8_sock" --backend=cuda &
  fp8_daemon=$!
  sleep 2
  for recipe in tensor block_1x128 block_128x128 mxfp8; do
    run python3 examples/fp8_train.py --address="unix:$fp8_sock" --device=cuda \
      --recipe="$recipe"
  done
  kill "$fp8_daemon"
  wait "$fp8_daemon"
}

benchmarks() {
  sock=$(mktemp -u /tmp/optimd-bench-XXXXXX.sock)
  .gpu/optimd --listen="unix:$sock" --backend=cuda &
  daemon=$!
  sleep 2
  run .gpu/step_latency --target="unix:$sock" --device=0 --stream
  run .gpu/step_latency --target="unix:$sock" --device=0
  kill "$daemon"
  wait "$daemon"
  # A write into the parameters every step (a pruning mask), against torch.
  run python3 bench/written_params_bench.py --device cuda
  run python3 bench/gpu_bench.py
}

case "$part" in
  1) part1 ;;
  2) part2 ;;
  all)
    part1
    part2
    ;;
esac
if [ "$part" = 3 ] || [ "$bench" = 1 ]; then
  benchmarks
fi
if [ "$failed" != 0 ]; then
  echo "== some GPU tests failed"
  exit 1
fi
echo "== all GPU tests passed"
