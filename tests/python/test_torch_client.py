"""optimd.torch.AdamW as a drop-in torch optimizer: training a model,
several groups, state dicts both ways with torch.optim.AdamW, resume after a
trainer crash, and clear Python errors."""
import atexit
import copy
import gc
import itertools
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock
import warnings
import weakref

import torch

import optimd
import optimd.testing
import optimd.torch
from optimd.testing import Daemon, record_written_tells
from optimd.torch import AdamW

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# Twin models that compute their own gradients (train_step) part by more
# than float32 rounding: after the first step their weights differ by ulps
# (optimd's and torch's AdamW order their arithmetic differently), and a
# gradient element that is a small difference of large terms then differs
# by much more, relatively, which Adam's m / sqrt(v) carries into the
# update. One random seed reached 1.7e-6 in three steps. A weight decay
# of 0.01 left out parts them by 5e-5 in five steps at lr 1e-3; a missed
# step by about 1e-2.
OWN_GRADS_TOL = 1e-5


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def scale_err(a, b, peak=0.0):
    """max |a - b| over the scale of b: its largest magnitude, or `peak`
    (its largest magnitude earlier in the test, Peaks) where that is
    larger."""
    scale = max(b.abs().max().item(), peak, 1e-30)
    return (a - b).abs().max().item() / scale


class Peaks:
    """The largest magnitude each tensor has had so far in a test: the scale
    that the ulp-level differences of two optimizers stepping it are
    measured against.

    Such a difference is a few ulps of the values the tensor had when it
    arose, and it stays when the tensor later shrinks: a one-element bias
    that crosses zero carries the last bits of its earlier values through,
    and against its value of the moment they look arbitrarily large (one
    random seed: a bias at -5e-4, started at 1.1e-2, differed by 7e-10,
    1.4e-6 of its value, at its third step). The largest value it has had
    is a scale that cannot vanish. Keyed by the tensor object: pass the
    parameter itself, not a detached view."""

    def __init__(self):
        self._peaks = {}

    def __call__(self, t):
        """t's largest magnitude so far, its present one included."""
        now = t.detach().abs().max().item() if t.numel() else 0.0
        peak = max(self._peaks.get(t, 0.0), now)
        self._peaks[t] = peak
        return peak


class _Fsdp1Linear(torch.nn.Module):
    """A linear layer held as FSDP version 1 holds it (one rank,
    FULL_SHARD's moves): one FlatParameter marked `_fsdp_flattened` over
    the local shard; forward points it at a gathered copy, computes with
    views of that, and points it back at the shard (reshard), where
    backward's gradient and the optimizer step find it."""

    def __init__(self):
        super().__init__()
        self.flat = torch.nn.Parameter(torch.randn(15))
        self.flat._fsdp_flattened = True
        self.local_shard = self.flat.data

    def forward(self, x):
        self.flat.data = self.local_shard.clone()  # the all-gather
        w, b = self.flat[:12].view(3, 4), self.flat[12:]
        out = x @ w.t() + b
        self.flat.data = self.local_shard
        return out


def session_keys(client):
    """The (job id, rank) of every session open in the daemon.

    A test that must leave no session behind compares these before and
    after, and asks only that none be new: another test's optimizer that
    the garbage collector frees meanwhile closes its session, so a count
    of all sessions can change for reasons the test did not cause."""
    return {(s.job_id, s.rank) for s in client.list_sessions().sessions}


