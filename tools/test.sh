#!/usr/bin/env bash
# Builds and runs the whole test suite (GPU tests excluded): unit tests,
# end-to-end tests against the real daemon, and the PyTorch client tests.
set -euo pipefail
cd "$(dirname "$0")/.."

./tools/setup.sh

echo "== bazel test (GPU tests excluded)"
bazel test --test_tag_filters=-gpu //...
echo "== all tests passed"
