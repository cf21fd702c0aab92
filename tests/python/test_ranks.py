"""The ranks of one job agree on the gradient norm and the skip
(gradient_sharding), on one CPU daemon: ranks as threads of this process
(sharded gradients against a single-process torch reference), and a real
two-process gloo DDP job (a rank's inf gradient skips the step on every
rank). Also: a rank that never comes times out with an error naming it, a
rank that leaves aborts the others, and ranks must agree on the job.
"""
import os
import random
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimd
from optimd.testing import Daemon, DaemonTestCase, run_threads
from optimd.torch import AdamW

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(37,), (16, 33), (5,), (3, 4, 7)]
# The rank timeout of the daemon that waits for a rank that never comes:
# short, as the test waits it out.
RANK_TIMEOUT_S = 3


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class RanksOfOneDaemon(DaemonTestCase):
    """Ranks of a job as optimizers of this process, on the class's
    daemon."""
    seed = SEED

    def optimizer(self, params, job, rank, **kw):
        return AdamW(params, address=self.daemon.address, job_id=job,
                     rank=rank, world_size=2, **kw)


class Ranks(RanksOfOneDaemon):
    # Ranks stepping as threads of this process meet in the daemon; on a
    # loaded machine one thread may lag the other by seconds, which must
    # not read as a missing rank: a timeout far above any such lag.
    daemon_flags = ["--rank_timeout_s=60"]

    def sharded_run(self, sharding, steps=30, max_norm=0.5):
        """Four tensors, two per rank (as FSDP2 or ZeRO shard them), against
        two torch.optim.AdamW references with clip_grad_norm_: one clipping
        all four tensors together (the job's norm), one clipping each
        rank's two alone (each shard's own norm). Returns the largest
        relative error against each: (job, own)."""
        full = [torch.randn(*s, generator=self.gen) for s in SHAPES]
        grads = [[torch.randn(*s, generator=self.gen) for s in SHAPES]
                 for _ in range(steps)]

        def reference(clipped_together):
            ref = [torch.nn.Parameter(t.clone()) for t in full]
            ref_opt = torch.optim.AdamW(ref, lr=1e-2)
            for g in grads:
                for p, gi in zip(ref, g):
                    p.grad = gi.clone()
                for part in clipped_together:
                    torch.nn.utils.clip_grad_norm_(
                        [ref[i] for i in part], max_norm)
                ref_opt.step()
            return ref
        shards = [[torch.nn.Parameter(full[i].clone()) for i in (0, 1)],
                  [torch.nn.Parameter(full[i].clone()) for i in (2, 3)]]
        job = "%s-%s" % (self.id(), sharding)
        opts = [self.optimizer(shards[r], job, r, lr=1e-2,
                               max_grad_norm=max_norm,
                               gradient_sharding=sharding)
                for r in (0, 1)]

        def rank(r):
            for g in grads:
                for p, gi in zip(shards[r], g[2 * r:2 * r + 2]):
                    p.grad = gi.clone()
                opts[r].step()
        try:
            run_threads([lambda: rank(0), lambda: rank(1)])
        finally:
            for o in opts:
                o.close()
        return tuple(
            max(rel_err(p.detach(), q.detach())
                for p, q in zip(shards[0] + shards[1], ref))
            for ref in (reference([(0, 1, 2, 3)]),
                        reference([(0, 1), (2, 3)])))

    def test_sharded_ranks_clip_by_the_jobs_norm(self):
        # The two references differ at every step by the ratio of a
        # shard's norm to the job's, by far more than 1e-5: each run must
        # match its own reference, whatever the seed, rather than merely
        # differ from the other by some margin.
        job, own = self.sharded_run("sharded")
        self.assertLessEqual(job, 1e-5)
        self.assertGreater(own, 1e-4)
        # Without the exchange each rank clips by its own shard's norm.
        job, own = self.sharded_run(None)
        self.assertLessEqual(own, 1e-5)
        self.assertGreater(job, 1e-4)

    def test_ranks_must_agree_on_the_job(self):
        job = self.id()
        o0 = self.optimizer([torch.nn.Parameter(torch.zeros(4))], job, 0,
                            gradient_sharding="sharded")
        with self.assertRaises(optimd.FailedPreconditionError) as e:
            self.optimizer([torch.nn.Parameter(torch.zeros(4))], job, 1,
                           gradient_sharding="replicated")
        self.assertIn("every rank of a job must say the same",
                      str(e.exception))
        with self.assertRaises(ValueError):
            self.optimizer([torch.nn.Parameter(torch.zeros(4))], job, 1,
                           gradient_sharding="fsdp")
        o0.close()
        client = optimd.Client(self.daemon.address)
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.create_session(job + "-raw", rank=0, world_size=2,
                                  gradient_sharding=7)
        self.assertIn("unknown gradient_sharding 7", str(e.exception))
        # The CPU backend's ranks meet in the daemon: no NCCL id to take.
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.create_session(job + "-nccl", rank=1, world_size=2,
                                  gradient_sharding=2,
                                  nccl_unique_id=b"x" * 128)
        self.assertIn("only for the ranks of a CUDA job", str(e.exception))
        client.close()


