"""ZeRO-sharded optimizer state (shard_state=True) on the CUDA backend, on
two GPUs: DDP-style ranks (each holding the whole, already all-reduced
gradient) whose sessions keep state for half of the parameters each and
gather the updated halves through the job's NCCL communicator, against a
single-process torch.optim.AdamW with clip_grad_norm_; a rank's inf
gradient skips the step on both; each rank's state about half; one daemon
and two daemons with NCCL forced onto its network transport. Needs two
GPUs (nvidia-h200-x2); skipped otherwise.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_cuda_zero.py
"""
import os
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimd
from optimd.testing import Daemon, session_state_bytes
from optimd.torch import AdamW

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# 37 + 528 + 5 + 84 + 4096 = 4750 elements: rank 0 owns [0, 2375), which
# ends inside the last tensor, so that tensor is split between the ranks.
SHAPES = [(37,), (16, 33), (5,), (3, 4, 7), (64, 64)]
STEPS = 12
INF_STEP = 5
MAX_NORM = 0.5
# NCCL's network transport over loopback: two daemons stand in for two
# nodes.
NETWORK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
           "NCCL_SOCKET_IFNAME": "lo"}


def _data():
    g = torch.Generator().manual_seed(4321)
    full = [torch.randn(*s, generator=g) for s in SHAPES]
    grads = [[torch.randn(*s, generator=g) for s in SHAPES]
             for _ in range(STEPS)]
    # The inf lies in rank 1's part (the last tensor's last element): each
    # rank checks the part it updates, and DDP's gradients are equal on
    # every rank, so one rank sees it.
    grads[INF_STEP][-1].view(-1)[-1] = float("inf")
    return full, grads


def _reference():
    """torch.optim.AdamW over every tensor with clip_grad_norm_; the inf
    step is skipped."""
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




def _rank(rank, init_file, addresses, out):
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    full, grads = _data()
    params = [torch.nn.Parameter(t.clone().cuda(rank)) for t in full]
    opt = AdamW(params, lr=1e-2, address=addresses[rank],
                max_grad_norm=MAX_NORM, shard_state=True)
    opt.wait_for_step = True  # each step's own norm and skip in its reply
    rec = {"skipped": [], "norm": [], "error": None}
    try:
        for g in grads:
            for p, gi in zip(params, g):
                p.grad = gi.clone().cuda(rank)  # whole: DDP all-reduced it
            opt.step()
            opt.synchronize()
            rec["skipped"].append(bool(opt.skipped))
            rec["norm"].append(float(opt.grad_norm))
    except optimd.OptimdError as e:
        rec["error"] = (type(e).__name__, str(e))
    torch.cuda.synchronize(rank)
    rec["params"] = [p.detach().cpu() for p in params]
    rec["state_bytes"] = session_state_bytes(addresses[rank],
                                      opt._identity["job"], rank)
    torch.save(rec, out % rank)
    dist.barrier()
    opt.close()
    dist.destroy_process_group()


@unittest.skipUnless(torch.cuda.device_count() >= 2, "needs two GPUs")
class CudaZero(unittest.TestCase):
    def run_job(self, addresses):
        scratch = tempfile.mkdtemp(prefix="optimd-cuda-zero-")
        out = os.path.join(scratch, "rank%d.pt")
        mp.start_processes(_rank, nprocs=2, start_method="spawn",
                           args=(os.path.join(scratch, "init"), addresses,
                                 out))
        return [torch.load(out % r) for r in (0, 1)]

    def check(self, results):
        ref, norms = _reference()
        whole = 8 * sum(t.numel() for t in ref)  # two fp32 moments
        for r in results:
            self.assertIsNone(r["error"])
            self.assertEqual(r["skipped"],
                             [s == INF_STEP for s in range(STEPS)])
            for step, (ours, theirs) in enumerate(zip(r["norm"], norms)):
                if step != INF_STEP:
                    self.assertAlmostEqual(ours / theirs, 1.0, delta=1e-6)
            for i, (p, q) in enumerate(zip(r["params"], ref)):
                err = ((p.double() - q.double()).abs().max() /
                       q.double().abs().max()).item()
                self.assertLessEqual(err, 1e-5, "tensor %d" % i)
            # Half the moments, each tensor's part 64-byte aligned per kind.
            self.assertGreaterEqual(r["state_bytes"], 0.5 * whole)
            self.assertLessEqual(r["state_bytes"],
                                 0.5 * whole + len(SHAPES) * 2 * 64)
        for p, q in zip(results[0]["params"], results[1]["params"]):
            self.assertTrue(torch.equal(p, q))

    def test_two_ranks_on_one_daemon(self):
        with Daemon(backend="cuda") as d:
            self.check(self.run_job([d.address] * 2))

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
            self.check(self.run_job([d0.address, d1.address]))
        finally:
            self.assertEqual(d0.stop(), 0)
            self.assertEqual(d1.stop(), 0)


if __name__ == "__main__":
    unittest.main()
