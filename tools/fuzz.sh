#!/usr/bin/env bash
# Fuzzes checkpoint loading (core/checkpoint_fuzz.cc) with clang's libFuzzer
# under AddressSanitizer and UndefinedBehaviorSanitizer, starting from the
# seed corpus in core/testdata/checkpoint_corpus.
#
#   tools/fuzz.sh [RUNS]     # default 100000 executions; 0 crashes to pass
#
# Needs clang (Debian's clang-14 ships libFuzzer). New interesting inputs go
# to a scratch directory, not into the repository's corpus.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-100000}"
out="$(mktemp -d /tmp/optimd-fuzz-XXXXXX)"
trap 'rm -rf "$out"' EXIT

srcs=(core/checkpoint_fuzz.cc core/checkpoint.cc core/crc32c.cc
      core/fault_guard.cc core/group.cc core/layout.cc core/dtype.cc
      core/cpu_backend.cc core/shm_segment.cc core/thread_pool.cc
      core/session.cc core/state_budget.cc kernels/adamw_cpu.cc)
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

echo "== building the fuzz target (clang, libFuzzer, ASan, UBSan)"
clang++ -std=c++17 -O1 -g -msse4.2 -I. \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  "${srcs[@]}" -o "$out/checkpoint_fuzz" "${absl[@]}" -lpthread -lrt

mkdir "$out/corpus"
echo "== fuzzing checkpoint loading: $runs executions"
"$out/checkpoint_fuzz" -runs="$runs" -max_len=16384 -timeout=10 \
  -rss_limit_mb=4096 -print_final_stats=1 \
  "$out/corpus" core/testdata/checkpoint_corpus
echo "== no crashes in $runs executions"
