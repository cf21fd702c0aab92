"""optimd.torch.AdamW over FSDP version 1 (FullyShardedDataParallel), whose
parameters are FlatParameters (use_orig_params=False) or views of them
(True): against torch.optim.AdamW on the same model, data and seed, the
optimizer made after wrapping (FSDP's guide) and, with use_orig_params,
before it, on one CUDA rank; and over two ranks (CPU with gloo; CUDA on
nvidia-h200-x2) with gradient_sharding="sharded" against a single-process
torch reference over the whole model. Skipped where torch's FSDP does not
import (Debian's torch 1.13 under Python 3.11); on the GPU machine (torch
2.11, whose FSDP1 also trains on the CPU):

    OPTIMD_BINARY=... PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_fsdp1.py

Tolerance as test_fsdp2.py's: each weight within 1e-4 of its move from
the initial value (1e-3 over two ranks, whose reductions round apart).
"""
import os
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimd.testing import Daemon, record_written_tells
from optimd.torch import AdamW
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fsdp2 import (_batches, _free_port, _model,  # noqa: E402
                        _train)

try:
    from torch.distributed.fsdp import (FullStateDictConfig,
                                        FullyShardedDataParallel,
                                        StateDictType)
except Exception:  # noqa: BLE001 (torch 1.13 under Python 3.11 raises
    # ValueError from its own dataclasses while importing these)
    FullyShardedDataParallel = None

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))


def _wrap(m, use_orig_params, device="cuda", offload=False):
    """Each layer and the whole model in FSDP1 units, on the current CUDA
    device or the CPU (FULL_SHARD; one rank makes it NO_SHARD); `offload`:
    the shards and their gradients kept in the CPU's memory between
    steps (CPUOffload(offload_params=True))."""
    from torch.distributed.fsdp import CPUOffload
    kw = dict(use_orig_params=use_orig_params,
              device_id=torch.cuda.current_device() if device == "cuda"
              else torch.device("cpu"),
              cpu_offload=CPUOffload(offload_params=offload))
    for name in ("a", "unused", "b"):
        setattr(m, name, FullyShardedDataParallel(getattr(m, name), **kw))
    return FullyShardedDataParallel(m, **kw)


def _full(m):
    """The whole model's weights by their names (a collective). On the
    CPU from the gathered parameters (FSDP1's full state dict there is
    not one torch's own tests cover)."""
    if next(m.parameters()).device.type == "cpu":
        with FullyShardedDataParallel.summon_full_params(m, writeback=False):
            return {k.replace("_fsdp_wrapped_module.", ""):
                    v.detach().float().cpu().clone()
                    for k, v in m.named_parameters()}
    with FullyShardedDataParallel.state_dict_type(
            m, StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False)):
        return {k: v.detach().float().cpu().clone()
                for k, v in m.state_dict().items()}


def _fsdp_clip(m, max_norm):
    m.clip_grad_norm_(max_norm)  # FSDP's own, the job's norm


