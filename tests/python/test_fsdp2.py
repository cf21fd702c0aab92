"""optimd.torch.AdamW over FSDP2 (fully_shard) models, whose parameters are
DTensors: against torch.optim.AdamW on the same model, data and seed, on
one rank in this process and on two CPU ranks (gloo) against a
single-process torch reference over the whole model, the job's global
norm clipped by the daemon. Skipped where torch has no fully_shard (torch
1.13, Debian's; the GPU machine's torch 2.11 has it): there

    OPTIMD_BINARY=... PYTHONPATH=client/python python3 -m unittest -v \\
        tests/python/test_fsdp2.py

runs the CPU backend, and on CUDA too when a GPU is present.

Tolerance: the optimizers agree to about 1e-7 relative per step; over the
steps here each weight must agree with torch's to 1e-4 of its move from
the initial value (measured: 1e-6 and below).
"""
import os
import socket
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimd.checkpoint import merge_shards
from optimd.testing import Daemon, record_written_tells
from optimd.torch import AdamW

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except Exception:  # noqa: BLE001 (torch 1.13 under Python 3.11 raises
    # ValueError from its own dataclasses while importing these)
    fully_shard = None

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))
STEPS = 6


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Net(torch.nn.Module):
    """Three layers, the middle one unused by the forward (its parameters
    get no gradient: torch leaves them as they are)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 24)
        self.unused = torch.nn.Linear(5, 5)
        self.b = torch.nn.Linear(24, 6)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def _model(device):
    torch.manual_seed(0)
    return _Net().to(device)


def _shard(m, device, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device, (world_size,))
    for layer in (m.a, m.unused, m.b):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _batches(n=STEPS, rows=8):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(rows, 12, generator=g) * 4 for _ in range(n)]


def _full(m):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v)
            .detach().float().cpu().clone() for k, v in m.state_dict().items()}


def _clip_grad_norm(m, max_norm):
    torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)


def _train(m, opt, batches, device, clip_in_trainer=None, rank=0,
           world_size=1, clip=_clip_grad_norm):
    """Steps over this rank's rows of each batch, clipping in the trainer
    with `clip` (torch's clip_grad_norm_ unless told) when
    clip_in_trainer is set."""
    for i, x in enumerate(batches):
        rows = x.shape[0] // world_size
        loss = m(x[rank * rows:(rank + 1) * rows].to(device))
        loss.backward()
        if clip_in_trainer:
            clip(m, clip_in_trainer)
        opt.step()
        opt.zero_grad(set_to_none=i % 2 == 0)


def _two_rank_worker(rank, init_file, address, out, device):
    """One rank of a two-rank FSDP2 job (gloo on the CPU; NCCL on CUDA,
    rank r on GPU r)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method="file://" + init_file, rank=rank,
                            world_size=2)
    m = _shard(_model(device), device, 2)
    opt = AdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1,
                max_grad_norm=0.5, address=address)
    _train(m, opt, _batches(), device, rank=rank, world_size=2)
    opt.synchronize()
    opt.save_checkpoint(os.path.dirname(out))  # rank-<r>.safetensors
    weights = _full(m)  # a collective: every rank takes part
    if rank == 0:
        torch.save(dict(weights=weights, grad_norm=opt.grad_norm), out)
    opt.close()
    dist.destroy_process_group()


