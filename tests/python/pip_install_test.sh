#!/usr/bin/env bash
# `pip install ./client/python` works offline with the packages already on
# the machine, generates the gRPC stubs, and the installed package imports
# and talks to a real daemon; installed into a clean virtual environment,
# its declared dependencies resolve to the system's torch, grpcio and
# protobuf, and without them pip refuses.
set -euo pipefail
root="$PWD"
target="$(mktemp -d /tmp/optimd-pip.XXXXXX)"
trap 'rm -rf "$target"' EXIT
# pip builds in a copy of the source; give it the proto tree beside it, as in
# the repository.
src="$target/src"
mkdir -p "$src/client" "$src/proto/optimd/v1"
cp -rL "$root/client/python" "$src/client/python"
rm -f "$src/client/python/optimd/v1/"*_pb2*.py
cp -L "$root/proto/optimd/v1/optimd.proto" "$src/proto/optimd/v1/"
# With the step channel library built, the install carries it.
OPTIMD_STEP_CHANNEL_LIB="$root/client/liboptimd_step_channel.so" \
  /usr/bin/python3 -m pip install --quiet --no-build-isolation --no-deps \
  --no-index --target "$target/site" "$src/client/python"
test -f "$target/site/optimd/v1/optimd_pb2_grpc.py"
test -f "$target/site/optimd/_lib/liboptimd_step_channel.so"
cd "$target"
env -u OPTIMD_STEP_CHANNEL_LIB OPTIMD_BINARY="$root/server/optimd" \
  PYTHONPATH="$target/site" /usr/bin/python3 - <<'PY'
import torch
import optimd
from optimd.testing import Daemon
from optimd.torch import AdamW
assert optimd.__file__.startswith("/tmp/"), optimd.__file__
with Daemon() as d:
    p = torch.nn.Parameter(torch.ones(4))
    opt = AdamW([p], lr=0.1, address=d.address, job_id="pip")
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    assert abs(p[0].item() - 0.899) < 1e-6, p
    assert opt.client.native_steps, "the installed library is not used"
    opt.close()
print("installed package works, steps through its library")
PY
# Without protoc on the path, the stubs kept in the tree are installed
# (pip needs nothing else from the path here).
nobin="$target/nobin"
mkdir -p "$nobin"
ln -s /usr/bin/python3 "$nobin/python3"
src2="$target/src2"
cp -rL "$root/client/python" "$src2"
test -f "$src2/optimd/v1/optimd_pb2.py"
PATH="$nobin" python3 -m pip install --quiet --no-build-isolation --no-deps \
  --no-index --target "$target/site2" "$src2"
cmp "$target/site2/optimd/v1/optimd_pb2.py" "$src2/optimd/v1/optimd_pb2.py"
PYTHONPATH="$target/site2" /usr/bin/python3 -c \
  "import optimd.v1.optimd_pb2_grpc, optimd; print('installed without protoc')"
# As a user installs it: `pip install` into a clean virtual environment that
# sees the system's torch, grpcio and protobuf, dependencies resolved (not
# --no-deps): the package declares them, and they are found installed.
venv="$target/venv"
/usr/bin/python3 -m venv --system-site-packages "$venv"
PATH="$venv/bin:/usr/bin:/bin" "$venv/bin/python" -m pip install --quiet \
  --no-index --no-build-isolation "$src2"
(cd "$target" && OPTIMD_BINARY="$root/server/optimd" "$venv/bin/python" - <<'PY'
from importlib.metadata import requires
import optimd
from optimd.torch import AdamW
assert "/venv/" in optimd.__file__, optimd.__file__
assert sorted(r.split(";")[0].strip() for r in requires("optimd")) == \
    ["grpcio", "protobuf", "torch"], requires("optimd")
print("installed into a virtual environment with its dependencies")
PY
)
# Without the system's packages the declared dependencies are missing, and
# an offline pip says which instead of installing a package that cannot
# import.
bare="$target/bare"
/usr/bin/python3 -m venv "$bare"
if "$bare/bin/python" -m pip install --no-index --no-build-isolation \
    "$src2" >"$target/bare.log" 2>&1; then
  echo "installed without its dependencies"; exit 1
fi
grep -q "No matching distribution found for \(grpcio\|protobuf\|torch\)" \
  "$target/bare.log" || { cat "$target/bare.log"; exit 1; }
echo "pip install test passed"