def _two_rank_worker(rank, init_file, address, out, device):
    """One rank of a two-rank FSDP1 job (gloo on the CPU; NCCL on CUDA,
    rank r on GPU r)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method="file://" + init_file, rank=rank,
                            world_size=2)
    m = _wrap(_model(device), use_orig_params=False, device=device)
    opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                max_grad_norm=0.5, gradient_sharding="sharded",
                address=address)
    _train(m, opt, _batches(), device, rank=rank, world_size=2)
    opt.synchronize()
    weights = _full(m)
    if rank == 0:
        torch.save(dict(weights=weights, grad_norm=opt.grad_norm), out)
    opt.close()
    dist.destroy_process_group()


@unittest.skipIf(FullyShardedDataParallel is None or
                 not torch.cuda.is_available(),
                 "needs torch's FSDP, built with CUDA")
class Fsdp1Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemons = {"cpu": Daemon(backend="cpu",
                                     flags=["--rank_timeout_s=60"]),
                       "cuda": Daemon(backend="cuda")}
        cls.daemon = cls.daemons["cuda"]
        os.environ.update(MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        for d in cls.daemons.values():
            assert d.stop() == 0

    def assert_moved_alike(self, ours, ref, init, bound=1e-4):
        self.assertEqual(sorted(ours), sorted(ref))
        for name, q in ref.items():
            moved = (q - init[name]).abs().max().item()
            err = (ours[name] - q).abs().max().item()
            self.assertLessEqual(err, bound * max(moved, 1e-12),
                                 "%s: %g against a move of %g" % (
                                     name, err, moved))

    def one_rank(self, use_orig_params, before_wrap=False, offload=False):
        init = {k: v.float().cpu() for k, v in _model("cuda").state_dict()
                .items()}
        ref_model = _wrap(_model("cuda"), use_orig_params, offload=offload)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2,
                                    weight_decay=0.1)
        if before_wrap:
            # With use_orig_params the parameters stay the same objects:
            # an optimizer made before wrapping steps them in the flat
            # buffers FSDP points them into, for torch's as for ours.
            m = _model("cuda")
            opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                        max_grad_norm=0.5, address=self.daemon.address)
            m = _wrap(m, use_orig_params)
        else:
            m = _wrap(_model("cuda"), use_orig_params, offload=offload)
            # Offloaded, the shards are in the CPU's memory: a CPU session
            # (the daemon serves both devices).
            opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                        max_grad_norm=0.5, address=self.daemon.address)
        batches = _batches()
        _train(ref_model, ref_opt, batches, "cuda", clip_in_trainer=0.5,
               clip=_fsdp_clip)
        _train(m, opt, batches, "cuda")
        opt.synchronize()
        ours = _full(m)
        self.assert_moved_alike(ours, _full(ref_model), init)
        for k in ("unused.weight", "unused.bias") if not offload else ():
            # No gradient: not stepped (no decay), as in torch. Offloaded,
            # FSDP1 gives every shard a gradient (zeros for the unused
            # layer), which torch's step decays as ours does.
            self.assertTrue(torch.equal(ours[k], init[k]), k)
        opt.close()

    def test_flat_parameters_match_torch(self):
        self.one_rank(use_orig_params=False)

    def test_original_parameters_match_torch(self):
        self.one_rank(use_orig_params=True)

    def test_optimizer_made_before_wrapping_matches_torch(self):
        self.one_rank(use_orig_params=True, before_wrap=True)

    def test_offloaded_shards_match_torch(self):
        # CPUOffload: FSDP1 copies the shards to the GPU for forward and
        # backward and steps them, and their gradients, in the CPU's
        # memory, where the daemon's CPU backend steps them in place.
        self.one_rank(use_orig_params=False, offload=True)

    def test_values_written_into_bf16_flat_parameters_are_stepped_from(self):
        self.written_bf16(use_orig_params=False)

    def test_values_written_into_bf16_parameters_are_stepped_from(self):
        self.written_bf16(use_orig_params=True)

    def written_bf16(self, use_orig_params):
        """bf16 parameters keep fp32 masters in the daemon. Values written
        through FSDP1's gathered parameters (summon_full_params with
        writeback, which copies them into each FlatParameter's local
        shard) are the next step's starting point, as in torch; a training
        step after the first tells the daemon nothing."""
        m = _wrap(_model("cuda").to(torch.bfloat16), use_orig_params)
        opt = AdamW(m.parameters(), lr=1e-2, address=self.daemon.address)
        told = record_written_tells(opt)
        batches = _batches()

        def step(x):
            m(x.to("cuda", torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()

        step(batches[0])  # FSDP1's lazy init may touch the shards
        told.clear()
        step(batches[1])
        self.assertEqual(told, [], "steps alone told writes")
        with FullyShardedDataParallel.summon_full_params(m, writeback=True):
            with torch.no_grad():
                m.a.weight.fill_(5.0)
        step(batches[2])
        opt.synchronize()
        self.assertEqual(len(told), 1)
        full = _full(m)
        self.assertLess((full["a.weight"] - 5.0).abs().max().item(), 0.1,
                        "stepped from the old masters")
        opt.close()

    def test_two_cpu_ranks_clip_by_the_job_norm(self):
        self.two_ranks("cpu")

    @unittest.skipUnless(torch.cuda.device_count() >= 2,
                         "needs two GPUs (nvidia-h200-x2)")
    def test_two_cuda_ranks_clip_by_the_job_norm(self):
        self.two_ranks("cuda")

    def two_ranks(self, device):
        """Each rank holds half of every flat parameter and half of each
        batch; the daemon clips by the norm of both ranks' shards: the
        same as one process over the whole model with clip_grad_norm_."""
        scratch = tempfile.mkdtemp(prefix="optimd-fsdp1-")
        out = os.path.join(scratch, "rank0.pt")
        mp.start_processes(_two_rank_worker, args=(
            os.path.join(scratch, "init"), self.daemons[device].address, out,
            device), nprocs=2, start_method="spawn")
        got = torch.load(out)
        m = _model("cpu")
        init = {k: v.clone() for k, v in m.state_dict().items()}
        ref_opt = torch.optim.AdamW(m.parameters(), lr=1e-2,
                                    weight_decay=0.1)
        norm = None
        for x in _batches():
            m(x).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        self.assertAlmostEqual(got["grad_norm"], norm.item(),
                               delta=1e-5 * norm.item())
        self.assert_moved_alike(got["weights"], m.state_dict(), init,
                                bound=1e-3)


if __name__ == "__main__":
    unittest.main()