@unittest.skipIf(fully_shard is None, "needs torch's FSDP2 (fully_shard)")
class Fsdp2Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemons = {"cpu": Daemon(backend="cpu",
                                     flags=["--rank_timeout_s=60"])}
        if torch.cuda.is_available():
            cls.daemons["cuda"] = Daemon(backend="cuda")
        os.environ.update(MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
            rank=0, world_size=1)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        for d in cls.daemons.values():
            assert d.stop() == 0

    def assert_moved_alike(self, ours, ref, init, bound=1e-4):
        for name, q in ref.items():
            moved = (q - init[name]).abs().max().item()
            err = (ours[name] - q).abs().max().item()
            self.assertLessEqual(err, bound * max(moved, 1e-12),
                                 "%s: %g against a move of %g" % (
                                     name, err, moved))

    def one_rank(self, device):
        init = _full(_model(device))
        models = [_shard(_model(device), device, 1) for _ in range(2)]
        ref_opt = torch.optim.AdamW(models[0].parameters(), lr=1e-2,
                                    weight_decay=0.1)
        opt = AdamW(models[1].named_parameters(), lr=1e-2, weight_decay=0.1,
                    max_grad_norm=0.5, address=self.daemons[device].address)
        batches = _batches()
        shards = [p._local_tensor.data_ptr() for p in models[1].parameters()]
        _train(models[0], ref_opt, batches, device, clip_in_trainer=0.5)
        _train(models[1], opt, batches, device)
        opt.synchronize()
        # FSDP2 gathers from the shards the daemon wrote (in place on
        # CUDA, mirrored on the CPU): they never moved.
        self.assertEqual(shards, [p._local_tensor.data_ptr()
                                  for p in models[1].parameters()])
        ref, ours = _full(models[0]), _full(models[1])
        self.assert_moved_alike(ours, ref, init)
        for k in ("unused.weight", "unused.bias"):
            # No gradient: not stepped (no decay), as in torch.
            self.assertTrue(torch.equal(ours[k], init[k]), k)
        return models, ref_opt, opt

    def check_state(self, models, ref_opt, opt):
        """Moments are DTensors of the parameters' placements, as torch's,
        and torch.distributed.checkpoint's helpers move them both ways."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_optimizer_state_dict,
            set_optimizer_state_dict)
        p = next(iter(models[1].parameters()))
        exp_avg = opt.state[p]["exp_avg"]
        self.assertIsInstance(exp_avg, DTensor)
        self.assertEqual(exp_avg.placements, p.placements)
        ref = get_optimizer_state_dict(models[0], ref_opt)["state"]
        ours = get_optimizer_state_dict(models[1], opt)
        # As accelerate's save_state asks for it: moved to the CPU, which
        # walks the groups' values too (tensors, numbers, strings only).
        offloaded = get_optimizer_state_dict(
            models[1], opt, options=StateDictOptions(cpu_offload=True))
        self.assertEqual(sorted(offloaded["state"]), sorted(ref))
        self.assertEqual(sorted(ours["state"]), sorted(ref))
        for name, r in ref.items():
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.allclose(
                    ours["state"][name][key].full_tensor().cpu(),
                    r[key].full_tensor().cpu(), rtol=1e-4, atol=1e-7), name)
        again = AdamW(models[1].parameters(), lr=1e-2,
                      address=opt.client.address)
        # strict=False: the unused layer has no state, in torch's state
        # dict as in ours, which torch's strict load refuses for both.
        set_optimizer_state_dict(models[1], again, ours,
                                 options=StateDictOptions(strict=False))
        back = get_optimizer_state_dict(models[1], again)["state"]
        for name, r in ours["state"].items():
            self.assertTrue(torch.equal(back[name]["exp_avg_sq"].full_tensor(),
                                        r["exp_avg_sq"].full_tensor()), name)
        again.close()

    def test_one_cpu_rank_matches_torch(self):
        models, ref_opt, opt = self.one_rank("cpu")
        self.check_state(models, ref_opt, opt)
        opt.close()

    @unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
    def test_one_cuda_rank_matches_torch_in_place(self):
        # The daemon writes FSDP2's own shards: the parameters' memory is
        # the same before and after the steps.
        models, ref_opt, opt = self.one_rank("cuda")
        self.check_state(models, ref_opt, opt)
        opt.close()

    def test_values_written_into_bf16_shards_are_stepped_from_cpu(self):
        self.written_bf16_shards("cpu")

    @unittest.skipUnless(torch.cuda.is_available(), "needs a GPU")
    def test_values_written_into_bf16_shards_are_stepped_from_cuda(self):
        self.written_bf16_shards("cuda")

    def written_bf16_shards(self, device):
        """bf16 DTensor parameters keep fp32 masters in the daemon. Values
        written through a DTensor or into its local shard (as FSDP2's own
        loads do) are the next step's starting point, as in torch; a
        training step after the first tells the daemon nothing."""
        m = _shard(_model(device).to(torch.bfloat16), device, 1)
        opt = AdamW(m.named_parameters(), lr=1e-2,
                    address=self.daemons[device].address)
        told = record_written_tells(opt)

        def step(x):
            m(x.to(device, torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()

        batches = _batches()
        step(batches[0])  # FSDP2's lazy init may give shards new tensors
        told.clear()
        step(batches[1])
        self.assertEqual(told, [], "steps alone told writes")
        with torch.no_grad():
            m.a.weight.fill_(5.0)
            m.b.weight.to_local().fill_(-4.0)
        step(batches[2])
        opt.synchronize()
        self.assertEqual(told, [2])
        full = _full(m)
        self.assertLess((full["a.weight"] - 5.0).abs().max().item(), 0.1,
                        "stepped from the old masters")
        self.assertLess((full["b.weight"] + 4.0).abs().max().item(), 0.1,
                        "stepped from the old masters")
        opt.close()

    def test_two_cpu_ranks_clip_by_the_job_norm(self):
        self.two_ranks("cpu")

    @unittest.skipUnless(torch.cuda.device_count() >= 2,
                         "needs two GPUs (nvidia-h200-x2)")
    def test_two_cuda_ranks_clip_by_the_job_norm(self):
        # The daemon's sessions of the two GPUs agree through NCCL.
        self.two_ranks("cuda")

    def two_ranks(self, device):
        """Each rank holds half of every parameter and half of each batch;
        FSDP2 averages the gradients, the daemon clips by the norm of all
        ranks' shards together: the same as one process training the
        whole model on whole batches with clip_grad_norm_."""
        scratch = tempfile.mkdtemp(prefix="optimd-fsdp2-")
        out = os.path.join(scratch, "rank0.pt")
        mp.start_processes(_two_rank_worker, args=(
            os.path.join(scratch, "init"), self.daemons[device].address, out,
            device), nprocs=2, start_method="spawn")
        got = torch.load(out)
        m = _model("cpu")
        init = _full(m)
        ref_opt = torch.optim.AdamW(m.parameters(), lr=1e-2,
                                    weight_decay=0.1)
        norm = None
        for x in _batches():
            m(x).backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            ref_opt.step()
            ref_opt.zero_grad()
        self.assertAlmostEqual(got["grad_norm"], norm.item(), delta=1e-5 *
                               norm.item())
        self.assert_moved_alike(got["weights"], _full(m), init, bound=1e-3)
        # The ranks' checkpoints put together: the whole parameters, with
        # the names and shapes of the model's (a resharded resume starts
        # from them), and the moments of the reference.
        merged, state = merge_shards(scratch)
        for k, v in got["weights"].items():
            self.assertTrue(torch.equal(merged[k], v), k)
        ref_state = {k: ref_opt.state[p] for k, p in m.named_parameters()
                     if p in ref_opt.state}
        self.assertEqual(sorted(state), sorted(ref_state))
        for k, r in ref_state.items():
            self.assertTrue(torch.allclose(state[k]["exp_avg"], r["exp_avg"],
                                           rtol=1e-3, atol=1e-7), k)
        for k in ("unused.weight", "unused.bias"):
            self.assertTrue(torch.equal(got["weights"][k], init[k]), k)


if __name__ == "__main__":
    unittest.main()
