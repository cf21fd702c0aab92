#!/usr/bin/env bash
# Fuzzes checkpoint loading (tests/checkpoint/checkpoint_fuzz.cc), request
# validation (server/request_fuzz.cc) and shared-memory handle resolution
# (backends/cpu/handle_fuzz.cc) with clang's libFuzzer under
# AddressSanitizer and UndefinedBehaviorSanitizer, each from its seed corpus
# (tests/checkpoint/testdata/checkpoint_corpus, server/testdata/request_corpus,
# backends/cpu/testdata/handle_corpus).
#
#   tools/fuzz.sh [RUNS]     # executions per target, default 100000;
#                            # fails on any crash or sanitizer report
#
# Needs clang (Debian's clang-14 ships libFuzzer) and Bazel for the
# generated protobuf code. New interesting inputs go to a scratch
# directory, not into the repository's corpora.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-100000}"
out="$(mktemp -d /tmp/optimd-fuzz-XXXXXX)"
trap 'rm -rf "$out"' EXIT

absl=(-labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info
      -labsl_cord_internal -labsl_cordz_functions -labsl_cordz_handle
      -labsl_exponential_biased -labsl_synchronization
      -labsl_graphcycles_internal -labsl_stacktrace -labsl_symbolize
      -labsl_debugging_internal -labsl_demangle_internal -labsl_malloc_internal
      -labsl_time -labsl_civil_time -labsl_time_zone -labsl_str_format_internal
      -labsl_strings -labsl_strings_internal -labsl_int128 -labsl_throw_delegate
      -labsl_raw_logging_internal -labsl_log_severity -labsl_spinlock_wait
      -labsl_base -labsl_hash -labsl_city -labsl_low_level_hash
      -labsl_raw_hash_set)
cxx=(clang++ -std=c++17 -O1 -g -msse4.2 -I. -Ibazel-bin/proto
     -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined)

# fuzz NAME CORPUS SOURCES... -- LIBS...
fuzz() {
  local name="$1" corpus="$2"
  shift 2
  local srcs=() libs=()
  while [ "$1" != "--" ]; do srcs+=("$1"); shift; done
  shift
  libs=("$@")
  echo "== building $name (clang, libFuzzer, ASan, UBSan)"
  "${cxx[@]}" "${srcs[@]}" -o "$out/$name" "${absl[@]}" \
    "${libs[@]}" -lisal -lpthread -lrt
  mkdir "$out/$name.corpus"
  echo "== fuzzing $name: $runs executions"
  local rc=0
  "$out/$name" -runs="$runs" -max_len=16384 -timeout=10 -rss_limit_mb=4096 \
    -print_final_stats=1 "$out/$name.corpus" "$corpus" \
    >"$out/$name.log" 2>&1 || rc=$?
  # The progress lines are many; the end holds the stats or the crash.
  grep -v "^#[0-9]" "$out/$name.log" | tail -n 60
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (exit $rc)"
    return "$rc"
  fi
}

# The C++ sources a Bazel target is built from (this repository's, not the
# generated ones), so that the fuzz builds follow the BUILD files.
sources_of() {
  bazel query --noshow_progress "kind('source file', deps($1))" 2>/dev/null |
    grep -E '^//[a-z][^:]*:[^:]*\.cc$' | sed 's#^//##; s#:#/#' |
    grep -v '_test\.cc$'
}

bazel build //proto:optimd_cc_proto >/dev/null
mapfile -t checkpoint_srcs < <(sources_of //tests/checkpoint:checkpoint_fuzz)
mapfile -t request_srcs < <(sources_of //server:request_fuzz)
mapfile -t handle_srcs < <(sources_of //backends/cpu:handle_fuzz)
fuzz checkpoint_fuzz tests/checkpoint/testdata/checkpoint_corpus \
  "${checkpoint_srcs[@]}" --
fuzz request_fuzz server/testdata/request_corpus "${request_srcs[@]}" \
  bazel-bin/proto/optimd/v1/optimd.pb.cc -- \
  -lgrpc++ -lgrpc -lgpr -lprotobuf
fuzz handle_fuzz backends/cpu/testdata/handle_corpus "${handle_srcs[@]}" --
echo "== no crashes in $runs executions of each target"
