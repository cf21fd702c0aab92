#!/usr/bin/env bash
# The main job: build optimd, start the daemon on the CPU backend on a
# temporary socket, and train a small model through it, showing progress.
# The daemon is stopped at the end, also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

./tools/setup.sh

flags=()
[ -x /usr/local/cuda/bin/nvcc ] || flags+=(--config=nocuda)

echo "== building"
bazel build "${flags[@]}" //server:optimd //client:optimctl //examples:mlp_trainer \
  //client:liboptimd_step_channel.so
# The PyTorch trainer steps through the library, as an installed client does.
export OPTIMD_STEP_CHANNEL_LIB="$PWD/bazel-bin/client/liboptimd_step_channel.so"

workdir="$(mktemp -d /tmp/optimd-demo.XXXXXX)"
socket="unix:${workdir}/optimd.sock"
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  rm -rf "$workdir"
}
trap cleanup EXIT

echo "== starting optimd (CPU backend) on ${socket}"
./bazel-bin/server/optimd --listen="$socket" --backend=cpu &
daemon_pid=$!
for _ in $(seq 1 100); do
  if ./bazel-bin/client/optimctl --target="$socket" --timeout_s=1 health \
      >/dev/null 2>&1; then
    break
  fi
  sleep 0.1
done
./bazel-bin/client/optimctl --target="$socket" health

echo "== training an MLP through the daemon (C++ trainer)"
./bazel-bin/examples/mlp_trainer --target="$socket" --steps=300

if [ -x tools/demo_torch.sh ]; then
  OPTIMD_ADDRESS="$socket" ./tools/demo_torch.sh
fi

echo "== daemon metrics"
./bazel-bin/client/optimctl --target="$socket" metrics | grep -E '^optimd_(steps_total|plan_builds_total|step_latency_seconds_(count|sum))'
echo "== demo finished"
