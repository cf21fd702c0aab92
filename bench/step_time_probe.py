"""Where the time of one optimd.torch.AdamW step goes on CUDA, against
torch's fused AdamW on the same tensors (the scenario of
tests/python/test_cuda_e2e.py's step-time test), with the daemon's own
counters: plan builds and plan-entry updates per step show re-planning
and moved gradients; host ms is the trainer's time inside opt.step().

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 bench/step_time_probe.py
"""
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


def timed(step, iters=50):
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(iters):
        h0 = time.perf_counter()
        step()
        host += time.perf_counter() - h0
    torch.cuda.synchronize()
    return ((time.perf_counter() - t0) / iters * 1e3, host / iters * 1e3)


def counters(client):
    m = client.get_metrics()
    return m.steps, m.plan_builds, m.plan_entry_updates


def probe(daemon, n, count, wait=False, **options):
    ours = [torch.nn.Parameter(torch.randn(n // count, device="cuda"))
            for _ in range(count)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for q in theirs:
        q.grad = torch.randn_like(q)
    opt = AdamW(ours, lr=1e-3, address=daemon.address, job_id="probe",
                **options)
    opt.wait_for_step = wait
    for p, q in zip(ours, theirs):
        p.grad = q.grad.clone()
    ref = torch.optim.AdamW(theirs, lr=1e-3, fused=True)
    before = counters(opt._client)
    t_ours, h_ours = timed(opt.step)
    after = counters(opt._client)
    t_ref, h_ref = timed(ref.step)
    steps = after[0] - before[0]
    print("%-28s %9d %6d  optimd %7.3f ms (host %6.3f)  torch %7.3f ms "
          "(host %6.3f)  ratio %6.3f  steps %d plan_builds %d "
          "entry_updates %d" % (
              ",".join(["%s=%s" % kv for kv in options.items()]
                       + (["wait_for_step"] if wait else [])) or "default",
              n, count, t_ours, h_ours, t_ref, h_ref, t_ours / t_ref, steps,
              after[1] - before[1], after[2] - before[2]))
    opt.close()


def main():
    with Daemon(backend="cuda") as daemon:
        for n, count in ((50_000_000, 100), (50_000_000, 16),
                         (200_000_000, 100), (1_000_000, 10)):
            probe(daemon, n, count)
        probe(daemon, 50_000_000, 100, skip_nonfinite=True)
        probe(daemon, 50_000_000, 100, wait=True)


if __name__ == "__main__":
    main()
