"""ZeRO-sharded optimizer state for DDP (shard_state=True) on the CPU
backend: a real two-process gloo DDP job against a single-process
torch.optim.AdamW reference (clipping included) step by step, each rank's
state about half of the whole, a rank's inf gradient skipping the step on
both ranks, checkpoints saved and loaded per rank, and the bad requests.
"""
import copy
import os
import shutil
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import optimd
from optimd.shm import SharedSegment
from optimd.testing import (Daemon, DaemonTestCase, run_threads,
                            session_state_bytes)
from optimd.torch import AdamW
from optimd.v1 import optimd_pb2 as pb

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

STEPS = 12
MAX_NORM = 0.1  # below every step's norm (about 0.48): clipping acts
LR = 1e-2
# Per step, relative to the largest parameter: the norm's summation order
# (the ranks' parts added, not one pass) and DDP's averaging differ from
# the reference in the last bits.
TOLERANCE = 2e-5


def make_model():
    torch.manual_seed(0)  # the same model on every rank and the reference
    # 64*96 + 96 + 96*24 + 24 = 8568 parameters: the boundary between the
    # two ranks' parts (element 4284) falls inside the first weight.
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 24))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=g), torch.randn(16, 24, generator=g)


def loss_of(model, x, y):
    return (model(x) - y).square().mean()




