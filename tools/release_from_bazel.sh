#!/usr/bin/env bash
# `bazel run //tools:release [-- OUT_DIR]`: packs the release tarball
# (tools/make_release.sh says what it holds) from the daemon and optimctl
# Bazel has just built, into OUT_DIR (default dist/, relative to where
# bazel was run). Add --config=nocuda on machines without the CUDA toolkit;
# tools/release.sh chooses for you.
set -euo pipefail
out=${1:-dist}
case "$out" in
  /*) ;;
  *) out="${BUILD_WORKING_DIRECTORY:-$PWD}/$out" ;;
esac
tools/make_release.sh "$out" "$PWD/server/optimd" "$PWD/client/optimctl"
