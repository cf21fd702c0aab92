#!/usr/bin/env bash
# Times several builds of //bench:cuda_step_bench against each other on
# the GPU machine in one device call, alternating them so that drift of
# the machine falls on all alike.
#
#   tools/gpu_compare_builds.sh [--reps=N] [--bench_args="..."] \
#       [--tests="gtest filter"] [--bundle=REV] NAME=REV [NAME=REV ...]
#
# Here: builds the benchmark at each git revision REV (branch, tag or
# commit; the working tree must be clean, and is left on the revision it
# was on), then tools/gpu_bundle.sh of revision --bundle (the current one
# unless given; its tests check the bits of that revision's kernels), and
# writes .gpu/compare.sh. On the GPU machine, from the repository root:
#
#   bash .gpu/compare.sh
#
# runs the bundled revision's cuda_backend_test (--tests: a gtest filter;
# empty skips it), then each build's benchmark with --bench_args, the
# builds in the order given, N times over.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: tools/gpu_compare_builds.sh [--reps=N]" \
    "[--bench_args=\"...\"] [--tests=FILTER] [--bundle=REV] NAME=REV..." >&2
  exit 2
}

# Builds the benchmark at each of `builds` (NAME=REV) into $scratch as
# cuda_step_bench_NAME.xz, and lists them in $scratch/builds.txt; sets
# `names`.
build_revisions() {
  local b name
  names=()
  for b in "${builds[@]}"; do
    name=${b%%=*}
    if ! [[ "$name" =~ ^[A-Za-z0-9_]+$ ]]; then
      echo "gpu_compare_builds: build names are letters, digits and _" >&2
      exit 2
    fi
    git checkout -q "${b#*=}"
    bazel build //bench:cuda_step_bench
    xz -T0 -3 -c bazel-bin/bench/cuda_step_bench \
      >"$scratch/cuda_step_bench_$name.xz"
    echo "$name $(git rev-parse --short HEAD)" >>"$scratch/builds.txt"
    names+=("$name")
  done
}

# The GPU machine's script: unpack, the bundled tests, then the builds'
# benchmarks in turn.
write_compare_script() {
  echo '#!/usr/bin/env bash'
  echo '# Written by tools/gpu_compare_builds.sh; run from the repository root.'
  echo 'cd "$(dirname "$0")/.."'
  echo 'nvidia-smi --query-gpu=name --format=csv,noheader; date -u; cat .gpu/builds.txt'
  echo 't0=$(date +%s)'
  echo 'source tools/gpu_env.sh'
  echo 'for f in .gpu/cuda_step_bench_*.xz; do xz -d "$f" && chmod +x "${f%.xz}"; done'
  if [ -n "$tests" ]; then
    printf '.gpu/cuda_backend_test --gtest_filter=%q 2>&1 | grep -E "FAILED|PASSED|tests ran"\n' "$tests"
    echo 'echo "== tests done at $(($(date +%s) - t0)) s"'
  fi
  printf 'for r in $(seq %d); do for b in %s; do\n' "$reps" "${names[*]}"
  printf '  echo "== $b at $(($(date +%%s) - t0)) s"\n'
  printf '  timeout 120 .gpu/cuda_step_bench_$b %s 2>&1 | grep --line-buffered -E "RESULT|rror"\n' "$bench_args"
  echo 'done; done'
}

# All of it in functions, which bash reads whole before it runs them: the
# checkouts may change or remove this file. The exit trap takes the tree
# back to the revision it was on.
main() {
  reps=2
  bench_args="--params=1e9 --modes=assume_finite"
  tests="*"
  bundle_rev=
  builds=()
  local arg
  for arg in "$@"; do
    case "$arg" in
      --reps=*) reps=${arg#--reps=} ;;
      --bench_args=*) bench_args=${arg#--bench_args=} ;;
      --tests=*) tests=${arg#--tests=} ;;
      --bundle=*) bundle_rev=${arg#--bundle=} ;;
      *=*) builds+=("$arg") ;;
      *) usage ;;
    esac
  done
  if [ ${#builds[@]} -eq 0 ]; then
    echo "gpu_compare_builds: name at least one build as NAME=REV" >&2
    exit 2
  fi
  if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "gpu_compare_builds: commit or stash the tree's changes first" >&2
    exit 1
  fi
  here=$(git symbolic-ref --quiet --short HEAD || git rev-parse HEAD)
  scratch=$(mktemp -d)
  trap 'git checkout -q "$here"; rm -rf "$scratch"' EXIT
  build_revisions
  git checkout -q "${bundle_rev:-$here}"
  bash tools/gpu_bundle.sh --tests_only
  cp "$scratch"/cuda_step_bench_*.xz "$scratch/builds.txt" .gpu/
  write_compare_script >.gpu/compare.sh
  chmod +x .gpu/compare.sh
  echo "== .gpu/compare.sh times ${names[*]} ($(du -sh .gpu | cut -f1) to carry)"
}

main "$@"; exit