class MissingRank(RanksOfOneDaemon):
    """A rank that never comes, on a daemon of its own with a short rank
    timeout (RANK_TIMEOUT_S), which the test waits out."""
    daemon_flags = ["--rank_timeout_s=%d" % RANK_TIMEOUT_S]

    def test_a_missing_rank_times_out_and_a_leaving_one_aborts(self):
        p0 = [torch.nn.Parameter(torch.zeros(4))]
        p1 = [torch.nn.Parameter(torch.zeros(4))]
        job = self.id()
        o0 = self.optimizer(p0, job, 0, gradient_sharding="sharded")
        o1 = self.optimizer(p1, job, 1, gradient_sharding="sharded")
        p0[0].grad = torch.ones(4)
        with self.assertRaises(optimd.DeadlineExceededError) as e:
            o0.step()
        self.assertIn("ranks 1", str(e.exception))
        self.assertTrue(torch.equal(p0[0].detach(), torch.zeros(4)))
        o1.close()
        with self.assertRaises(optimd.AbortedError) as e:
            o0.step()
        self.assertIn("rank 1", str(e.exception))
        o0.close()


def _ddp_rank(rank, init_file, address, steps, inf_step, out):
    """One rank of a two-process gloo DDP job stepping through optimd."""
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    torch.manual_seed(0)  # the same model on both ranks
    model = torch.nn.Linear(8, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # Rank, world size and a common job id from torch.distributed.
    opt = AdamW(ddp.parameters(), lr=1e-2, address=address,
                gradient_sharding="replicated", max_grad_norm=1.0)
    assert (opt._identity["rank"], opt._identity["world_size"]) == (rank, 2)
    skipped = []
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        opt.zero_grad()
        loss = ddp(torch.randn(16, 8, generator=data)).square().mean()
        loss.backward()
        if rank == 1 and step == inf_step:
            model.weight.grad[0, 0] = float("inf")  # after DDP's all-reduce
        opt.step()
        skipped.append(bool(opt.skipped))
    torch.save({"skipped": skipped,
                "params": [p.detach().clone() for p in model.parameters()]},
               out % rank)
    opt.close()
    dist.destroy_process_group()


class DdpJob(unittest.TestCase):
    def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(self):
        with Daemon(flags=["--rank_timeout_s=60"]) as daemon:
            scratch = tempfile.mkdtemp(prefix="optimd-ddp-")
            out = os.path.join(scratch, "rank%d.pt")
            mp.start_processes(
                _ddp_rank, nprocs=2, start_method="spawn",
                args=(os.path.join(scratch, "init"), daemon.address, 8, 3,
                      out))
            results = [torch.load(out % r) for r in (0, 1)]
        for r in results:
            self.assertEqual(r["skipped"], [s == 3 for s in range(8)])
        for p, q in zip(results[0]["params"], results[1]["params"]):
            self.assertTrue(torch.equal(p, q))


if __name__ == "__main__":
    unittest.main()
