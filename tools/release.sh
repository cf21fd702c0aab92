#!/usr/bin/env bash
# Builds the daemon and optimctl and packs the release tarball into OUT_DIR
# (default dist/): tools/make_release.sh says what it holds. The daemon has
# the CUDA backend when the CUDA toolkit is at /usr/local/cuda; without it
# (a plain Debian machine or container) it is built for the CPU backend
# only, and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(-c opt)
if [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "== no CUDA toolkit at /usr/local/cuda: building the CPU backend only" >&2
  flags+=(--config=nocuda)
fi
bazel build "${flags[@]}" //server:optimd //client:optimctl
bin=$(bazel info "${flags[@]}" bazel-bin)
out=${1:-dist}
tools/make_release.sh "$out" "$bin/server/optimd" "$bin/client/optimctl"