def as_nobody(address):
    """What optimd.Client(address) raises in a process of user nobody
    (run as root), from a copy of the package that user may read."""
    import shutil
    import optimd.v1.optimd_pb2 as stubs
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        os.chmod(scratch, 0o755)
        package = os.path.join(scratch, "optimd")
        shutil.copytree(os.path.dirname(optimd.__file__), package,
                        ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("optimd_pb2.py", "optimd_pb2_grpc.py"):
            shutil.copy(os.path.join(os.path.dirname(stubs.__file__), name),
                        os.path.join(package, "v1", name))

        def drop():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
        out = subprocess.run(
            [sys.executable, "-c",
             "import sys, optimd\n"
             "try:\n"
             "    optimd.Client(sys.argv[1])\n"
             "    print('connected')\n"
             "except optimd.OptimdError as e:\n"
             "    print(type(e).__name__ + ': ' + str(e))\n", address],
            env={"PYTHONPATH": scratch, "HOME": scratch,
                 "PYTHONDONTWRITEBYTECODE": "1"},
            cwd=scratch, preexec_fn=drop, capture_output=True, text=True,
            timeout=120)
        return out.stdout + out.stderr


class TorchClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0

    def setUp(self):
        torch.manual_seed(SEED)
        self.x = torch.randn(256, 12)
        self.y = torch.sin(self.x.sum(1, keepdim=True))
        self.peaks = Peaks()

    def param_err(self, p, q):
        """scale_err of our parameter p against torch's q, over the largest
        magnitude q has had in this test (Peaks)."""
        return scale_err(p.detach(), q.detach(), self.peaks(q))

    def twin_models(self, seed=SEED):
        """Two MLPs with the same initial weights, from `seed`; the second's
        starting magnitudes are its first peaks."""
        torch.manual_seed(seed)
        ours = mlp()
        theirs = mlp()
        theirs.load_state_dict(ours.state_dict())
        for q in theirs.parameters():
            self.peaks(q)
        return ours, theirs

    def seeded_twins(self, seed=SEED):
        """Data and twin MLPs from `seed`, with optimd's AdamW on the first
        and torch's on the second: (ours, theirs, opt, ref)."""
        torch.manual_seed(seed)
        self.x = torch.randn(256, 12)
        self.y = torch.sin(self.x.sum(1, keepdim=True))
        ours, theirs = self.twin_models(seed=seed)
        opt = self.make(ours.parameters(), lr=3e-3, weight_decay=0.01)
        ref = torch.optim.AdamW(theirs.parameters(), lr=3e-3,
                                weight_decay=0.01)
        return ours, theirs, opt, ref

    def step_twins(self, opt, ref):
        """The same random gradient for each parameter of both optimizers'
        first group, then a step of each (torch's parameters' new
        magnitudes noted in their peaks)."""
        for p, q in zip(opt.param_groups[0]["params"],
                        ref.param_groups[0]["params"]):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for q in ref.param_groups[0]["params"]:
            self.peaks(q)

    def make(self, params, **kw):
        kw.setdefault("address", self.daemon.address)
        kw.setdefault("job_id", self.id())
        return AdamW(params, **kw)

    def test_values_written_into_bf16_parameters_are_stepped_from(self):
        # torch steps from what the trainer wrote into its parameters. A
        # bf16 parameter's fp32 master lives in the daemon; the client tells
        # it of the writes torch counts (a state-dict load, an in-place
        # edit) and of new memory (`p.data = t`), and the next step starts
        # from the written values. torch's fp32 AdamW over the same values
        # is the reference (the master's math), to bf16 rounding.
        torch.manual_seed(SEED)
        ours = torch.nn.Linear(12, 4).to(torch.bfloat16)
        theirs = torch.nn.Linear(12, 4)
        theirs.load_state_dict({k: v.float()
                                for k, v in ours.state_dict().items()})
        opt = self.make(ours.parameters(), lr=1e-2)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)

        def step():
            for p, q in zip(ours.parameters(), theirs.parameters()):
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
                q.grad = p.grad.float()
            opt.step()
            ref.step()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                torch.testing.assert_close(p.detach().float(), q.detach(),
                                           rtol=1e-2, atol=1e-2)

        step()
        step()
        ours.load_state_dict({k: torch.full_like(v, 5.0)
                              for k, v in ours.state_dict().items()})
        theirs.load_state_dict({k: torch.full_like(v, 5.0)
                                for k, v in theirs.state_dict().items()})
        # A state dict taken before the next step holds the written values
        # as masters.
        masters = [e["master"] for e in opt.state_dict()["state"].values()]
        self.assertEqual(len(masters), 2)
        for m in masters:
            self.assertTrue(torch.equal(m, torch.full_like(m, 5.0)))
        step()
        with torch.no_grad():
            ours.weight[0].fill_(-3.0)
            theirs.weight[0].fill_(-3.0)
        # The write rides with the step: no call of its own.
        calls = []
        update_buffers = opt._client.update_buffers
        opt._client.update_buffers = lambda *a, **k: (
            calls.append(a), update_buffers(*a, **k))[1]
        step()
        self.assertEqual(calls, [])
        opt._client.update_buffers = update_buffers
        ours.bias.data = torch.full((4,), 2.0, dtype=torch.bfloat16)
        theirs.bias.data = torch.full((4,), 2.0)
        step()
        opt.close()

    def test_pruned_weights_with_remainders_step_again(self):
        # store_param_remainders keeps the master as the bf16 parameter and
        # a 16-bit remainder, the same bits as an fp32 master: pruning
        # (writing zeros) must leave the two layouts alike. With a negative
        # remainder a written 0 once read as a NaN master and the weight
        # stayed 0 for good.
        results = []
        for extra in (dict(master_weights=True),
                      dict(store_param_remainders=True)):
            torch.manual_seed(SEED)
            p = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
            opt = self.make([p], lr=1e-3, **extra)
            grads = [torch.randn(1000).to(torch.bfloat16) for _ in range(6)]
            for g in grads[:3]:
                p.grad = g
                opt.step()
            with torch.no_grad():
                p.mul_((torch.arange(1000) % 2).to(torch.bfloat16))
            for g in grads[3:]:
                p.grad = g
                opt.step()
            master = opt.state_dict()["state"][0]["master"]
            self.assertFalse(master.isnan().any(), extra)
            self.assertEqual(int((p.detach()[0::2] == 0).sum()), 0, extra)
            results.append(p.detach().clone())
            opt.close()
        self.assertTrue(torch.equal(results[0], results[1]))

    def test_writes_across_a_failed_step_and_an_absent_gradient(self):
        # A write is told once however often it was seen (one left from a
        # refused step and one since: "updated twice" otherwise), and in
        # the same entry as its gradient's return. torch's fp32 AdamW over
        # the same values is the reference, to bf16 rounding.
        torch.manual_seed(SEED)
        ours = [torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
                for _ in range(2)]
        theirs = [torch.nn.Parameter(p.detach().float().clone())
                  for p in ours]
        opt = self.make(ours, lr=1e-2)
        ref = torch.optim.AdamW(theirs, lr=1e-2)

        def step(grads=(True, True)):
            for p, q, g in zip(ours, theirs, grads):
                p.grad = torch.randn(8).to(torch.bfloat16) if g else None
                q.grad = p.grad.float() if g else None
            opt.step()
            ref.step()
            for p, q in zip(ours, theirs):
                torch.testing.assert_close(p.detach().float(), q.detach(),
                                           rtol=1e-2, atol=1e-2)

        def write(value):
            with torch.no_grad():
                ours[0].fill_(value)
                theirs[0].fill_(value)

        step()
        write(3.0)
        opt.param_groups[0]["betas"] = (1.5, 0.999)  # refused
        with self.assertRaisesRegex(optimd.InvalidArgumentError, "beta1"):
            opt.step()
        opt.param_groups[0]["betas"] = (0.9, 0.999)
        write(4.0)
        step()
        step(grads=(False, True))
        write(5.0)
        step()
        opt.close()

    def test_values_written_into_a_mirrored_bf16_parameter_are_stepped_from(
            self):
        # A view with gaps (base[:, ::2]) is stepped in a dense copy that is
        # mirrored both ways around each step: a write into it is copied in
        # before the daemon is told. torch's fp32 AdamW is the reference.
        torch.manual_seed(SEED)
        base = torch.randn(6, 10).to(torch.bfloat16)
        ours = torch.nn.Parameter(base[:, ::2])
        theirs = torch.nn.Parameter(ours.detach().float().clone())
        opt = self.make([ours], lr=1e-2)
        ref = torch.optim.AdamW([theirs], lr=1e-2)
        told = record_written_tells(opt)

        def step():
            ours.grad = torch.randn(ours.shape).to(torch.bfloat16)
            theirs.grad = ours.grad.float()
            opt.step()
            ref.step()
            torch.testing.assert_close(ours.detach().float(), theirs.detach(),
                                       rtol=1e-2, atol=1e-2)

        step()
        step()
        opt.state_dict()  # copies the daemon's values back: no write
        self.assertEqual(told, [], "the mirror's own copies told as writes")
        with torch.no_grad():
            ours[:3].fill_(5.0)
            theirs[:3].fill_(5.0)
        step()
        base[:, 2].fill_(-4.0)  # through the base: the view's count moves
        with torch.no_grad():
            theirs[:, 1].fill_(-4.0)
        step()
        step()
        self.assertEqual(told, [1, 1])
        opt.close()

    def test_writes_into_a_local_shard_alias_are_stepped_from(self):
        # FSDP1 copies into a FlatParameter's `_local_shard`, a `.data`
        # alias whose write count is its own (torch 1.13's FSDP does not
        # import here, so the alias is made as FSDP1 makes it). Two halves
        # of one buffer, as a flat buffer's, are stepped where they are.
        flat = torch.randn(12, 4).to(torch.bfloat16)
        p, other = (torch.nn.Parameter(flat[:6]), torch.nn.Parameter(flat[6:]))
        p._local_shard = p.data
        opt = self.make([p, other], lr=1e-2)
        p.grad = torch.ones_like(p)
        opt.step()
        p._local_shard.fill_(5.0)
        master = opt.state_dict()["state"][0]["master"]
        self.assertTrue(torch.equal(master, torch.full_like(master, 5.0)))
        opt.step()
        self.assertLess((p.float() - 5.0).abs().max().item(), 0.1)
        opt.close()

    def train_step(self, model, opt):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(self.x), self.y)
        loss.backward()
        opt.step()
        return loss.item()

    def test_mlp_matches_torch_every_step(self):
        """Side by side from the run's seed. The torch twin takes the
        gradients of the model that optimd trains, so the comparison
        measures the optimizers alone: 1e-6 of each tensor's scale at every
        step, its scale being the largest magnitude it has had (Peaks; the
        output layer's one-element bias crosses zero with some seeds)."""
        ours, theirs, opt, ref = self.seeded_twins()
        first = last = None
        for step in range(100):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ours(self.x), self.y)
            loss.backward()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            ref.step()
            first = first if first is not None else loss.item()
            last = loss.item()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), 1e-6,
                                     "step %d" % step)
        # The comparison covered real training: the loss fell. By how much
        # depends on the seed's data and initial weights, not on the
        # optimizer (torch's own AdamW: 3x at least, 9x typically, over 400
        # seeds), so the bound is one every seed meets.
        self.assertLess(last, first / 2)
        opt.close()

    def test_overlap_stages_follow_the_group_order(self):
        # Each group's tensors spread over the stages by position: never
        # decreasing, the first at 0, the last at the last stage when the
        # group is large enough; on CPU parameters overlap changes nothing.
        from optimd import _overlap
        ours, theirs = self.twin_models()
        opt = self.make(ours.parameters(), overlap=True, job_id="a")
        plain = self.make(theirs.parameters(), job_id="b")
        stages = [s.stage for s in opt._groups[0]["tensors"]]
        self.assertEqual(stages, sorted(stages))
        self.assertEqual(stages[0], 0)
        self.assertLess(stages[-1], _overlap.STAGES)
        slots = []
        for n in [5, 0, 100, 1, 94]:
            slot = type("S", (), {})()
            slot.numel = n
            slots.append(slot)
        _overlap.assign_stages(slots)
        self.assertEqual([s.stage for s in slots],
                         [0, 0, 0, _overlap.STAGES // 2,
                          _overlap.STAGES // 2])
        for _ in range(3):
            self.train_step(ours, opt)
            self.train_step(theirs, plain)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertTrue(torch.equal(p, q))
        opt.close()
        plain.close()

    def test_mlp_trains_like_torch_independently(self):
        """Two independent training runs, optimd's and torch's: ulp-level
        differences of the two optimizers feed back through forward and
        backward, and the runs drift apart by however much the trajectory
        amplifies such differences, which depends on the seed.

        They must agree to 1e-4 of each tensor's largest magnitude so far
        (Peaks) after 100 steps, or, where the seed's trajectory amplifies
        rounding past that, to 10 times the drift of torch's own run from
        runs of torch's again, their weights moved one ulp up or down at
        random after every step, as rounding differences move them (the
        largest drift of three such runs: one alone may happen to drift
        little where the trajectory amplifies other perturbations more).
        (Over 43 seeds, torch's own drift went from 2e-6 to 8e-4 of a
        tensor's scale, and optimd's, past 1e-4 in four of them, stayed
        within 2.4 times torch's there.) The 1e-6 per step that the
        every-step test checks is what keeps optimd's drift this small."""
        ours, theirs, opt, ref = self.seeded_twins()
        noisy_runs = []
        for k in range(3):
            noisy = mlp()
            noisy.load_state_dict(theirs.state_dict())
            noisy_runs.append((noisy, torch.optim.AdamW(
                noisy.parameters(), lr=3e-3, weight_decay=0.01),
                torch.Generator().manual_seed(SEED + k)))

        def one_ulp_at_random(model, coin):
            with torch.no_grad():
                for p in model.parameters():
                    up = torch.rand(p.shape, generator=coin) < 0.5
                    p.copy_(torch.nextafter(p, (up.float() * 2 - 1) *
                                            math.inf))
        for _ in range(100):
            self.train_step(ours, opt)
            self.train_step(theirs, ref)
            for noisy, noisy_opt, coin in noisy_runs:
                self.train_step(noisy, noisy_opt)
                one_ulp_at_random(noisy, coin)
            for q in theirs.parameters():
                self.peaks(q)

        def drift(model):
            return max(self.param_err(p, q) for p, q in
                       zip(model.parameters(), theirs.parameters()))
        ours_drift = drift(ours)
        torch_drift = max(drift(noisy) for noisy, _, _ in noisy_runs)
        self.assertLessEqual(ours_drift, max(1e-4, 10 * torch_drift),
                             "torch's own drift: %.2e" % torch_drift)
        opt.close()

    def test_one_cycle_scheduler_changes_lr_and_betas(self):
        # Measured as the every-step comparison above: against each
        # tensor's largest magnitude so far (Peaks).
        ours, theirs = self.twin_models()
        opt = self.make(ours.parameters(), lr=1e-3)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2,
                                                      total_steps=40)
                  for o in (opt, ref)]
        for step in range(40):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ours(self.x), self.y).backward()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                q.grad = p.grad.clone()
            opt.step()
            ref.step()
            for s in scheds:
                s.step()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), 1e-6,
                                     "step %d" % step)
        self.assertNotEqual(opt.param_groups[0]["betas"][0], 0.9)
        opt.close()

    def test_step_with_closure(self):
        ours, theirs = self.twin_models()
        opt = self.make(ours.parameters(), lr=1e-2)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)

        def closure(model, o):
            def run():
                o.zero_grad()
                loss = torch.nn.functional.mse_loss(model(self.x), self.y)
                loss.backward()
                return loss
            return run
        for _ in range(5):
            a = opt.step(closure(ours, opt))
            b = ref.step(closure(theirs, ref))
            self.assertLessEqual(abs(a.item() - b.item()), 1e-5 * b.item())
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertLessEqual(self.param_err(p, q), 1e-5)
        opt.close()

    def test_optimizers_of_one_process_have_sessions_of_their_own(self):
        # A GAN's two optimizers, a notebook cell run twice, `del opt` and a
        # new one: default arguments, as with torch.
        gen, disc = mlp(), mlp()
        opts = [AdamW(m.parameters(), address=self.daemon.address)
                for m in (gen, disc)]
        for m, o in zip((gen, disc), opts):
            self.train_step(m, o)
        again = AdamW(gen.parameters(), address=self.daemon.address)
        self.train_step(gen, again)
        for o in opts + [again]:
            o.close()

    def test_session_closes_with_its_optimizer(self):
        # Counts only this test's own session: another test's optimizer
        # that the collector frees meanwhile must not change the answer.
        client = optimd.Client(self.daemon.address)
        model = mlp()
        opt = self.make(model.parameters())
        mine = self.id()

        def open_sessions():
            return [s for s in client.list_sessions().sessions
                    if s.job_id == mine]
        self.train_step(model, opt)
        self.assertEqual(len(open_sessions()), 1)
        del opt
        gc.collect()
        self.assertEqual(open_sessions(), [])
        client.close()

    def test_del_frees_the_optimizer_without_the_cyclic_collector(self):
        # As torch's: `del opt` frees it at once (its session, state and
        # shared memory with it), not at Python's next cyclic collection;
        # the state view, the state dict and the flat gradient segments it
        # used must not hold it in a cycle.
        client = optimd.Client(self.daemon.address)
        model = mlp()
        opt = self.make(model.parameters())
        mine = self.id()
        self.train_step(model, opt)
        opt.zero_grad(set_to_none=False)
        opt.state_dict()
        self.assertTrue(opt.state)
        gc.collect()
        gc.disable()
        try:
            gone = weakref.ref(opt)
            del opt
            self.assertIsNone(gone())
            self.assertEqual([s for s in client.list_sessions().sessions
                              if s.job_id == mine], [])
        finally:
            gc.enable()
            client.close()

    def test_a_misspelt_keyword_raises_as_in_torch(self):
        # Not a group key nobody reads: torch's own TypeError, word for
        # word.
        from optimd.torch import SGD, Adam, Lion
        p = torch.nn.Parameter(torch.randn(4))
        for ours, theirs, kw in ((AdamW, torch.optim.AdamW,
                                  {"weight_deacy": 0.1}),
                                 (Adam, torch.optim.Adam,
                                  {"state_dtype": torch.bfloat16}),
                                 (SGD, torch.optim.SGD, {"nesterv": True})):
            with self.assertRaises(TypeError) as want:
                theirs([p], lr=0.1, **kw)
            with self.assertRaises(TypeError) as got:
                ours([p], lr=0.1, address=self.daemon.address, **kw)
            self.assertEqual(str(got.exception), str(want.exception))
        with self.assertRaises(TypeError) as got:
            Lion([p], address=self.daemon.address, use_triton=True)
        self.assertIn("unexpected keyword argument 'use_triton'",
                      str(got.exception))

    def test_decoupled_decay_switched_on_in_param_groups_is_followed(self):
        # Adam's L2 decay for three steps, then AdamW's (a group edit, as
        # torch.optim.Adam's decoupled_weight_decay, torch 2.6 and later):
        # torch's Adam, then its AdamW from Adam's state, step by step.
        from optimd.torch import Adam
        ours, theirs = self.twin_models()
        opt = Adam(ours.parameters(), lr=1e-2, weight_decay=0.1,
                   address=self.daemon.address, job_id=self.id())
        ref = torch.optim.Adam(theirs.parameters(), lr=1e-2,
                               weight_decay=0.1)
        from optimd._daemon_optimizer import _torch_defaults
        key = ("decoupled_weight_decay" if "decoupled_weight_decay" in
               _torch_defaults(torch.optim.Adam) else "adam_w_mode")
        for step in range(6):
            if step == 3:
                opt.param_groups[0][key] = True
                switched = torch.optim.AdamW(theirs.parameters(), lr=1e-2,
                                             weight_decay=0.1)
                switched.load_state_dict(ref.state_dict())
                ref = switched
            for p, q in zip(ours.parameters(), theirs.parameters()):
                g = torch.randn(p.shape)
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), 1e-6,
                                     "step %d" % step)
        opt.close()

    def test_adam_w_mode_turned_off_after_torch_adamw_state_is_followed(self):
        # A group that loaded torch's AdamW state (whose groups say
        # decoupled_weight_decay=True from torch 2.7) is switched to Adam's
        # L2 decay with optimd's own adam_w_mode: Adam from then on, and
        # both switches say so.
        ours, theirs = self.twin_models()
        opt = self.make(ours.parameters(), lr=1e-2, weight_decay=0.1)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2,
                                weight_decay=0.1)
        for step in range(6):
            if step == 2:
                sd = ref.state_dict()
                sd["param_groups"][0]["decoupled_weight_decay"] = True
                opt.load_state_dict(sd)
            if step == 3:
                opt.param_groups[0]["adam_w_mode"] = False
                switched = torch.optim.Adam(theirs.parameters(), lr=1e-2,
                                            weight_decay=0.1)
                sd = ref.state_dict()
                sd["param_groups"][0]["decoupled_weight_decay"] = False
                switched.load_state_dict(sd)
                ref = switched
            self.step_twins(opt, ref)
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), 1e-6,
                                     "step %d" % step)
        self.assertFalse(opt.param_groups[0]["decoupled_weight_decay"])
        self.assertFalse(opt.param_groups[0]["adam_w_mode"])
        opt.close()

    def test_param_groups_carry_the_keys_torch_puts_there(self):
        from optimd.torch import SGD, Adam
        for ours_cls, theirs_cls in ((AdamW, torch.optim.AdamW),
                                     (Adam, torch.optim.Adam),
                                     (SGD, torch.optim.SGD)):
            opt = ours_cls(mlp().parameters(), lr=1e-3,
                           address=self.daemon.address,
                           job_id=self.id() + ours_cls.__name__)
            ref = theirs_cls(mlp().parameters(), lr=1e-3)
            theirs = {k: v for k, v in ref.param_groups[0].items()
                      if k != "params"}
            ours = {k: opt.param_groups[0][k] for k in theirs
                    if k in opt.param_groups[0]}
            self.assertEqual(ours, theirs, ours_cls.__name__)
            opt.close()

    def test_a_step_request_is_with_grpc_when_step_async_returns(self):
        # gRPC takes a stream's requests on a Python thread of its own: a
        # trainer that goes on with Python work right after step() must not
        # hold its step back from the daemon (optimd._step_stream). Each
        # request has left optimd's queue when step_async returns, and
        # every reply comes, in order.
        no_library = mock.patch("optimd._native_steps.load", lambda: None)
        no_library.start()
        self.addCleanup(no_library.stop)
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session(self.id())
        futures = []
        for _ in range(20):
            futures.append(client.step_async(assume_finite=True))
            self.assertTrue(client._stream._requests.empty())
        for f in futures:
            self.assertEqual(f.result(timeout=30).known, True)
        client.close_session()

    def test_a_step_sent_on_an_ended_stream_fails_at_once(self):
        # The daemon ends a session's step stream at its first failed step:
        # a request handed to that stream afterwards is never taken by
        # gRPC's thread, and its sender must not wait for it (the reader
        # thread fails it).
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session(self.id())
        refused = client.step_async(lr_overrides={"no-such-group": 0.1})
        self.assertIsInstance(refused.exception(timeout=30),
                              optimd.NotFoundError)
        ended = client._stream
        later = ended.send(client._step_request(assume_finite=True))
        self.assertIsInstance(later.exception(timeout=30),
                              optimd.OptimdError)
        self.assertTrue(ended.broken)
        # The client opens a new stream for the next step.
        self.assertTrue(client.step(assume_finite=True).known)
        client.close_session()

    def test_a_starting_daemon_removes_dead_trainers_segments(self):
        # A trainer and the daemon killed together leave the trainer's
        # shared-memory segments behind: the next daemon removes them (a
        # live trainer's stay).
        import secrets
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()  # its pid is gone now
        tag = secrets.token_hex(6)
        dead = "/dev/shm/optimd-py-%d-%s" % (child.pid, tag)
        live = "/dev/shm/optimd-py-%d-%s" % (os.getpid(), tag)
        for path in (dead, live):
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
        try:
            with Daemon():
                self.assertFalse(os.path.exists(dead))
                self.assertTrue(os.path.exists(live))
        finally:
            for path in (dead, live):
                if os.path.exists(path):
                    os.unlink(path)

    def test_killed_trainer_leaves_an_orphan_then_nothing(self):
        # A trainer killed mid-training (no close): its session is shown
        # orphaned, kept for the daemon's grace for a resume, then freed.
        # The grace leaves a slow machine seconds to see the orphan.
        with Daemon(flags=["--orphan_grace_s=6"]) as d:
            trainer = subprocess.Popen([sys.executable, "-c", (
                "import os, signal, torch\n"
                "from optimd.torch import AdamW\n"
                "p = torch.nn.Parameter(torch.randn(10))\n"
                "opt = AdamW([p], address=%r, job_id='killed')\n"
                "p.grad = torch.randn(10)\n"
                "opt.step()\n"
                "os.kill(os.getpid(), signal.SIGKILL)\n") % d.address])
            self.assertEqual(trainer.wait(60), -signal.SIGKILL)
            client = optimd.Client(d.address)

            def sessions():
                return {s.job_id: s for s in client.list_sessions().sessions}
            deadline = time.time() + 30
            while not sessions()["killed"].orphaned_since:
                self.assertLess(time.time(), deadline, "never orphaned")
                time.sleep(0.1)
            while "killed" in sessions():
                self.assertLess(time.time(), deadline, "never freed")
                time.sleep(0.1)
            # Its shared-memory segments went with it (the trainer could
            # not remove them).
            left = [f for f in os.listdir("/dev/shm")
                    if f.startswith("optimd-py-%d-" % trainer.pid)]
            self.assertEqual(left, [])
            # An operator may evict any session at once.
            p = torch.nn.Parameter(torch.randn(3))
            opt = AdamW([p], address=d.address, job_id="evicted")
            client.evict_session("evicted", 0)
            self.assertNotIn("evicted", sessions())
            with self.assertRaises(optimd.OptimdError):
                client.evict_session("evicted", 0)
            client.close()

    def test_trainer_killed_mid_step_again_and_again(self):
        # A trainer stepping as fast as it can is SIGKILLed at a random
        # moment, six times; each new one resumes (its secret from the
        # file the last one left) and goes on. The daemon stays up and the
        # session's weights are always exactly those of its step count:
        # no step is half applied, none applied twice.
        script = (
            "import sys, torch\n"
            "from optimd.torch import AdamW\n"
            "p = torch.nn.Parameter(torch.zeros(1000))\n"
            "opt = AdamW([p], lr=1e-2, address=sys.argv[1], job_id='phoenix',"
            " master_weights=True, resume='if_any')\n"
            "k = int(opt.state[p]['step']) if p in opt.state else 0\n"
            "print(k, flush=True)\n"
            "while True:\n"
            "    g = torch.Generator().manual_seed(k + 1)\n"
            "    p.grad = torch.randn(1000, generator=g)\n"
            "    opt.step()\n"
            "    k += 1\n")
        rng = random.Random(SEED)
        seen = []
        for _ in range(6):
            trainer = subprocess.Popen(
                [sys.executable, "-c", script, self.daemon.address],
                stdout=subprocess.PIPE, text=True)
            seen.append(int(trainer.stdout.readline()))
            time.sleep(rng.uniform(0.02, 0.2))
            trainer.send_signal(signal.SIGKILL)
            self.assertEqual(trainer.wait(60), -signal.SIGKILL)
            trainer.stdout.close()
        self.assertEqual(seen, sorted(seen))  # never back in time
        p = torch.nn.Parameter(torch.zeros(1000))
        opt = self.make([p], lr=1e-2, job_id="phoenix", master_weights=True,
                        resume=True)
        k = int(opt.state[p]["step"])
        self.assertGreaterEqual(k, seen[-1])
        self.assertGreater(k, 0)
        ref = torch.nn.Parameter(torch.zeros(1000))
        ref_opt = self.make([ref], lr=1e-2, job_id="phoenix-ref",
                            master_weights=True)
        for i in range(1, k + 1):
            ref.grad = torch.randn(1000,
                                   generator=torch.Generator().manual_seed(i))
            ref_opt.step()
        self.assertTrue(torch.equal(p.detach(), ref.detach()),
                        "after %d steps" % k)
        opt.close()
        ref_opt.close()

    def test_versions_are_reported_and_checked(self):
        binary = optimd.testing.find_binary()
        out = subprocess.run([binary, "--version"], capture_output=True,
                             text=True, timeout=30)
        self.assertIn("optimd %s (API revision %d)" %
                      (optimd.__version__, optimd.API_REVISION),
                      out.stdout + out.stderr)
        out = subprocess.run([binary, "--help"], capture_output=True,
                             text=True, timeout=30)
        for flag in ("--listen", "--save_dir", "--orphan_grace_s"):
            self.assertIn(flag, out.stdout + out.stderr)
        client = optimd.Client(self.daemon.address)
        m = client.get_metrics()
        self.assertEqual(m.daemon_version, optimd.__version__)
        self.assertEqual(m.api_revision, optimd.API_REVISION)
        # A client that needs a later revision refuses this daemon, naming
        # both versions, and leaves no session behind.
        before = session_keys(client)
        import optimd.client as client_module
        client_module.API_REVISION += 1
        try:
            with self.assertRaises(optimd.IncompatibleDaemonError) as cm:
                optimd.Client(self.daemon.address).create_session("new")
        finally:
            client_module.API_REVISION -= 1
        self.assertIn("API revision %d" % optimd.API_REVISION,
                      str(cm.exception))
        self.assertIn("upgrade the daemon", str(cm.exception))
        self.assertEqual(session_keys(client) - before, set())
        # A call the daemon does not implement (an RPC of a later revision,
        # here one no daemon has): from a daemon older than the client
        # needs, IncompatibleDaemonError naming both versions, not a bare
        # UNIMPLEMENTED; from a current daemon, gRPC's own error.
        from optimd.v1 import optimd_pb2 as pb
        client._stub.FutureCall = client._channel.unary_unary(
            "/optimd.v1.Optimizer/FutureCall",
            request_serializer=pb.GetMetricsRequest.SerializeToString,
            response_deserializer=pb.GetMetricsResponse.FromString)
        request = pb.GetMetricsRequest()
        client_module.API_REVISION += 1
        try:
            with self.assertRaises(optimd.IncompatibleDaemonError) as cm:
                client._call("FutureCall", request)
        finally:
            client_module.API_REVISION -= 1
        self.assertIn("(API revision %d) and does not implement FutureCall; "
                      "this client, optimd %s, needs API revision %d" %
                      (optimd.API_REVISION, optimd.__version__,
                       optimd.API_REVISION + 1), str(cm.exception))
        with self.assertRaises(optimd.OptimdError) as cm:
            client._call("FutureCall", request)
        self.assertNotIsInstance(cm.exception, optimd.IncompatibleDaemonError)
        client.close()

    def test_log_lines_say_when_what_and_which_session(self):
        with tempfile.TemporaryFile(mode="w+") as log:
            with Daemon(stderr=log) as d:
                p = torch.nn.Parameter(torch.randn(4))
                opt = AdamW([p], address=d.address, job_id="logged")
                p.grad = torch.randn(4)
                opt.step()
                with tempfile.TemporaryDirectory() as ckpt:
                    opt.save_checkpoint(ckpt)
                opt.close()
            log.seek(0)
            lines = log.read().splitlines()
        stamp = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d " \
                r"(info|warning) optimd: "
        for event in ("session created: job 'logged' rank 0",
                      "checkpoint saved: job 'logged' rank 0",
                      "session closed: job 'logged' rank 0", "stopped"):
            matching = [l for l in lines if event in l]
            self.assertEqual(len(matching), 1, (event, lines))
            self.assertRegex(matching[0], stamp)

    def test_failed_constructor_leaves_no_session(self):
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        good = torch.nn.Parameter(torch.randn(4))
        bad = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        with self.assertRaises(TypeError):
            AdamW([{"params": [good]}, {"params": [bad]}],
                  address=self.daemon.address)
        self.assertEqual(session_keys(client) - before, set())
        client.close()

    def test_changed_dtype_or_duplicate_parameter_is_a_clear_error(self):
        model = mlp()
        opt = self.make(model.parameters())
        self.train_step(model, opt)
        with warnings.catch_warnings():  # torch: complex modules are new
            warnings.simplefilter("ignore")
            model.to(torch.complex64)  # a dtype the daemon does not step
        with self.assertRaisesRegex(TypeError, "complex64"):
            opt.step()
        opt.close()
        p = torch.nn.Parameter(torch.randn(3))
        with self.assertRaisesRegex(ValueError, "twice"):
            self.make([p, p], job_id="twice")

    def test_parameters_on_an_unsupported_device_raise_clearly(self):
        # Parameters on several CPU and CUDA devices are taken (one part
        # per device: test_several_devices.py); others raise ValueError
        # naming the device: at construction (leaving no session) and at
        # add_param_group (leaving param_groups as they were).
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        w = torch.nn.Parameter(torch.randn(3))
        b = torch.nn.Parameter(torch.randn(2, device="meta"))
        with self.assertRaisesRegex(ValueError, "CPU and CUDA parameters, "
                                    "not meta"):
            self.make([("w", w), ("b", b)], job_id="two-devices")
        self.assertEqual(session_keys(client) - before, set())
        client.close()
        model = mlp()
        opt = self.make(model.parameters(), job_id="add-other-device")
        with self.assertRaisesRegex(ValueError, "not meta"):
            opt.add_param_group({"params": [b]})
        self.assertEqual(len(opt.param_groups), 1)
        # Any group the daemon refuses leaves param_groups as they were.
        with self.assertRaisesRegex(TypeError, "complex64"):
            opt.add_param_group({"params": [torch.nn.Parameter(
                torch.randn(2, dtype=torch.complex64))]})
        self.assertEqual(len(opt.param_groups), 1)
        first = next(model.parameters())
        before_step = first.detach().clone()
        self.train_step(model, opt)  # still steps its own group
        self.assertFalse(torch.equal(first.detach(), before_step))
        opt.close()

    def steps_around_double(self, ours, theirs, opt, ref):
        """Two steps of both twins, model.double() on both (torch's state
        cast by its own load_state_dict), three float64 steps; then each
        parameter is float64 and agrees with torch's to 1e-6 (the fp32
        steps before the conversion)."""
        for _ in range(2):
            self.step_twins(opt, ref)
        ours.double()
        theirs.double()
        ref.load_state_dict(ref.state_dict())  # torch's cast to float64
        for _ in range(3):
            for p, q in zip(opt.param_groups[0]["params"],
                            ref.param_groups[0]["params"]):
                g = torch.randn(p.shape, dtype=torch.float64)
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertEqual(p.dtype, torch.float64)
            self.assertLessEqual(self.param_err(p, q), 1e-6)

    def test_model_converted_to_float64_is_followed(self):
        # model.double() after construction and steps: the parameters are
        # registered anew in float64 (float64 moments, no master) and the
        # state carried over, cast to float64 as torch's load_state_dict
        # casts it; from then on every step is a float64 step.
        ours, theirs, opt, ref = self.seeded_twins()
        self.steps_around_double(ours, theirs, opt, ref)
        for p in ours.parameters():
            state = opt.state[p]
            self.assertEqual(float(state["step"]), 5)
            self.assertEqual(state["exp_avg"].dtype, torch.float64)
            self.assertNotIn("master", state)
        opt.close()

    def test_sgd_and_lion_follow_a_model_converted_to_float64(self):
        # As AdamW does: after model.double() the parameters are registered
        # anew in float64 and the state carried over, cast to float64; from
        # then on every step is a float64 step. SGD against torch's, with
        # its state cast by load_state_dict as above.
        seed = 20261201
        ours, theirs = self.twin_models(seed=seed)
        opt = optimd.torch.SGD(ours.parameters(), lr=0.05, momentum=0.9,
                               address=self.daemon.address,
                               job_id=self.id() + "-sgd")
        ref = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
        self.steps_around_double(ours, theirs, opt, ref)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            buf = opt.state[p]["momentum_buffer"]
            self.assertEqual(buf.dtype, torch.float64)
            self.assertLessEqual(
                scale_err(buf, ref.state[q]["momentum_buffer"]), 1e-6)
        opt.close()
        # Lion: the first float64 step updates the carried-over momentum
        # in double, exactly m * beta2 + (1 - beta2) * g.
        model = mlp()
        lion = optimd.torch.Lion(model.parameters(), lr=1e-3,
                                 weight_decay=0.1,
                                 address=self.daemon.address,
                                 job_id=self.id() + "-lion")
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.randn(p.shape)
            lion.step()
        kept = [lion.state[p]["exp_avg"].double() for p in model.parameters()]
        model.double()
        grads = [torch.randn(p.shape, dtype=torch.float64)
                 for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        lion.step()
        for p, m, g in zip(model.parameters(), kept, grads):
            self.assertEqual(p.dtype, torch.float64)
            m_now = lion.state[p]["exp_avg"]
            self.assertEqual(m_now.dtype, torch.float64)
            self.assertTrue(torch.equal(m_now, m * 0.99 + (1 - 0.99) * g))
        lion.close()

    def test_model_converted_to_bf16_is_followed(self):
        # model.bfloat16() after construction and steps: the optimizer
        # registers the parameters anew in bf16 (with fp32 masters, its
        # default for low precision) and keeps the moments and step counts.
        model = mlp()
        opt = self.make(model.parameters(), job_id="to-bf16")
        for _ in range(2):
            self.train_step(model, opt)
        before = {name: float(opt.state[p]["step"])
                  for name, p in model.named_parameters()}
        model.bfloat16()
        opt.zero_grad()
        (model(self.x.bfloat16()).float() - self.y).square().mean().backward()
        opt.step()
        for name, p in model.named_parameters():
            self.assertEqual(p.dtype, torch.bfloat16)
            self.assertEqual(float(opt.state[p]["step"]), before[name] + 1)
            self.assertIn("master", opt.state[p])
        opt.close()

    def test_writes_to_optimizer_state_act_as_in_torch(self):
        _, _, opt, ref = self.seeded_twins()
        ours = opt.param_groups[0]["params"]
        theirs = ref.param_groups[0]["params"]

        def same():
            for p, q in zip(ours, theirs):
                self.assertLessEqual(self.param_err(p, q), 1e-6)
            # The moments of a slot just restarted come from one gradient,
            # which the weights' last-bit differences move by up to about
            # 1e-4 of the slot's largest element (seed 1053755779: 5.5e-5);
            # a write not acting as in torch moves them by order 1.
            for p, q in zip(ours, theirs):
                for k, v in ref.state[q].items():
                    self.assertLessEqual(
                        scale_err(opt.state[p][k].float(), v.float()), 1e-4,
                        k)
        for _ in range(3):
            self.step_twins(opt, ref)
        # An entry zeroed in place, one replaced, one removed.
        for o, ps in ((opt, ours), (ref, theirs)):
            o.state[ps[0]]["exp_avg"].zero_()
            o.state[ps[1]]["exp_avg_sq"] = torch.ones_like(ps[1])
            del o.state[ps[2]]
        self.step_twins(opt, ref)
        same()
        # The whole state cleared: every parameter starts afresh.
        opt.state.clear()
        ref.state.clear()
        self.step_twins(opt, ref)
        same()
        self.assertEqual(float(opt.state[ours[0]]["step"]), 1.0)
        opt.close()

    def test_held_state_tensors_stay_live_as_in_torch(self):
        # A tensor taken from optimizer.state and held across steps is the
        # state itself in torch: steps update it in place and writes into
        # it are the state. The same here, side by side.
        _, _, opt, ref = self.seeded_twins()
        ours = opt.param_groups[0]["params"]
        theirs = ref.param_groups[0]["params"]

        def same_weights():
            for p, q in zip(ours, theirs):
                self.assertLessEqual(self.param_err(p, q), 1e-6)
        self.step_twins(opt, ref)
        held = [o.state[ps[0]]["exp_avg"] for o, ps in
                ((opt, ours), (ref, theirs))]
        entries = [o.state[ps[1]] for o, ps in ((opt, ours), (ref, theirs))]
        for _ in range(2):
            self.step_twins(opt, ref)
        self.assertIs(opt.state[ours[0]]["exp_avg"], held[0])
        self.assertIs(opt.state[ours[1]], entries[0])
        self.assertLessEqual(scale_err(held[0], held[1]), 1e-5)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            self.assertLessEqual(
                scale_err(entries[0][k].float(), entries[1][k].float()),
                1e-5, k)
        # Writes into the held tensors, without reading optimizer.state
        # again: zeroed, then (after a step) scaled.
        for t in held:
            t.zero_()
        self.step_twins(opt, ref)
        same_weights()
        for e in entries:
            e["exp_avg_sq"].mul_(0.5)
        self.step_twins(opt, ref)
        same_weights()
        self.assertLessEqual(scale_err(held[0], held[1]), 1e-5)
        opt.close()

    def test_lazy_parameters_as_in_torch(self):
        # Both optimizers are built before the first forward materializes
        # the lazy layer's parameters; both then train them.
        def build():
            return torch.nn.Sequential(torch.nn.LazyLinear(8),
                                       torch.nn.Tanh(), torch.nn.Linear(8, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lazy modules are new"
            ours, theirs = build(), build()
        opt = self.make(ours.parameters(), lr=1e-2)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
        lazy = next(ours.parameters())
        self.assertEqual(dict(opt.state[lazy]), {})
        for model in (ours, theirs):
            model(self.x[:1])
        theirs.load_state_dict(ours.state_dict())
        # Measured against each tensor's largest magnitude so far (Peaks):
        # a one-element bias that crosses zero would make ulp-level
        # differences look large against its value of the moment.
        for q in theirs.parameters():
            self.peaks(q)
        for _ in range(4):
            self.train_step(ours, opt)
            self.train_step(theirs, ref)
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        steps = [float(o.state[p]["step"]) for o, m in ((opt, ours),
                                                         (ref, theirs))
                 for p in m.parameters()]
        self.assertEqual(steps, [4.0] * 8)
        opt.close()
        # Resumed as torch users do, before the first forward: the model's
        # load_state_dict materializes the lazy layer, then the optimizer's
        # loads torch's state dict; both go on alike.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = build()
        opt = self.make(again.parameters(), lr=1e-2, job_id="resumed")
        again.load_state_dict(theirs.state_dict())
        opt.load_state_dict(ref.state_dict())
        for _ in range(2):
            self.train_step(again, opt)
            self.train_step(theirs, ref)
        for p, q in zip(again.parameters(), theirs.parameters()):
            self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        self.assertEqual(float(opt.state[next(again.parameters())]["step"]),
                         6.0)
        opt.close()

    def test_edited_param_groups_and_unfrozen_parameters(self):
        _, _, opt, ref = self.seeded_twins()
        ours = opt.param_groups[0]["params"]
        theirs = ref.param_groups[0]["params"]
        extra = [torch.nn.Parameter(torch.randn(5)) for _ in range(2)]
        extra[1].requires_grad_(False)  # frozen when added
        twins = [torch.nn.Parameter(e.detach().clone()) for e in extra]
        twins[1].requires_grad_(False)

        def step_both():
            for p, q in zip(opt.param_groups[0]["params"],
                            ref.param_groups[0]["params"]):
                if p.requires_grad:
                    g = torch.randn(p.shape)
                    p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            for p, q in zip(opt.param_groups[0]["params"],
                            ref.param_groups[0]["params"]):
                self.assertLessEqual(self.param_err(p, q), 1e-6)
        step_both()
        # Appended to a live group, as some trainers grow a model.
        for o, ps in ((opt, extra), (ref, twins)):
            o.param_groups[0]["params"].extend(ps)
        for _ in range(2):
            step_both()
        # The frozen one is unfrozen, then the first parameter removed.
        extra[1].requires_grad_(True)
        twins[1].requires_grad_(True)
        for _ in range(2):
            step_both()
        self.assertEqual(float(opt.state[extra[1]]["step"]), 2.0)
        removed = ours[0]  # `ours` is the group's own list
        removed_twin = theirs[0]
        for o in (opt, ref):
            del o.param_groups[0]["params"][0]
        step_both()
        # Its state stays, as in torch, and comes back with it.
        self.assertEqual(removed in opt.state, removed_twin in ref.state)
        self.assertEqual(float(opt.state[removed]["step"]),
                         float(ref.state[removed_twin]["step"]))
        opt.param_groups[0]["params"].append(removed)
        ref.param_groups[0]["params"].append(removed_twin)
        for _ in range(2):
            step_both()
        self.assertEqual(float(opt.state[removed]["step"]),
                         float(ref.state[removed_twin]["step"]))
        opt.close()

    def test_channels_last_checkpoints_keep_the_memory_order(self):
        # The bytes of a channels_last weight are stored under its memory-
        # order shape (N, H, W, C), never under the logical shape they do
        # not have; given the parameters, to_torch_state_dict gives torch's
        # layout back.
        from optimd.checkpoint import read_checkpoint, to_torch_state_dict
        torch.manual_seed(3)
        conv = torch.nn.Conv2d(3, 8, (3, 5)).to(
            memory_format=torch.channels_last)
        named = dict(conv.named_parameters())
        opt = self.make(list(named.items()), lr=1e-2)
        x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
        for _ in range(3):
            opt.zero_grad()
            conv(x).square().mean().backward()
            opt.step()
        scratch = tempfile.mkdtemp(prefix="optimd-cl-")
        path = opt.save_checkpoint(scratch).path
        w = named["weight"]
        stored = read_checkpoint(path)[1]["weight"]
        self.assertEqual(tuple(stored.shape), (8, 3, 5, 3))
        self.assertTrue(torch.equal(stored,
                                    w.detach().permute(0, 2, 3, 1)))
        state, params, _ = to_torch_state_dict(path, params=named)
        self.assertTrue(torch.equal(params["weight"], w.detach()))
        self.assertEqual(params["weight"].stride(), w.stride())
        ours = opt.state[w]["exp_avg"]
        index = list(named).index("weight")
        self.assertTrue(torch.equal(state["state"][index]["exp_avg"], ours))
        opt.close()

    def test_channels_last_parameters_keep_their_layout(self):
        torch.manual_seed(7)
        convs = [torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
                 for _ in range(2)]
        convs[1].load_state_dict(convs[0].state_dict())
        opt = self.make(convs[0].parameters(), lr=1e-2)
        ref = torch.optim.AdamW(convs[1].parameters(), lr=1e-2)
        w = convs[0].weight
        self.assertTrue(w.is_contiguous(memory_format=torch.channels_last))
        x = torch.randn(4, 3, 10, 10).to(memory_format=torch.channels_last)
        for _ in range(4):
            for c, o in zip(convs, (opt, ref)):
                o.zero_grad()
                c(x).square().mean().backward()
                o.step()
            for p, q in zip(convs[0].parameters(), convs[1].parameters()):
                self.assertEqual(p.stride(), q.stride())
                self.assertLessEqual(self.param_err(p, q), 1e-6)
        for p, q in zip(convs[0].parameters(), convs[1].parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertLessEqual(
                    scale_err(opt.state[p][k], ref.state[q][k]), 1e-5, k)
        # State written back in torch's layout lands where it belongs.
        state = ref.state_dict()
        opt.load_state_dict(state)
        for p, q in zip(convs[0].parameters(), convs[1].parameters()):
            self.assertLessEqual(
                scale_err(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]),
                1e-6)
        opt.close()

    def test_parameter_whose_elements_share_memory_is_a_clear_error(self):
        # An expanded tensor: torch's in-place step raises RuntimeError on
        # it; optimd raises one (also a ValueError) when registering it,
        # naming it, and leaves nothing in the daemon. (Views with gaps
        # are stepped: test_dropin.)
        def expanded():
            return torch.nn.Parameter(torch.randn(4, 1).expand(4, 3))
        theirs = expanded()
        theirs.grad = torch.randn(4, 3)
        with self.assertRaises(RuntimeError):
            torch.optim.AdamW([theirs]).step()
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        good = torch.nn.Parameter(torch.randn(3))
        with self.assertRaises(RuntimeError) as cm:
            self.make([("good", good), ("encoder.repeated", expanded())])
        self.assertIsInstance(cm.exception, ValueError)
        self.assertIn("encoder.repeated", str(cm.exception))
        self.assertEqual(session_keys(client) - before, set())
        client.close()
        # Appended to a live group: refused at the next step, and the
        # optimizer goes on once it is taken out again.
        opt = self.make([good])
        opt.param_groups[0]["params"].append(expanded())
        good.grad = torch.randn(3)
        with self.assertRaisesRegex(RuntimeError, "share memory"):
            opt.step()
        opt.param_groups[0]["params"].pop()
        opt.step()
        self.assertEqual(float(opt.state[good]["step"]), 1.0)
        opt.close()

    def test_zero_grad_by_default_does_what_the_installed_torchs_does(self):
        # torch 2 sets gradients to None (a parameter without one is not
        # stepped), torch 1.x zeroes them (it is stepped with a zero
        # gradient: decay and momentum move it): the same numbers either way.
        torch.manual_seed(3)
        ours = torch.nn.ModuleList([torch.nn.Linear(6, 1) for _ in range(2)])
        theirs = torch.nn.ModuleList([torch.nn.Linear(6, 1) for _ in range(2)])
        theirs.load_state_dict(ours.state_dict())
        opt = self.make(ours.parameters(), lr=0.01, weight_decay=0.1)
        ref = torch.optim.AdamW(theirs.parameters(), lr=0.01,
                                weight_decay=0.1)
        for i in range(6):
            for m, o in ((ours, opt), (theirs, ref)):
                o.zero_grad()
                out = m[0](self.x[:, :6]) + (m[1](self.x[:, :6]) if i % 2 == 0
                                             else 0)
                torch.nn.functional.mse_loss(out, self.y).backward()
            self.assertEqual([p.grad is None for p in ours.parameters()],
                             [q.grad is None for q in theirs.parameters()])
            opt.step()
            ref.step()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertLessEqual(self.param_err(p, q), 1e-6)
        opt.close()

    def test_a_gradient_set_on_a_frozen_parameter_is_stepped(self):
        # torch steps every parameter whose .grad is set, whether or not it
        # requires grad (a gradient written by hand).
        from optimd.torch import SGD
        torch.manual_seed(4)
        w = torch.nn.Parameter(torch.randn(5))
        v = torch.nn.Parameter(torch.randn(5))
        w2, v2 = (torch.nn.Parameter(t.detach().clone()) for t in (w, v))
        w.requires_grad_(False)
        w2.requires_grad_(False)
        opt = SGD([w, v], lr=0.1, momentum=0.9, address=self.daemon.address,
                  job_id=self.id())
        ref = torch.optim.SGD([w2, v2], lr=0.1, momentum=0.9)
        for _ in range(3):
            for (a, b), o in (((w, v), opt), ((w2, v2), ref)):
                o.zero_grad()
                (b * b).sum().backward()
                a.grad = torch.full_like(a, 0.5)
                o.step()
        self.assertLessEqual(self.param_err(w, w2), 1e-6)
        self.assertLessEqual(self.param_err(v, v2), 1e-6)
        opt.close()

    def test_load_state_dict_replaces_each_group_as_torch_does(self):
        # A key the saved group lacks goes (a scheduler's initial_lr, a
        # user's own key); the constructor's options keep their values.
        model = mlp()
        opt = self.make(model.parameters(), lr=1e-3)
        ref = torch.optim.AdamW(mlp().parameters(), lr=1e-3)
        for o in (opt, ref):
            saved = o.state_dict()
            torch.optim.lr_scheduler.StepLR(o, 2)
            o.param_groups[0]["mine"] = 1
            o.load_state_dict(saved)
        self.assertNotIn("initial_lr", ref.param_groups[0])
        self.assertNotIn("initial_lr", opt.param_groups[0])
        self.assertNotIn("mine", opt.param_groups[0])
        for k, v in ref.param_groups[0].items():
            if k != "params":
                self.assertEqual(opt.param_groups[0][k], v, k)
        self.train_step(model, opt)
        opt.close()

    def test_implementation_switches_as_torch_takes_them(self):
        # foreach and fused choose among torch's implementations of the
        # same math: taken. capturable and differentiable promise what a
        # step in the daemon cannot do: refused, naming the option.
        model = mlp()
        opt = self.make(model.parameters(), foreach=True)
        self.train_step(model, opt)
        opt.close()
        for k in ("capturable", "differentiable"):
            if k not in torch.optim.AdamW.__init__.__code__.co_varnames:
                continue
            with self.assertRaisesRegex(ValueError, k):
                self.make(mlp().parameters(), **{k: True})
        # A switch the installed torch's class does not take is its
        # TypeError (SGD's fused and capturable on torch 1.13).
        from optimd.torch import SGD
        for k in ("fused", "capturable", "differentiable", "foreach"):
            try:
                torch.optim.SGD(mlp().parameters(), lr=0.1, **{k: False})
            except TypeError:
                with self.assertRaisesRegex(TypeError, k):
                    SGD(mlp().parameters(), lr=0.1, **{k: False},
                        address=self.daemon.address, job_id=self.id())
                continue
            SGD(mlp().parameters(), lr=0.1, **{k: False},
                address=self.daemon.address, job_id=self.id()).close()

    def test_sgd_without_lr_as_the_installed_torch(self):
        # torch 2.2 and later default lr to 1e-3; before, a group without
        # lr raises ValueError.
        from optimd.torch import SGD
        model = mlp()
        try:
            ref = torch.optim.SGD(mlp().parameters())
        except ValueError as e:
            with self.assertRaisesRegex(ValueError, "required optimization "
                                                    "parameter lr"):
                SGD(model.parameters(), address=self.daemon.address,
                    job_id=self.id())
            self.assertIn("lr", str(e))
            return
        opt = SGD(model.parameters(), address=self.daemon.address,
                  job_id=self.id())
        self.assertEqual(opt.param_groups[0]["lr"], ref.param_groups[0]["lr"])
        self.train_step(model, opt)
        opt.close()

    def fsdp1_run(self, make):
        """Five clipped steps of _Fsdp1Linear through the optimizer `make`
        builds over its flat parameter; the values FSDP's own buffer holds
        at the end (what its next all-gather would read)."""
        torch.manual_seed(3)
        model = _Fsdp1Linear()
        opt = make([model.flat])
        # Stepped where FSDP keeps it, not moved off its buffer (which
        # FSDP1 with NO_SHARD would go on reading as the shard).
        self.assertEqual(model.flat.data_ptr(), model.local_shard.data_ptr())
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(self.x[:, :4]),
                                         self.y[:, :1].expand(-1, 3)
                                         ).backward()
            opt.step()
        return model.local_shard.clone(), opt

    def test_fsdp1_flat_parameters_are_stepped_in_fsdps_buffer(self):
        # FSDP version 1 keeps a parameter's values in a flat buffer of
        # its own (the local shard), points the FlatParameter at a gathered
        # copy for forward and backward and back at the shard after: the
        # daemon must step the shard where it is (torch 1.13 cannot tell
        # it is shared, so FSDP's mark is what says so).
        ref, _ = self.fsdp1_run(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
        ours, opt = self.fsdp1_run(lambda ps: self.make(
            ps, lr=1e-2, weight_decay=0.1))
        torch.manual_seed(3)
        init = _Fsdp1Linear().local_shard
        self.assertGreater((ref - init).abs().min().item(), 0.0)
        self.assertLess(scale_err(ours, ref), 1e-5)
        opt.close()

    def test_fsdp1_taking_a_parameter_over_after_construction(self):
        # FSDP1 with use_orig_params=True wrapped after the optimizer was
        # made: the parameter becomes a view of FSDP's flat buffer, marked,
        # and is stepped there from then on, as torch steps it.
        def run(make):
            torch.manual_seed(5)
            p = torch.nn.Parameter(torch.randn(8))
            opt = make([p])
            flat = torch.zeros(16)
            flat[4:12] = p.detach()
            p.data = flat[4:12]  # FSDP1's view of its flat buffer
            p._fsdp_flattened = True
            for i in range(3):
                p.grad = torch.full((8,), 0.5 - i)
                opt.step()
            return flat, opt
        ref, _ = run(lambda ps: torch.optim.AdamW(ps, lr=0.1))
        ours, opt = run(lambda ps: self.make(ps, lr=0.1))
        self.assertLess(scale_err(ours, ref), 1e-6)
        self.assertEqual(ours[:4].abs().sum().item(), 0.0)
        opt.close()

    def test_fsdp1_refuses_shard_state_overlap_and_a_later_sharding(self):
        # shard_state would write one rank's part over the other ranks'
        # different shards, overlap's hooks cannot hold FSDP1's own
        # all-gathers back: both refused, naming the parameter. An
        # optimizer made before FSDP1 sharded a parameter over the ranks
        # (a 1-D part of the rank's shard now) says to make it after.
        flat = torch.nn.Parameter(torch.randn(8))
        flat._fsdp_flattened = True
        for options in (dict(shard_state=True, rank=0, world_size=2),
                        dict(overlap=True)):
            with self.subTest(options=sorted(options)):
                with self.assertRaisesRegex(
                        NotImplementedError,
                        "=True does not take FSDP version 1 parameters "
                        r"\(parameter layer.weight\)"):
                    self.make([("layer.weight", flat)], **options)
        p = torch.nn.Parameter(torch.randn(3, 4))
        opt = self.make([("layer.weight", p)])
        shard = torch.zeros(16)
        p.data = shard[2:8]  # FULL_SHARD's part of it on this rank
        p._fsdp_flattened = True
        p.grad = torch.ones(6)
        with self.assertRaisesRegex(TypeError, "layer.weight is now \\(6,\\)"
                                    ".*Make the optimizer after wrapping"):
            opt.step()
        opt.close()

    def test_fsdp1_over_ranks_clipping_needs_gradient_sharding(self):
        # A rank of FSDP1 holds a shard of each gradient or all of it, and
        # the parameters do not say which: clipping by the job's norm needs
        # gradient_sharding, refused without it (nothing left behind), at
        # construction or at the step that first clips.
        client = optimd.Client(self.daemon.address)
        before = session_keys(client)
        flat = torch.nn.Parameter(torch.randn(8))
        flat._fsdp_flattened = True
        with self.assertRaisesRegex(ValueError, "FSDP version 1 over 2 "
                                    "ranks.*gradient_sharding='sharded'"):
            self.make([flat], rank=0, world_size=2, max_grad_norm=1.0)
        self.assertEqual(session_keys(client) - before, set())
        client.close()
        opt = self.make([flat], rank=0, world_size=2)
        flat.grad = torch.randn(8)
        opt.step()  # each rank steps its own shard: no job-wide number
        opt.skip_nonfinite = True
        with self.assertRaisesRegex(ValueError, "gradient_sharding"):
            opt.step()
        opt.close()

    def test_parameters_keep_identity_and_zero_grad_follows_torch(self):
        model = mlp()
        before = [id(p) for p in model.parameters()]
        opt = self.make(model.parameters())
        self.assertEqual(before, [id(p) for p in model.parameters()])
        # A fresh optimizer leaves .grad alone, as torch's does.
        self.assertTrue(all(p.grad is None for p in model.parameters()))
        self.train_step(model, opt)
        opt.zero_grad(set_to_none=True)  # torch 2's default
        self.assertTrue(all(p.grad is None for p in model.parameters()))
        self.train_step(model, opt)
        opt.zero_grad(set_to_none=False)
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        for p in model.parameters():
            self.assertEqual(p.grad.abs().sum().item(), 0.0)
        # Backward accumulates in place into the zeroed gradients.
        torch.nn.functional.mse_loss(model(self.x), self.y).backward()
        opt.step()
        self.assertEqual(ptrs, [p.grad.data_ptr() for p in model.parameters()])
        opt.close()

    def test_several_groups_and_add_param_group(self):
        model = mlp()
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        opt = self.make([{"params": layers[0].parameters(), "lr": 1e-2},
                         {"params": layers[1].parameters(),
                          "weight_decay": 0.0}], lr=1e-3)
        opt.add_param_group({"params": layers[2].parameters(), "lr": 5e-3})
        self.train_step(model, opt)
        groups = opt.client.get_state().groups
        self.assertEqual([g.group_id for g in groups], ["0", "1", "2"])
        self.assertEqual([round(g.hyperparameters.lr, 6) for g in groups],
                         [1e-2, 1e-3, 5e-3])
        self.assertEqual(groups[1].hyperparameters.weight_decay, 0.0)
        self.assertTrue(all(g.step == 1 for g in groups))
        opt.close()

    def registered_names(self, opt):
        """The tensor names the daemon has, group by group."""
        return [list(dict.fromkeys(t.tensor for t in g.tensors))
                for g in opt.client.get_state().groups]

    def test_a_group_given_one_tensor_as_in_torch(self):
        ours, theirs = self.twin_models()
        opt = self.make([{"params": ours[0].weight},
                         {"params": [ours[0].bias]}], lr=3e-3)
        ref = torch.optim.AdamW([{"params": theirs[0].weight},
                                 {"params": [theirs[0].bias]}], lr=3e-3)
        self.assertEqual([len(g["params"]) for g in opt.param_groups],
                         [len(g["params"]) for g in ref.param_groups])
        for _ in range(3):
            self.train_step(ours, opt)
            self.train_step(theirs, ref)
        for p, q in zip(ours[0].parameters(), theirs[0].parameters()):
            self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        opt.close()

    def test_named_parameters_as_in_torch(self):
        """model.named_parameters() given to the optimizer: the daemon
        registers each tensor under its model name, and param_groups and
        state_dict() carry "param_names" exactly where the installed torch
        does (torch 2.6+; torch before 2.6 takes no names)."""
        ours, theirs = self.twin_models()
        opt = self.make(ours.named_parameters(), lr=3e-3)
        try:
            ref = torch.optim.AdamW(theirs.named_parameters(), lr=3e-3)
        except TypeError:
            ref = torch.optim.AdamW(theirs.parameters(), lr=3e-3)
        names = [n for n, _ in ours.named_parameters()]
        self.assertEqual(self.registered_names(opt), [names])
        self.assertEqual(opt.param_groups[0].get("param_names"),
                         ref.param_groups[0].get("param_names"))
        for _ in range(3):
            self.train_step(ours, opt)
            self.train_step(theirs, ref)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        sd, ref_sd = opt.state_dict(), ref.state_dict()
        self.assertEqual(sd["param_groups"][0].get("param_names"),
                         ref_sd["param_groups"][0].get("param_names"))
        ref.load_state_dict(sd)
        opt.load_state_dict(ref_sd)
        self.assertEqual(opt.param_groups[0].get("param_names"),
                         ref.param_groups[0].get("param_names"))
        opt.close()

    def test_param_names_given_in_a_group_name_its_tensors(self):
        model = mlp()
        names = ["w0", "b0"]
        opt = self.make([{"params": list(model[0].parameters()),
                          "param_names": names}], lr=1e-3)
        self.assertEqual(self.registered_names(opt), [names])
        self.assertEqual(opt.param_groups[0]["param_names"], names)
        self.assertEqual(opt.state_dict()["param_groups"][0]["param_names"],
                         names)
        opt.close()

    def test_names_on_some_parameters_only_raise_as_in_torch(self):
        model = mlp()
        w, b = model[0].weight, model[0].bias
        mixed = [("0.weight", w), b]
        errors = []
        for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                     lambda ps: self.make(ps, lr=1e-3)):
            try:
                opt = make(mixed)
            except (TypeError, ValueError) as e:
                errors.append((type(e), str(e)))
            else:
                errors.append(None)
                if isinstance(opt, AdamW):
                    opt.close()
        if errors[0] is None or errors[0][0] is TypeError:
            return  # torch before 2.6 takes no names: optimd takes them
        self.assertEqual(errors[1], errors[0])
        # A group with names added to one without, and the other way.
        for first, second in (([w], [("0.bias", b)]), ([("0.weight", w)], [b])):
            ref = torch.optim.AdamW(first, lr=1e-3)
            with self.assertRaises(ValueError) as want:
                ref.add_param_group({"params": second})
            opt = self.make(first, lr=1e-3)
            with self.assertRaises(ValueError) as got:
                opt.add_param_group({"params": second})
            self.assertEqual(str(got.exception), str(want.exception))
            self.assertEqual(len(opt.param_groups), 1)
            opt.close()

    def test_state_dict_moves_both_ways_with_torch(self):
        torch.manual_seed(SEED)
        a = mlp()
        b = mlp()
        b.load_state_dict(a.state_dict())
        ref = torch.optim.AdamW(b.parameters(), lr=1e-3, amsgrad=True)
        for _ in range(5):
            ref.zero_grad()
            torch.nn.functional.mse_loss(b(self.x), self.y).backward()
            ref.step()
        a.load_state_dict(b.state_dict())
        # torch -> optimd.
        opt = self.make(a.parameters(), lr=1e-3, amsgrad=True)
        opt.load_state_dict(ref.state_dict())
        for _ in range(5):
            self.train_step(a, opt)
            ref.zero_grad()
            torch.nn.functional.mse_loss(b(self.x), self.y).backward()
            ref.step()
        for p, q in zip(a.parameters(), b.parameters()):
            self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        # optimd -> torch.
        sd = opt.state_dict()
        self.assertEqual(int(sd["state"][0]["step"]), 10)
        c = mlp()
        c.load_state_dict(a.state_dict())
        ref2 = torch.optim.AdamW(c.parameters(), lr=1e-3, amsgrad=True)
        ref2.load_state_dict(sd)
        for _ in range(3):
            self.train_step(a, opt)
            ref2.zero_grad()
            torch.nn.functional.mse_loss(c(self.x), self.y).backward()
            ref2.step()
        for p, q in zip(a.parameters(), c.parameters()):
            self.assertLessEqual(self.param_err(p, q), OWN_GRADS_TOL)
        opt.close()

    def test_state_dict_groups_hold_plain_values_and_load_back(self):
        # torch.distributed.checkpoint's helpers (accelerate's FSDP2
        # save_state) take tensors, numbers and strings only: the moments'
        # dtype is in a state dict by name, and back a torch.dtype on load.
        model = mlp()
        opt = self.make(model.parameters(), exp_avg_dtype=torch.bfloat16)
        self.train_step(model, opt)
        sd = opt.state_dict()
        plain = (int, float, bool, str, type(None), tuple, list)
        for group in sd["param_groups"]:
            for k, v in group.items():
                self.assertIsInstance(v, plain, k)
        self.assertEqual(sd["param_groups"][0]["exp_avg_dtype"],
                         "torch.bfloat16")
        # The trainer's own keys stay as they are, strings included.
        opt.param_groups[0]["note"] = "torch.float16"
        sd = opt.state_dict()
        self.assertEqual(sd["param_groups"][0]["note"], "torch.float16")
        again = self.make(model.parameters(), job_id=self.id() + "-again")
        again.load_state_dict(sd)
        self.assertIs(again.param_groups[0]["exp_avg_dtype"], torch.bfloat16)
        self.assertEqual(again.param_groups[0]["note"], "torch.float16")
        opt.close()
        again.close()

    def test_resume_after_trainer_crash_restores_weights(self):
        model = mlp()
        opt = self.make(model.parameters(), master_weights=True,
                        job_id="crashy")
        for _ in range(3):
            self.train_step(model, opt)
        trained = [p.detach().clone() for p in model.parameters()]
        # The trainer dies without closing; a new one starts from scratch.
        fresh = mlp()
        opt2 = self.make(fresh.parameters(), master_weights=True,
                         job_id="crashy", resume=True)
        self.assertTrue(opt2.resumed)
        for p, t in zip(fresh.parameters(), trained):
            self.assertTrue(torch.equal(p.detach(), t))
        self.assertEqual(int(opt2.state[next(fresh.parameters())]["step"]), 3)
        opt2.close()

    def test_resume_needs_the_sessions_secret(self):
        from optimd import _secrets
        model = mlp()
        # (fp32 masters: the daemon can give a new trainer the weights)
        opt = self.make(model.parameters(), job_id="guarded",
                        master_weights=True)
        self.train_step(model, opt)
        path = _secrets.path("guarded", 0)
        self.assertEqual(os.stat(path).st_mode & 0o777, 0o600)
        self.assertEqual(len(opt.resume_secret), 32)
        # Another job that only knows the job id (ListSessions shows it)
        # cannot take the session over; the trainer keeps it.
        for wrong in ("", "0" * 32):
            with self.assertRaises(optimd.PermissionDeniedError):
                self.make(mlp().parameters(), job_id="guarded", resume=True,
                          resume_secret=wrong, master_weights=True)
        self.train_step(model, opt)
        # A trainer restarted elsewhere passes the secret itself.
        secret = opt.resume_secret
        os.unlink(path)
        fresh = mlp()
        opt2 = self.make(fresh.parameters(), job_id="guarded", resume=True,
                         resume_secret=secret, master_weights=True)
        self.assertTrue(opt2.resumed)
        self.assertEqual(opt2.resume_secret, secret)
        for p, q in zip(fresh.parameters(), model.parameters()):
            self.assertTrue(torch.equal(p, q))
        opt2.close()
        self.assertFalse(os.path.exists(path))  # closed: forgotten

    def test_connection_errors_name_the_cause(self):
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "optimd.sock")
            # A bare socket path would be taken for a TLS TCP address.
            with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                        "write unix:"):
                optimd.Client(path)
            # A missing socket file: said at once, not after a 10 s wait.
            t0 = time.time()
            with self.assertRaisesRegex(optimd.DaemonUnavailableError,
                                        "does not exist"):
                optimd.Client("unix:" + path, connect_timeout=10)
            self.assertLess(time.time() - t0, 2)
            # A socket file nothing listens on (a daemon that ended without
            # removing it): said at once.
            stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stale.bind(path)
            t0 = time.time()
            with self.assertRaisesRegex(optimd.DaemonUnavailableError,
                                        "nothing listens on it"):
                optimd.Client("unix:" + path, connect_timeout=10)
            self.assertLess(time.time() - t0, 2)
            stale.close()
            os.unlink(path)
            # Another user's socket (mode 0600), and a socket in a directory
            # closed to this user (another user's runtime directory, mode
            # 0700): root may open every file, so as root the client runs
            # as nobody; otherwise files closed to their owner stand in.
            if os.geteuid() != 0:
                open(path, "w").close()
                os.chmod(path, 0)
                with self.assertRaisesRegex(optimd.DaemonUnavailableError,
                                            "only it may connect"):
                    optimd.Client("unix:" + path)
                os.chmod(scratch, 0)
                try:
                    with self.assertRaisesRegex(
                            optimd.DaemonUnavailableError,
                            "the directory %s on its path belongs to user "
                            ".* and is closed to this user \\(mode 0\\)" %
                            scratch):
                        optimd.Client("unix:" + path)
                finally:
                    os.chmod(scratch, 0o700)
        if os.geteuid() == 0:
            self.check_sockets_closed_to_another_user()
        # A daemon killed mid-training: the error says the state is gone.
        d = Daemon()
        p = torch.nn.Parameter(torch.randn(3))
        opt = AdamW([p], address=d.address, job_id="gone")
        p.grad = torch.randn(3)
        opt.step()
        d.process.kill()
        d.process.wait()
        with self.assertRaises(optimd.DaemonUnavailableError) as cm:
            opt.step()
        self.assertIn("went away", str(cm.exception))
        self.assertIn("lost unless", str(cm.exception))
        d.stop()

    def check_sockets_closed_to_another_user(self):
        """As nobody, the client names the directory closed to it, then
        the socket's owner."""
        d = Daemon()  # its socket: root's, mode 0600, in a 0700 directory
        try:
            directory = os.path.dirname(d.socket_path)
            said = as_nobody(d.address)
            self.assertIn(
                "DaemonUnavailableError: the daemon socket %s is out of this "
                "user's reach: the directory %s on its path belongs to user "
                "root (uid 0) and is closed to this user (mode 700); run as "
                "that user" % (d.socket_path, directory), said)
            os.chmod(directory, 0o755)
            said = as_nobody(d.address)
            self.assertIn(
                "DaemonUnavailableError: the daemon socket %s belongs to user "
                "root (uid 0) and only it may connect (mode 600); run as that "
                "user" % d.socket_path, said)
        finally:
            d.stop()

    def test_clear_errors(self):
        p = torch.nn.Parameter(torch.randn(3))
        with self.assertRaises(optimd.DaemonUnavailableError) as cm:
            AdamW([p], address="unix:/tmp/optimd-nobody-here.sock")
        self.assertIn("no optimd daemon", str(cm.exception))
        with self.assertRaises(TypeError) as cm:
            self.make([torch.nn.Parameter(
                torch.randn(3, dtype=torch.complex64))])
        self.assertIn("complex64", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            self.make([torch.nn.Parameter(torch.randn(2)),
                       torch.nn.Parameter(torch.randn(2, device="meta"))])
        self.assertIn("CPU and CUDA parameters", str(cm.exception))
        # Sparse gradients: the same exception as torch's AdamW.
        for make in (lambda ps: self.make(ps, job_id="sparse"),
                     lambda ps: torch.optim.AdamW(ps)):
            emb = torch.nn.Embedding(10, 4, sparse=True)
            opt = make(list(emb.parameters()))
            emb(torch.tensor([1, 2])).sum().backward()
            self.assertTrue(emb.weight.grad.is_sparse)
            with self.assertRaisesRegex(RuntimeError, "sparse gradients"):
                opt.step()
            if isinstance(opt, AdamW):
                opt.close()
        # amsgrad turned on after steps: torch's step raises KeyError (no
        # max_exp_avg_sq in the state); so does optimd's, saying why (and
        # still a ValueError, as it was before).
        for make in (lambda ps: self.make(ps, job_id="amsgrad"),
                     torch.optim.AdamW):
            q = torch.nn.Parameter(torch.randn(3))
            opt = make([q])
            q.grad = torch.randn(3)
            opt.step()
            opt.param_groups[0]["amsgrad"] = True
            with self.assertRaises(KeyError) as cm:
                opt.step()
            if isinstance(opt, AdamW):
                self.assertIsInstance(cm.exception, ValueError)
                self.assertIsInstance(cm.exception, optimd.MissingStateError)
                self.assertTrue(str(cm.exception).startswith(
                    "param_groups[0]['amsgrad'] was turned on after steps"))
                opt.close()

    def test_amsgrad_and_maximize_edits_follow_torch(self):
        # amsgrad set before the first step, maximize flipped mid-training:
        # both followed, as torch follows them.
        ours, theirs, opt, ref = self.seeded_twins()
        for o in (opt, ref):
            o.param_groups[0]["amsgrad"] = True
        for step in range(6):
            if step == 3:
                for o in (opt, ref):
                    o.param_groups[0]["maximize"] = True
            grads = [torch.randn(p.shape) for p in ours.parameters()]
            for p, q, g in zip(ours.parameters(), theirs.parameters(), grads):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                self.assertLessEqual(self.param_err(p, q), 1e-6)
        p0, q0 = next(ours.parameters()), next(theirs.parameters())
        self.assertTrue(torch.allclose(opt.state[p0]["max_exp_avg_sq"],
                                       ref.state[q0]["max_exp_avg_sq"],
                                       rtol=1e-5))
        opt.close()

    def edited_and_loaded(self, key, value, dtype, steps=3):
        """One bf16-or-fp32 parameter stepped `steps` times, `key` set to
        `value` in its group, then three more steps; and a fresh optimizer
        made with key=value that loads the state dict of the moment of the
        edit and takes the same three steps. Returns both parameters and
        the first optimizer's state entry and registration request."""
        torch.manual_seed(SEED)
        grads = [torch.randn(64, 32).to(dtype) for _ in range(steps + 3)]
        p = torch.nn.Parameter(torch.randn(64, 32).to(dtype))
        opt = self.make([p], lr=1e-2)
        for g in grads[:steps]:
            p.grad = g.clone()
            opt.step()
        saved = copy.deepcopy(opt.state_dict())
        q = torch.nn.Parameter(p.detach().clone())
        opt.param_groups[0][key] = value
        options = dict(lr=1e-2)
        options[key] = value
        ref = self.make([q], job_id=self.id() + "-ref", **options)
        saved["param_groups"][0][key] = value
        ref.load_state_dict(saved)
        for g in grads[steps:]:
            p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        entry = {k: v.clone() for k, v in opt.state[p].items()}
        request = opt._groups[0]["request"]
        opt.close()
        ref.close()
        return p, q, entry, request

    def test_optimds_own_options_edited_in_param_groups_take_effect(self):
        # Each acts from the next step as if the optimizer had been made
        # with it and had loaded the state of the moment of the edit; each
        # was silently ignored before (the registration kept the old one).
        from optimd.v1 import optimd_pb2 as layouts
        for key, value, dtype, slot_dtype, master in (
                ("bias_correction", False, torch.float32, torch.float32,
                 layouts.MASTER_WEIGHTS_UNSPECIFIED),
                ("exp_avg_dtype", torch.bfloat16, torch.float32,
                 torch.bfloat16, layouts.MASTER_WEIGHTS_UNSPECIFIED),
                ("exp_avg_dtype", optimd.torch.BLOCK8, torch.float32,
                 torch.float32, layouts.MASTER_WEIGHTS_UNSPECIFIED),
                ("store_param_remainders", True, torch.bfloat16,
                 torch.float32, layouts.MASTER_WEIGHTS_REMAINDER)):
            with self.subTest(key=key, value=value):
                p, q, entry, request = self.edited_and_loaded(key, value,
                                                              dtype)
                self.assertTrue(torch.equal(p, q))
                self.assertEqual(entry["exp_avg"].dtype, slot_dtype)
                self.assertEqual(request.layout.master_weights, master)
                # A remainder keeps the fp32 master exactly: the same
                # masters (the bf16 parameter may differ at a tie, README).
                # The others part from unedited steps.
                unedited, _, unedited_entry, _ = self.edited_and_loaded(
                    "lr", 1e-2, dtype)
                if key == "store_param_remainders":
                    self.assertTrue(torch.equal(entry["master"],
                                                unedited_entry["master"]))
                else:
                    self.assertFalse(torch.equal(p, unedited))

    def test_refused_storage_edits_change_nothing(self):
        # An edit the daemon refuses (a bf16 parameter needs a master) or
        # the client refuses (an unknown moment dtype, amsgrad with 8-bit
        # moments) raises at the step, and the optimizer steps on as before
        # once the key is put back; so does a refused load.
        torch.manual_seed(SEED)
        p = torch.nn.Parameter(torch.randn(64, 32).to(torch.bfloat16))
        opt = self.make([p], lr=1e-2)
        p.grad = torch.randn_like(p)
        opt.step()
        group = opt.param_groups[0]
        for key, value, error in (
                ("master_weights", False, ValueError),
                ("exp_avg_dtype", torch.float16, TypeError),
                ("master_weights", "yes", TypeError)):
            with self.subTest(key=key, value=value):
                before = copy.deepcopy(opt.state_dict())
                kept, param = group[key], p.detach().clone()
                group[key] = value
                with self.assertRaisesRegex(error, key):
                    opt.step()
                self.assertTrue(torch.equal(p, param))
                group[key] = kept
                self.assert_same_state_dict(opt.state_dict(), before)
        group["maximize"] = True  # an edit the refused load must keep
        saved = opt.state_dict()
        saved["param_groups"][0]["master_weights"] = False
        saved["param_groups"][0]["lr"] = 0.5
        with torch.no_grad():
            opt.state[p]["exp_avg"].fill_(5)  # a write not yet sent
        before = copy.deepcopy(opt.state_dict())
        with self.assertRaises(ValueError):
            opt.load_state_dict(saved)
        self.assert_same_state_dict(opt.state_dict(), before)
        self.assertEqual(opt.state[p]["exp_avg"].max().item(), 5)
        # A refused edit still pending blocks neither state_dict() nor a
        # load, which replaces it as torch's load replaces every key.
        group["master_weights"] = False
        good = opt.state_dict()
        good["param_groups"][0]["master_weights"] = None
        opt.load_state_dict(good)
        self.assertIsNone(group["master_weights"])
        group["amsgrad"], group["exp_avg_dtype"] = True, optimd.torch.BLOCK8
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            opt.step()
        group["amsgrad"], group["exp_avg_dtype"] = False, torch.float32
        opt.step()
        self.assertEqual(opt.state[p]["step"].item(), 2)
        opt.close()

    def test_a_registration_the_daemon_refuses_is_undone_where_params_are(
            self):
        # A storage edit the daemon refuses (here its state budget: fp32
        # moments need twice the bytes of bf16 ones) after the parameter's
        # storage was swapped and a scheduler set lr to 0: the group is
        # registered again over the parameter's memory of now, stepping
        # with the lr of now.
        n = 1 << 20
        with Daemon(flags=["--max_state_bytes=%d" % (6 * n)]) as d:
            p = torch.nn.Parameter(torch.randn(n))
            opt = AdamW([p], lr=0.1, address=d.address, job_id="budget",
                        exp_avg_dtype=torch.bfloat16)
            p.grad = torch.randn(n)
            opt.step()
            p.data = p.data.clone()  # the storage swapped
            opt.param_groups[0]["lr"] = 0.0
            opt.step()
            opt.param_groups[0]["exp_avg_dtype"] = torch.float32
            with self.assertRaises(optimd.ResourceExhaustedError):
                opt.step()
            opt.param_groups[0]["exp_avg_dtype"] = torch.bfloat16
            before = p.detach().clone()
            opt.step()
            self.assertTrue(torch.equal(p.detach(), before))  # lr 0 kept
            opt.param_groups[0]["lr"] = 0.1
            opt.step()
            self.assertFalse(torch.equal(p.detach(), before))
            self.assertEqual(opt.state[p]["step"].item(), 4)
            opt.close()

    def test_storage_prechecks_agree_with_the_daemon(self):
        # The client's checks of storage options before a group is taken
        # down (_storage_refusal) refuse exactly what the daemon's
        # registration refuses, for every parameter dtype and option.
        from optimd._daemon_optimizer import _storage_refusal
        for dtype, master, remainder, moments in itertools.product(
                (torch.float32, torch.bfloat16, torch.float16,
                 torch.float64), (None, True, False), (False, True),
                (torch.float32, torch.bfloat16, optimd.torch.BLOCK8)):
            options = dict(master_weights=master, exp_avg_dtype=moments,
                           store_param_remainders=remainder)
            with self.subTest(dtype=dtype, **options):
                p = torch.nn.Parameter(torch.zeros(4, dtype=dtype))
                try:
                    self.make([p], job_id=None, **options).close()
                    accepted = True
                except optimd.InvalidArgumentError:
                    accepted = False
                predicted = _storage_refusal(options, dtype, "exp_avg_dtype")
                self.assertEqual(predicted is None, accepted, predicted)

    def assert_same_state_dict(self, got, want):
        """Equal param_groups and equal state tensors, bit for bit."""
        self.assertEqual(got["param_groups"], want["param_groups"])
        self.assertEqual(got["state"].keys(), want["state"].keys())
        for i, entry in want["state"].items():
            self.assertEqual(got["state"][i].keys(), entry.keys())
            for k, v in entry.items():
                self.assertTrue(torch.equal(got["state"][i][k], v), k)

    def test_a_forked_child_neither_uses_nor_closes_the_session(self):
        # The child's calls raise at once (the parent's gRPC connection is
        # no use to it), and what its ordinary exit would run (the
        # optimizer's finalizer: close(); atexit's functions) leaves the
        # parent's session open. os._exit after: unittest would catch a
        # SystemExit and go on with the other tests in the child.
        # The child computes nothing with torch: a forked child's first
        # parallel torch op can hang in the OpenMP runtime (GNU OpenMP is
        # not fork-safe), which is not what this test is about.
        model = mlp()
        opt = self.make(model.parameters(), lr=1e-2, job_id=None)
        self.train_step(model, opt)
        trace_r, trace_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(trace_r)
            os._exit(self.forked_child_calls(opt, trace_w))
        os.close(trace_w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(trace_r) as trace:
            reached = trace.read()
        self.assertTrue(os.WIFEXITED(status), (status, reached))
        self.assertEqual(os.WEXITSTATUS(status), 0, reached)
        with optimd.Client(self.daemon.address) as c:
            jobs = [s.job_id for s in c.list_sessions().sessions]
        self.assertIn(opt._identity["job"], jobs)
        self.train_step(model, opt)  # the parent's session goes on
        opt.close()

    @staticmethod
    def forked_child_calls(opt, trace_fd):
        """In a forked child: a step through the parent's optimizer, then
        what an ordinary exit would run. Returns the child's exit code (0:
        the step raised FailedPreconditionError naming fork); writes each
        stage reached to trace_fd, for the parent's message."""
        def reached(stage):
            os.write(trace_fd, stage.encode() + b" ")
        signal.alarm(20)  # a hang fails the test, not the suite
        try:
            for p in opt.param_groups[0]["params"]:
                p.grad = torch.ones_like(p)
            reached("step")
            opt.step()
            code = 3  # stepped through the parent's connection
        except optimd.FailedPreconditionError as e:
            code = 0 if "fork" in str(e) else 4
        except BaseException:  # noqa: B902 (any other failure)
            code = 5
        try:
            reached("close")
            opt.close()
            reached("atexit")
            atexit._run_exitfuncs()
            reached("done")
        except BaseException:  # noqa: B902
            code = code or 6
        return code

    def test_a_closed_optimizer_says_so(self):
        model = mlp()
        opt = self.make(model.parameters(), lr=1e-2)
        self.train_step(model, opt)
        opt.close()
        for use in (lambda: self.train_step(model, opt), opt.state_dict):
            with self.assertRaisesRegex(optimd.FailedPreconditionError,
                                        "was closed"):
                use()

    def test_a_checkpoint_stream_left_early_lets_its_snapshot_go(self):
        # A read interrupted inside gRPC's wait for a chunk (where SIGINT
        # lands most often): the traceback, which a notebook keeps, holds
        # gRPC's frames and with them the call; the call is cancelled all
        # the same, so that the daemon's two snapshots per session do not
        # stay taken. 4M parameters: more than gRPC's flow-control windows
        # hold, so a stream nobody reads stays open.
        import grpc

        params = [torch.nn.Parameter(torch.zeros(1 << 20)) for _ in range(4)]
        opt = self.make(params, lr=1e-2)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        rendezvous = grpc._channel._MultiThreadedRendezvous
        real_next = rendezvous.__next__
        calls = []

        def interrupted_next(call):
            calls.append(call)
            if len(calls) % 2 == 0:
                raise KeyboardInterrupt
            return real_next(call)
        kept = []
        gc.disable()  # cyclic collection would end abandoned calls too
        try:
            with mock.patch.object(rendezvous, "__next__", interrupted_next):
                for _ in range(3):
                    try:
                        for _ in opt.state_bytes(chunk_bytes=1 << 16):
                            pass
                    except KeyboardInterrupt as e:
                        kept.append(e)
            del calls[:]
            deadline = time.monotonic() + 10
            while True:
                try:
                    whole = b"".join(opt.state_bytes())
                    break
                except optimd.ResourceExhaustedError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            gc.enable()
        self.assertGreater(len(whole), 0)
        opt.close()


class StepOrderTest(unittest.TestCase):
    """optimd/_step_order.py: before a flagged step goes out, the replies
    to the steps other optimizers of the process sent on the same GPU are
    waited for (the GPU deadlock it prevents is test_cuda_e2e's
    test_two_optimizers_steps_out_of_order_never_deadlock)."""

    class Owner:
        pass

    def setUp(self):
        from optimd import _step_order
        self.order = _step_order
        self.first, self.second = self.Owner(), self.Owner()
        self.device = "device of %s" % self.id()

    def tearDown(self):
        self.order.forget(self.first)
        self.order.forget(self.second)

    def waited(self, owner, device=None, timeout=10):
        start = time.monotonic()
        self.order.wait_for_others(device or self.device, owner, timeout)
        return time.monotonic() - start

    def test_waits_for_every_other_optimizers_reply(self):
        import concurrent.futures
        import threading
        third = self.Owner()
        replies = [concurrent.futures.Future() for _ in range(2)]
        self.order.sent(self.device, self.first, replies[0])
        self.order.sent(self.device, third, replies[1])
        threading.Timer(0.2, replies[0].set_result, [None]).start()
        threading.Timer(0.4, replies[1].set_exception,
                        [RuntimeError("its own error")]).start()
        self.assertGreaterEqual(self.waited(self.second), 0.35)
        self.order.forget(third)

    def test_never_waits_for_its_own_or_another_gpus_reply(self):
        import concurrent.futures
        self.order.sent(self.device, self.first, concurrent.futures.Future())
        self.assertLess(self.waited(self.first), 0.2)
        self.assertLess(self.waited(self.second, device="another"), 0.2)

    def test_a_closed_or_collected_optimizers_reply_is_not_waited_for(self):
        import concurrent.futures
        gone = self.Owner()
        self.order.sent(self.device, gone, concurrent.futures.Future())
        del gone
        gc.collect()
        self.assertLess(self.waited(self.second), 0.2)
        self.order.sent(self.device, self.first, concurrent.futures.Future())
        self.assertGreaterEqual(self.waited(self.second, timeout=0.2), 0.15)
        self.order.forget(self.first)
        self.assertLess(self.waited(self.second), 0.2)


if __name__ == "__main__":
    unittest.main()