def _zero_rank(rank, init_file, address, out, inf_step, ckpt):
    """One rank of a two-process gloo DDP job with shard_state=True."""
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    model = make_model()
    if ckpt:
        # The first weight stepped where it is (part of a larger buffer)
        # with its elements in an order of their own (transposed): the
        # load's parts of it are ranges of its memory.
        w = model[0].weight
        buf = torch.empty(2 * w.numel())
        view = buf[:w.numel()].view(w.shape[1], w.shape[0]).t()
        view.copy_(w.detach())
        w.data = view
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = AdamW(ddp.parameters(), lr=LR, address=address,
                max_grad_norm=MAX_NORM, shard_state=True,
                skip_nonfinite=inf_step is not None)
    job = opt._identity["job"]
    params, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(ddp, *batch(rank, step)).backward()
        if rank == 1 and step == inf_step:
            # After DDP's all-reduce, in rank 1's own part (the last
            # layer): each rank checks the part of the gradient it updates,
            # which for DDP's equal gradients covers the whole once.
            model[2].weight.grad[0, 0] = float("inf")
        opt.step()
        skipped.append(bool(opt.skipped))
        params.append([p.detach().clone() for p in model.parameters()])
        if ckpt and step == STEPS // 2 - 1:
            opt.save_checkpoint(ckpt)
    result = {"params": params, "skipped": skipped,
              "state_bytes": session_state_bytes(address, job, rank)}
    if ckpt:
        # Back to the middle: every rank loads its own part; the job then
        # retraces the second half bit for bit.
        opt.load_checkpoint(ckpt)
        again = []
        for step in range(STEPS // 2, STEPS):
            opt.zero_grad()
            loss_of(ddp, *batch(rank, step)).backward()
            opt.step()
            again.append([p.detach().clone() for p in model.parameters()])
        result["again"] = again
    _finish(result, out % rank, opt)


def _finish(result, path, opt):
    """Saves a rank's result, then ends its part of the job."""
    torch.save(result, path)
    dist.barrier()
    opt.close()
    dist.destroy_process_group()


def _consolidating_rank(rank, init_file, address, out):
    """One rank of a two-process gloo DDP job that puts its sharded state
    together on rank 0 halfway (as with torch's ZeroRedundancyOptimizer),
    then goes on with a new shard_state optimizer that every rank loads
    that whole state dict into."""
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = AdamW(ddp.parameters(), lr=LR, address=address,
                max_grad_norm=MAX_NORM, shard_state=True)
    result = {"refused": []}

    def refused():
        try:
            opt.state_dict()
        except RuntimeError as e:
            result["refused"].append(str(e))
    refused()  # nothing put together yet
    params = []
    for step in range(STEPS):
        if step == STEPS // 2:
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                result["state_dict"] = opt.state_dict()
            else:
                refused()  # put together on rank 0 only
            whole = [result.get("state_dict")]
            dist.broadcast_object_list(whole, src=0)
            opt.close()
            opt = AdamW(ddp.parameters(), lr=LR, address=address,
                        max_grad_norm=MAX_NORM, shard_state=True)
            opt.load_state_dict(whole[0])
        opt.zero_grad()
        loss_of(ddp, *batch(rank, step)).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    result["params"] = params
    _finish(result, out % rank, opt)


def reference(state_at=None):
    """torch.optim.AdamW on one process over both ranks' batches (DDP's
    gradient is the mean of the ranks'), clipped by clip_grad_norm_: the
    parameters after each step, and with `state_at` also its state dict
    before that step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    state = None
    for step in range(STEPS):
        if step == state_at:
            state = copy.deepcopy(opt.state_dict())
        opt.zero_grad()
        loss = sum(loss_of(model, *batch(r, step)) for r in (0, 1)) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out if state_at is None else (out, state)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class ZeroDdpJob(unittest.TestCase):
    def run_job(self, inf_step=None, checkpoint=False, job=_zero_rank):
        """Runs `job` on two processes: (rank, init file, daemon address,
        output pattern), then _zero_rank's inf_step and checkpoint
        directory. Returns each rank's saved result."""
        scratch = tempfile.mkdtemp(prefix="optimd-zero-")
        self.addCleanup(shutil.rmtree, scratch, True)
        out = os.path.join(scratch, "rank%d.pt")
        ckpt = os.path.join(scratch, "ckpt") if checkpoint else None
        if ckpt:
            os.makedirs(ckpt)
        extra = (inf_step, ckpt) if job is _zero_rank else ()
        with Daemon(flags=["--rank_timeout_s=60"]) as daemon:
            mp.start_processes(
                job, nprocs=2, start_method="spawn",
                args=(os.path.join(scratch, "init"), daemon.address,
                      out) + extra)
        return [torch.load(out % r) for r in (0, 1)]

    def test_matches_torch_adamw_with_half_the_state_per_rank(self):
        results = self.run_job()
        ref = reference()
        for step in range(STEPS):
            for r in results:
                err = max(rel_err(p, q)
                          for p, q in zip(r["params"][step], ref[step]))
                self.assertLessEqual(err, TOLERANCE, "step %d" % step)
            # Both ranks' parameters hold every rank's updated part.
            for p, q in zip(results[0]["params"][step],
                            results[1]["params"][step]):
                self.assertTrue(torch.equal(p, q), "step %d" % step)
        # fp32 parameters: two fp32 moments per element, 8 bytes, each
        # tensor's slice rounded up to 64 bytes per state kind.
        whole = 8 * sum(p.numel() for p in make_model().parameters())
        for r in results:
            self.assertGreaterEqual(r["state_bytes"], 0.5 * whole)
            self.assertLessEqual(r["state_bytes"], 0.5 * whole + 4 * 2 * 64)

    def test_an_inf_gradient_on_one_rank_skips_the_step_on_both(self):
        results = self.run_job(inf_step=3)
        for r in results:
            self.assertEqual(r["skipped"], [s == 3 for s in range(STEPS)])
        for step in range(STEPS):
            for p, q in zip(results[0]["params"][step],
                            results[1]["params"][step]):
                self.assertTrue(torch.equal(p, q))
        # The skipped step changed nothing.
        for p, q in zip(results[0]["params"][2], results[0]["params"][3]):
            self.assertTrue(torch.equal(p, q))

    def test_each_rank_saves_and_loads_its_part(self):
        results = self.run_job(checkpoint=True)
        for r in results:
            for a, b in zip(r["again"], r["params"][STEPS // 2:]):
                for p, q in zip(a, b):
                    self.assertTrue(torch.equal(p, q))

    def test_whole_state_put_together_and_loaded_as_torch_zero_does(self):
        """consolidate_state_dict(to=0) gives rank 0 torch.optim.AdamW's
        state dict of the whole model (the reference's, within the per-step
        tolerance); every rank loading it into a new shard_state optimizer
        goes on as the reference does; state_dict() before, or on another
        rank, raises as torch's ZeroRedundancyOptimizer does."""
        results = self.run_job(job=_consolidating_rank)
        ref, ref_state = reference(state_at=STEPS // 2)
        self.assertEqual(len(results[0]["refused"]), 1)
        self.assertEqual(len(results[1]["refused"]), 2)
        self.assertIn("consolidate_state_dict(to=1)",
                      results[1]["refused"][1])
        got = results[0]["state_dict"]
        self.assertEqual(got["param_groups"][0]["params"],
                         ref_state["param_groups"][0]["params"])
        self.assertEqual(sorted(got["state"]), sorted(ref_state["state"]))
        for i, want in ref_state["state"].items():
            self.assertEqual(sorted(got["state"][i]), sorted(want))
            self.assertEqual(float(got["state"][i]["step"]),
                             float(want["step"]))
            for kind in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(got["state"][i][kind].shape,
                                 want[kind].shape)
                self.assertLessEqual(rel_err(got["state"][i][kind],
                                             want[kind]), TOLERANCE,
                                     "%d %s" % (i, kind))
        for step in range(STEPS):
            for r in results:
                err = max(rel_err(p, q)
                          for p, q in zip(r["params"][step], ref[step]))
                self.assertLessEqual(err, TOLERANCE, "step %d" % step)



class ZeroRequests(DaemonTestCase):
    daemon_flags = ["--rank_timeout_s=20"]

    def test_every_layout_steps_as_one_unsharded_session_bit_for_bit(self):
        """Without clipping each element's update is the same arithmetic
        whichever session holds it: two ranks with sharded state end with
        the bits of one session holding everything (fp32 parameters,
        bf16 with an fp32 master, bf16 with int16 remainders)."""
        for dtype, extra in ((torch.float32, {}),
                             (torch.bfloat16, {}),
                             (torch.bfloat16,
                              {"store_param_remainders": True})):
            model = make_model().to(dtype)
            grads = [[torch.randn_like(p) for p in model.parameters()]
                     for _ in range(4)]

            def fresh():
                return [torch.nn.Parameter(p.detach().clone())
                        for p in model.parameters()]
            job = "%s-%s-%s" % (self.id(), dtype, sorted(extra))
            whole = fresh()
            one = AdamW(whole, lr=LR, address=self.daemon.address,
                        job_id=job + "-one", **extra)
            parts = [fresh(), fresh()]
            opts = [AdamW(parts[r], lr=LR, address=self.daemon.address,
                          job_id=job, rank=r, world_size=2,
                          shard_state=True, **extra) for r in (0, 1)]
            for g in grads:
                for ps in [whole] + parts:
                    for p, gi in zip(ps, g):
                        p.grad = gi.clone()
                one.step()
                run_threads([opts[0].step, opts[1].step])
            for r in (0, 1):
                for p, q in zip(parts[r], whole):
                    self.assertTrue(torch.equal(p, q), "%s %s" % (dtype,
                                                                 extra))
            for o in [one] + opts:
                o.close()

    def test_a_checkpoint_loads_only_into_the_same_world_size(self):
        job = self.id()
        model = make_model()
        params = [[torch.nn.Parameter(p.detach().clone())
                   for p in model.parameters()] for _ in (0, 1)]
        opts = [AdamW(params[r], lr=LR, address=self.daemon.address,
                      job_id=job, rank=r, world_size=2, shard_state=True)
                for r in (0, 1)]
        for o in opts:
            self.addCleanup(o.close)
        for ps in params:
            for p in ps:
                p.grad = torch.ones_like(p)
        run_threads([opts[0].step, opts[1].step])
        ckpt = tempfile.mkdtemp(prefix="optimd-zero-ckpt-")
        self.addCleanup(shutil.rmtree, ckpt, True)
        for o in opts:
            o.save_checkpoint(ckpt)
        with self.assertRaisesRegex(RuntimeError, "consolidate_state_dict"):
            opts[0].state_dict()
        # Edits that carry the state over through a state dict raise,
        # naming the edit, and change nothing.
        opts[0].param_groups[0]["amsgrad"] = True
        with self.assertRaisesRegex(NotImplementedError,
                                    r"changing param_groups\[0\]'s amsgrad"):
            opts[0].step()
        opts[0].param_groups[0]["amsgrad"] = False
        # Rank 0 of three keeps a third: rank 0 of two's file does not fit.
        three = AdamW([torch.nn.Parameter(p.detach().clone())
                       for p in model.parameters()],
                      lr=LR, address=self.daemon.address, job_id=job + "-3",
                      rank=0, world_size=3, shard_state=True)
        self.addCleanup(three.close)
        with self.assertRaises(optimd.FailedPreconditionError) as e:
            three.load_checkpoint(ckpt)
        # Rank 0 of two holds 4284 of 0.weight's 6144 elements; of three,
        # 2856.
        self.assertIn("with 4284 elements", str(e.exception))
        self.assertIn("registered: 2856 elements", str(e.exception))

    def test_shard_state_needs_ranks_and_replicated_gradients(self):
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.create_session(self.id() + "-one", rank=0, world_size=1,
                                  gradient_sharding=1, shard_state=True)
        self.assertIn("needs world_size > 1", str(e.exception))
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.create_session(self.id() + "-sharded", rank=0,
                                  world_size=2, gradient_sharding=2,
                                  shard_state=True)
        self.assertIn("gradient_sharding replicated (got sharded)",
                      str(e.exception))
        # Ranks must agree on shard_state.
        client.create_session(self.id(), rank=0, world_size=2,
                              gradient_sharding=1, shard_state=True)
        other = optimd.Client(self.daemon.address)
        self.addCleanup(other.close)
        with self.assertRaises(optimd.FailedPreconditionError) as e:
            other.create_session(self.id(), rank=1, world_size=2,
                                 gradient_sharding=1)
        self.assertIn("every rank of a job must say the same",
                      str(e.exception))
        with self.assertRaises(ValueError):
            AdamW([torch.nn.Parameter(torch.zeros(4))],
                  address=self.daemon.address, world_size=2, rank=0,
                  shard_state=True, gradient_sharding="sharded")
        with self.assertRaises(ValueError):
            AdamW([torch.nn.Parameter(torch.zeros(4))],
                  address=self.daemon.address, shard_state=True)

    def test_a_partial_buffer_is_refused_and_changes_nothing(self):
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session(self.id(), rank=1, world_size=2,
                              gradient_sharding=1, shard_state=True)
        seg = SharedSegment(4096)
        self.addCleanup(seg.close)
        request = pb.RegisterGroupRequest(group_id="g")
        request.hyperparameters.lr = 1e-3
        t = request.tensors.add(name="w", numel=100,
                                param_dtype=pb.DTYPE_FLOAT32,
                                grad_dtype=pb.DTYPE_FLOAT32)
        t.param.CopyFrom(seg.handle(0, 400))
        t.grad.CopyFrom(seg.handle(512, 200))  # half of the gradient
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.register_group(request)
        self.assertIn("tensor 'w': grad buffer is 200 bytes", str(e.exception))
        self.assertEqual(list(client.get_state(metadata_only=True).groups),
                         [])


if __name__ == "__main__":
    unittest.main()
