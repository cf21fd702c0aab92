#!/usr/bin/env bash
# The release tarball works on its own: packed from the built binaries, it
# installs under a prefix with its install.sh, the daemon runs from there
# with no LD_LIBRARY_PATH of ours, the wheel installs into a clean virtual
# environment (the system's torch, grpcio and protobuf; no protoc on PATH)
# and trains against that daemon, and the systemd unit passes
# `systemd-analyze verify` (where systemd-analyze exists).
set -euo pipefail
root="$PWD"
scratch="$(mktemp -d /tmp/optimd-release-test.XXXXXX)"
daemon=""
cleanup() {
  if [ -n "$daemon" ]; then kill "$daemon" 2>/dev/null || true; fi
  rm -rf "$scratch"
}
trap cleanup EXIT
# Packed as `bazel run //tools:release` packs it.
tarball=$(tools/release "$scratch/out" | tail -1)
tar -xzf "$tarball" -C "$scratch"
pkg=$(echo "$scratch"/optimd-*/)
"$pkg/install.sh" "$scratch/prefix" >/dev/null
version=$(env -u LD_LIBRARY_PATH "$scratch/prefix/bin/optimd" --version 2>&1)
echo "$version" | grep -q "^optimd [0-9]" || { echo "bad --version: $version"; exit 1; }
# Every library the daemon loads comes from the tarball or from the C
# library and the system's usual base.
LD_LIBRARY_PATH="$scratch/prefix/lib/optimd/lib" ldd "$scratch/prefix/lib/optimd/libexec/optimd" \
  | grep -q "not found" && { echo "missing libraries"; exit 1; }

sock="$scratch/optimd.sock"
"$scratch/prefix/bin/optimd" --listen="unix:$sock" --backend=cpu 2>"$scratch/daemon.log" &
daemon=$!
/usr/bin/python3 -m venv --system-site-packages "$scratch/venv"
PATH="$scratch/venv/bin:/usr/bin:/bin" "$scratch/venv/bin/python" -m pip install \
  --quiet --no-index --no-deps "$pkg"/python/optimd-*.whl
test -f "$scratch"/venv/lib/python3*/site-packages/optimd/v1/optimd_pb2_grpc.py
cd "$scratch"
OPTIMD_SECRETS_DIR="$scratch/secrets" "$scratch/venv/bin/python" - "unix:$sock" <<'PY'
import sys, time
import torch
import optimd
from optimd.torch import AdamW
assert "/venv/" in optimd.__file__, optimd.__file__
deadline = time.time() + 20
while True:
    try:
        p = torch.nn.Parameter(torch.ones(4))
        opt = AdamW([p], lr=0.1, address=sys.argv[1], job_id="release")
        break
    except optimd.DaemonUnavailableError:
        assert time.time() < deadline, "the installed daemon never answered"
        time.sleep(0.1)
p.grad = torch.full_like(p, 0.5)
opt.step()
assert abs(p[0].item() - 0.899) < 1e-6, p
opt.close()
print("the installed daemon and client train")
PY
# install.sh installed the unit, with ExecStart at the installed binary.
unit="$scratch/prefix/lib/systemd/system/optimd@.service"
grep -q "^ExecStart=$scratch/prefix/bin/optimd --listen=" "$unit" ||
  { echo "the installed unit does not start the installed daemon"; exit 1; }
if command -v systemd-analyze >/dev/null; then
  mkdir -p "$scratch/units"
  cp "$unit" "$scratch/units/optimd@root.service"
  out=$(systemd-analyze verify "$scratch/units/optimd@root.service" 2>&1 || true)
  if echo "$out" | grep -v "^$" | grep -qv "Failed to prepare filename\|/run/systemd/system"; then
    echo "systemd-analyze verify: $out"
    exit 1
  fi
fi
echo "release test passed"
