"""CUDA ranks of one job agreeing on the device (gradient_sharding through
NCCL), on two GPUs: sharded and replicated ranks against a single-process
torch reference with clip_grad_norm_ (the global norm, clipping by it, and
a rank's inf skipping the step on every rank), on one daemon and on two
daemons whose NCCL is forced onto its network transport (two nodes'
stand-in), and a rank killed mid-job ending in errors, not hangs. Needs two
GPUs (nvidia-h200-x2); skipped otherwise.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_cuda_ranks.py
"""
import os
import tempfile
import time
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimd
from optimd.testing import Daemon
from optimd.torch import AdamW

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(37,), (16, 33), (5,), (3, 4, 7)]
STEPS = 12
INF_STEP = 5
MAX_NORM = 0.5
# NCCL's network transport over loopback: two daemons stand in for two
# nodes (without NCCL_SOCKET_IFNAME=lo NCCL looks for other interfaces).
NETWORK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
           "NCCL_SOCKET_IFNAME": "lo"}


def _data():
    g = torch.Generator().manual_seed(1234)
    full = [torch.randn(*s, generator=g) for s in SHAPES]
    grads = [[torch.randn(*s, generator=g) for s in SHAPES]
             for _ in range(STEPS)]
    return full, grads


def _reference():
    """torch.optim.AdamW over all four tensors with clip_grad_norm_; the
    inf step is skipped."""
    full, grads = _data()
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    opt = torch.optim.AdamW(ref, lr=1e-2)
    norms = []
    for step, g in enumerate(grads):
        for p, gi in zip(ref, g):
            p.grad = gi.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref, MAX_NORM)))
        if step != INF_STEP:
            opt.step()
    return [p.detach() for p in ref], norms


def _rank(rank, init_file, addresses, sharding, out, die_at):
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    full, grads = _data()
    mine = ((0, 1), (2, 3))[rank] if sharding == "sharded" else (0, 1, 2, 3)
    params = [torch.nn.Parameter(full[i].clone().cuda(rank)) for i in mine]
    opt = AdamW(params, lr=1e-2, address=addresses[rank],
                max_grad_norm=MAX_NORM, gradient_sharding=sharding)
    opt.wait_for_step = True  # each step's own norm and skip in its reply
    rec = {"skipped": [], "norm": [], "error": None}
    started = {}
    for step, g in enumerate(grads):
        started[step] = time.time()
        if rank == 1 and step == die_at:
            os._exit(0)  # killed: no close, no goodbye
        for p, i in zip(params, mine):
            p.grad = g[i].clone().cuda(rank)
        if rank == 1 and step == INF_STEP:
            params[0].grad.view(-1)[0] = float("inf")
        try:
            opt.step()
            opt.synchronize()
        except optimd.OptimdError as e:
            # Seconds since the first step the dead rank missed.
            since = time.time() - started.get(die_at, started[step])
            rec["error"] = (type(e).__name__, str(e), step, since)
            break
        rec["skipped"].append(bool(opt.skipped))
        rec["norm"].append(float(opt.grad_norm))
    rec["params"] = {i: p.detach().cpu() for i, p in zip(mine, params)}
    torch.save(rec, out % rank)
    os._exit(0)  # the session is left to the daemon (orphaned, then freed)


@unittest.skipUnless(torch.cuda.device_count() >= 2, "needs two GPUs")
class CudaRanks(unittest.TestCase):
    def run_job(self, addresses, sharding, die_at=None):
        scratch = tempfile.mkdtemp(prefix="optimd-cuda-ranks-")
        out = os.path.join(scratch, "rank%d.pt")
        mp.start_processes(
            _rank, nprocs=2, start_method="spawn",
            args=(os.path.join(scratch, "init"), addresses, sharding, out,
                  die_at))
        if die_at is not None:
            return torch.load(out % 0)
        return [torch.load(out % r) for r in (0, 1)]

    def check_against_torch(self, results):
        ref, norms = _reference()
        for r in results:
            self.assertIsNone(r["error"])
            self.assertEqual(r["skipped"], [s == INF_STEP for s in
                                            range(STEPS)])
            for step, (ours, theirs) in enumerate(zip(r["norm"], norms)):
                if step != INF_STEP:
                    self.assertAlmostEqual(ours / theirs, 1.0, delta=1e-6)
            for i, p in r["params"].items():
                err = ((p.double() - ref[i].double()).abs().max() /
                       ref[i].double().abs().max()).item()
                self.assertLessEqual(err, 1e-5, "tensor %d" % i)

    def test_sharded_ranks_on_one_daemon_clip_and_skip_together(self):
        with Daemon(backend="cuda") as d:
            self.check_against_torch(
                self.run_job([d.address] * 2, "sharded"))

    def test_replicated_ranks_on_one_daemon(self):
        with Daemon(backend="cuda") as d:
            results = self.run_job([d.address] * 2, "replicated")
        self.check_against_torch(results)
        for i in range(4):
            self.assertTrue(torch.equal(results[0]["params"][i],
                                        results[1]["params"][i]))

    def test_two_daemons_over_nccl_network_transport(self):
        saved = {k: os.environ.get(k) for k in NETWORK}
        os.environ.update(NETWORK)
        try:
            d0, d1 = Daemon(backend="cuda"), Daemon(backend="cuda")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        try:
            self.check_against_torch(
                self.run_job([d0.address, d1.address], "sharded"))
        finally:
            self.assertEqual(d0.stop(), 0)
            self.assertEqual(d1.stop(), 0)

    def test_a_killed_rank_ends_in_errors_not_hangs(self):
        with Daemon(backend="cuda", flags=["--rank_timeout_s=5"]) as d:
            r0 = self.run_job([d.address] * 2, "sharded", die_at=3)
            # The step rank 1 missed, or one after it (steps are
            # asynchronous: the watchdog ends the job once that step is
            # --rank_timeout_s late, and the next step is refused).
            name, message, step, seconds = r0["error"]
            self.assertIn(name, ("DeadlineExceededError",
                                 "FailedPreconditionError"), message)
            self.assertGreaterEqual(step, 3)
            self.assertLess(seconds, 30)
            self.assertIn("other ranks' same step", message)
            # The daemon serves other sessions as before.
            p = torch.nn.Parameter(torch.zeros(8, device="cuda"))
            opt = AdamW([p], lr=1e-2, address=d.address)
            p.grad = torch.ones_like(p)
            opt.step()
            opt.synchronize()
            self.assertLess(p.detach().max().item(), 0)
            opt.close()


if __name__ == "__main__":
    unittest.main()
