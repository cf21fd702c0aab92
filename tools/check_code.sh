#!/usr/bin/env bash
# Checks what the code claims and the compiler does not enforce by itself:
#   1. every C++ and CUDA file is formatted as .clang-format says;
#   2. the Abseil thread-safety annotations hold: clang's -Wthread-safety
#      (and -beta) as errors over every production source, proven live by a
#      known-bad snippet that must fail;
#   3. the packages depend in one direction (docs/architecture.md): Bazel
#      visibility refuses a wrong edge when it is written; this asks Bazel
#      for the forbidden paths through the whole graph as well;
#   4. the Python client's gRPC stubs in the tree (so that installing it
#      needs no compiler) are what protoc makes of the .proto now.
# Needs clang and clang-format (tools/setup.sh) and the generated protobuf
# headers of a Bazel build (run after `bazel build //...`). Exits non-zero
# on the first kind of failure, listing the files.
set -uo pipefail
cd "$(dirname "$0")/.."

status=0
echo "== clang-format"
unformatted=()
for f in $(git ls-files '*.cc' '*.h' '*.cu' '*.cuh'); do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || unformatted+=("$f")
done
if [ "${#unformatted[@]}" -ne 0 ]; then
  echo "not formatted (run clang-format -i on them): ${unformatted[*]}"
  status=1
fi

echo "== clang -Wthread-safety"
flags=(-std=c++17 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror
       -I. -Ibazel-bin -Ibazel-bin/proto)
if [ -d /usr/local/cuda/include ]; then
  flags+=(-I/usr/local/cuda/include -DOPTIMD_WITH_CUDA)
fi
control=$(mktemp --suffix=.cc)
trap 'rm -f "$control" "${query_log:-}"' EXIT
cat >"$control" <<'CC'
#include "absl/synchronization/mutex.h"
struct Counter {
  absl::Mutex mu;
  int n ABSL_GUARDED_BY(mu) = 0;
  void Bump() { ++n; }  // unlocked: must be refused
};
CC
if clang++ "${flags[@]}" "$control" >/dev/null 2>&1; then
  echo "the thread-safety check is not live: a known race compiled"
  status=1
fi
sources=$(git ls-files 'common/*.cc' 'core/*.cc' 'checkpoint/*.cc' \
  'server/*.cc' 'client/*.cc' 'kernels/*.cc' 'backends/*.cc' |
  grep -v '_test\.cc$')
if [ ! -d /usr/local/cuda/include ]; then
  sources=$(echo "$sources" | grep -v '^kernels/cuda_\|^backends/cuda/')
fi
for f in $sources; do
  if ! out=$(clang++ "${flags[@]}" "$f" 2>&1); then
    echo "$out" | head -20
    status=1
  fi
done
echo "== package direction"
# paths FROM TO: the production targets under FROM that depend on one in TO.
paths() {
  bazel query --noshow_progress \
    "kind('cc_(library|binary)', attr(testonly, 0, $1)) intersect \
     rdeps($1, $2)" 2>"$query_log"
}
query_log=$(mktemp)
for to in core checkpoint; do
  if [ -z "$(paths //server/... "//$to/...")" ]; then
    echo "the package-direction check is not live: server -> $to not found"
    cat "$query_log"
    status=1
  fi
done
forbid() {
  local found
  if ! found=$(paths "$1" "$2"); then
    tail -5 "$query_log"
    status=1
  elif [ -n "$found" ]; then
    echo "production targets in $1 depend on $2:" $found
    status=1
  fi
}
forbid //common/... "//core/... + //kernels/... + //checkpoint/... + //backends/... + //server/... + //client/..."
forbid //core/... "//kernels/... + //checkpoint/... + //backends/... + //server/... + //client/..."
forbid //kernels/... "//checkpoint/... + //backends/... + //server/... + //client/..."
forbid //checkpoint/... "//kernels/... + //backends/... + //server/... + //client/..."
forbid //backends/... "//checkpoint/... + //server/... + //client/..."
forbid //server/... "//client/..."
echo "== Python stubs current"
stubs=$(mktemp -d)
protoc -Iproto --python_out="$stubs" --grpc_python_out="$stubs" \
  --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin \
  proto/optimd/v1/optimd.proto
for f in optimd_pb2.py optimd_pb2_grpc.py; do
  if ! cmp -s "$stubs/optimd/v1/$f" "client/python/optimd/v1/$f"; then
    echo "client/python/optimd/v1/$f is stale: run tools/gen_python_proto.sh"
    status=1
  fi
done
rm -rf "$stubs"
[ "$status" = 0 ] && echo "== code checks passed"
exit "$status"
