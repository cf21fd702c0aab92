#!/usr/bin/env bash
# Builds and runs the whole test suite (GPU tests excluded): unit tests,
# end-to-end tests against the real daemon, and the PyTorch client tests.
set -euo pipefail
cd "$(dirname "$0")/.."

./tools/setup.sh

flags=()
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "== no CUDA toolkit at /usr/local/cuda: building the CPU backend only"
  flags+=(--define=cuda=off --build_tag_filters=-cuda)
fi

echo "== bazel test (GPU tests excluded)"
bazel test "${flags[@]}" --test_tag_filters=-gpu //...

# Formatting and the thread-safety annotations (clang), about a minute.
./tools/check_code.sh

# The C++ tests again under ASan and UBSan, the end-to-end ones with the
# daemon itself built so (a Bazel output base of their own, so that the
# normal build stays cached: about 10 minutes on two cores from nothing,
# 5 with a warm cache).
echo "== C++ tests under ASan and UBSan"
asan_base="${XDG_CACHE_HOME:-$HOME/.cache}/optimd-asan"
bazel --output_base="$asan_base" test --config=asan --define=cuda=off \
  --build_tag_filters=-cuda --test_tag_filters=-gpu \
  //core/... //server/... //tests:e2e_test //tests:random_requests_test
bazel --output_base="$asan_base" shutdown

# A short fuzz run of checkpoint loading under ASan and UBSan (about a
# minute, most of it the build); tools/fuzz.sh RUNS runs longer.
if command -v clang++ >/dev/null; then
  ./tools/fuzz.sh 20000
else
  echo "== no clang++: skipping the fuzz run (apt-get install clang)"
fi
echo "== all tests passed"
