#!/usr/bin/env bash
# Builds the daemon and optimctl and packs the release tarball into OUT_DIR
# (default dist/): tools/make_release.sh says what it holds.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build -c opt //server:optimd //client:optimctl
out=${1:-dist}
tools/make_release.sh "$out" "$(bazel info -c opt bazel-bin)/server/optimd" \
  "$(bazel info -c opt bazel-bin)/client/optimctl"
