#!/usr/bin/env bash
# Checks deploy/Containerfile end to end where a container tool is at hand
# (not in CI, which has none): builds the image (unless IMAGE names one
# already built), runs the daemon in it with the socket and state
# directories mounted, trains a session through it with the Python client
# of this tree, stops the container (SIGTERM: the live session is saved),
# starts it again, resumes the session and checks it bit for bit against
# a session that never stopped.
#   tools/container_check.sh                     podman build, then check
#   IMAGE=optimd:test tools/container_check.sh   check an image already built
#   CONTAINER="podman --runtime runc" RUN_FLAGS="--ulimit nofile=1024:1024" ...
#                                                runtimes that need telling
set -euo pipefail
cd "$(dirname "$0")/.."
container=${CONTAINER:-podman}
image=${IMAGE:-}
if [ -z "$image" ]; then
  image=optimd:check
  $container build -f deploy/Containerfile -t "$image" .
fi
scratch=$(mktemp -d /tmp/optimd-container-check.XXXXXX)
name="optimd-check-$$"
trainer=""
cleanup() {
  if [ -n "$trainer" ]; then kill "$trainer" 2>/dev/null || true; fi
  $container rm -f "$name" >/dev/null 2>&1 || true
  rm -rf "$scratch"
}
trap cleanup EXIT
mkdir -m 0700 "$scratch/run" "$scratch/state"
# The host's network (the metrics port) and IPC namespace (shared memory
# with the trainers), as README's Deployment asks.
# shellcheck disable=SC2086
$container run -d --name "$name" --network=host --ipc=host --pid=host \
  ${RUN_FLAGS:-} -v "$scratch/run:/run/optimd" \
  -v "$scratch/state:/var/lib/optimd" "$image" >/dev/null
export PYTHONPATH="$PWD/client/python" OPTIMD_SECRETS_DIR="$scratch/secrets"
trainer_py="$scratch/trainer.py"
cat >"$trainer_py" <<'PY'
"""first: trains 5 steps, says so, then waits to be killed (its session
stays open while the container stops). second: resumes, trains 5 more, and
compares with a session that trained all 10 at once."""
import os, sys, time
import torch
import optimd
from optimd.torch import AdamW

address, phase, scratch = sys.argv[1:4]
deadline = time.time() + 60
while not os.path.exists(address[len("unix:"):]):
    assert time.time() < deadline, "the container's daemon never listened"
    time.sleep(0.1)


def grad(i):
    return torch.randn(1000, generator=torch.Generator().manual_seed(i))


def start():
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(1000))


if phase == "first":
    p = start()
    opt = AdamW([p], lr=1e-2, address=address, job_id="check",
                master_weights=True)
    for i in range(5):
        p.grad = grad(i)
        opt.step()
    open(os.path.join(scratch, "trained"), "w").close()
    time.sleep(600)
else:
    q = torch.nn.Parameter(torch.zeros(1000))
    opt = AdamW([q], lr=1e-2, address=address, job_id="check",
                master_weights=True, resume=True)
    assert opt.resumed
    for i in range(5, 10):
        q.grad = grad(i)
        opt.step()
    ref = start()
    ref_opt = AdamW([ref], lr=1e-2, address=address, job_id="ref",
                    master_weights=True)
    for i in range(10):
        ref.grad = grad(i)
        ref_opt.step()
    assert torch.equal(q.detach(), ref.detach()), "resume is not bit-exact"
    print("resumed after the container's restart, bit-exact")
PY
address="unix:$scratch/run/optimd.sock"
/usr/bin/python3 "$trainer_py" "$address" first "$scratch" &
trainer=$!
for _ in $(seq 600); do
  [ -f "$scratch/trained" ] && break
  kill -0 "$trainer" 2>/dev/null || { echo "the trainer failed"; exit 1; }
  sleep 0.1
done
[ -f "$scratch/trained" ] || { echo "the trainer never trained"; exit 1; }
curl -sf http://127.0.0.1:9464/metrics >"$scratch/metrics" || true
grep -q "^optimd_steps_total 5$" "$scratch/metrics" ||
  { echo "/metrics does not count the 5 steps"; exit 1; }
$container stop -t 600 "$name" >/dev/null
status=$($container inspect "$name" --format '{{.State.ExitCode}}')
[ "$status" = 0 ] || { echo "the daemon exited with $status"; exit 1; }
# (Files, not pipes into grep -q: with pipefail, the writer's SIGPIPE would
# fail the check.)
$container logs "$name" >"$scratch/log" 2>&1
grep -q "saved job 'check' rank 0" "$scratch/log" ||
  { cat "$scratch/log"; echo "the session was not saved"; exit 1; }
kill "$trainer" 2>/dev/null || true
wait "$trainer" 2>/dev/null || true
trainer=""
$container start "$name" >/dev/null
/usr/bin/python3 "$trainer_py" "$address" second "$scratch"
echo "container check passed"
