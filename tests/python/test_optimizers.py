"""optimd.torch.SGD against torch.optim.SGD, optimd.torch.Adam against
torch.optim.Adam, and optimd.torch.Lion against
a reference written with torch ops (the published update), through the
real daemon (CPU backend): every option, schedulers that change momentum,
parameters whose first gradient comes late, state dicts both ways, layout
changes, checkpoints, and float64 parameters stepped in float64. Inputs
are fresh random values each run; the seed is printed.
"""
import itertools
import os
import random
import tempfile
import unittest
from unittest import mock

import torch

import optimd
from optimd.testing import DaemonTestCase
from optimd.torch import SGD, Adam, Lion

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(37,), (16, 33), (5,), (3, 4, 7)]


def rel_err(a, b):
    """The largest element error relative to the tensor's scale (see
    test_torch_parity.py for why not element by element)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bf16_bits(t):
    """The bit patterns of bfloat16 tensor t, as non-negative int64."""
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def bf16_ties_away(master):
    """The bfloat16 bit patterns of float32 `master` rounded to nearest,
    ties away from zero (adding half a bf16 ulp to the magnitude's bits
    and truncating), as non-negative int64."""
    b = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((b + 0x8000) >> 16) & 0xFFFF


def sgd_options():
    """Every combination of SGD's options that torch takes (nesterov needs
    momentum and no dampening), at lr 0.01."""
    for momentum, dampening, nesterov, wd, maximize in itertools.product(
            (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.01),
            (False, True)):
        if nesterov and (momentum == 0 or dampening != 0):
            continue
        yield dict(lr=0.01, momentum=momentum, dampening=dampening,
                   nesterov=nesterov, weight_decay=wd, maximize=maximize)


class LionReference:
    """Lion as its paper writes it, in torch ops: decoupled decay, the sign
    of the interpolated momentum, then the momentum update."""

    def __init__(self, params, lr, betas, weight_decay, maximize=False):
        self.params = list(params)
        self.lr, self.betas, self.wd = lr, betas, weight_decay
        self.maximize = maximize
        self.state = {}

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p in self.params:
            if p.grad is None:
                continue
            g = -p.grad if self.maximize else p.grad
            m = self.state.setdefault(p, torch.zeros_like(p))
            p.mul_(1 - self.lr * self.wd)
            update = m.clone().mul_(b1).add(g, alpha=1 - b1).sign_()
            p.add_(update, alpha=-self.lr)
            m.mul_(b2).add_(g, alpha=1 - b2)


class Base(DaemonTestCase):
    seed = SEED

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def twins(self):
        ours = [torch.nn.Parameter(self.randn(*s)) for s in SHAPES]
        return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def grads(self, ours, theirs, skip=()):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            if i in skip:
                p.grad = q.grad = None
                continue
            g = self.randn(*p.shape)
            p.grad = g.clone()
            q.grad = g.clone()

    def make(self, cls, params, **kw):
        opt = cls(params, address=self.daemon.address,
                  job_id="t%d" % len(self.opts) + self.id(), **kw)
        self.opts.append(opt)
        return opt

    def assert_close(self, ours, theirs, tol, what):
        for p, q in zip(ours, theirs):
            self.assertLessEqual(rel_err(p.detach(), q.detach()), tol, what)


class SgdParity(Base):
    def run_pair(self, steps=60, skip_first=0, schedule=False, **kw):
        ours, theirs = self.twins()
        opt = self.make(SGD, ours, **kw)
        ref = torch.optim.SGD(theirs, **kw)
        scheds = []
        if schedule:
            scheds = [torch.optim.lr_scheduler.OneCycleLR(
                o, max_lr=kw["lr"], total_steps=steps, base_momentum=0.8,
                max_momentum=0.95) for o in (opt, ref)]
        for step in range(steps):
            # Parameter 2 gets its first gradient at step `skip_first`.
            self.grads(ours, theirs, skip=(2,) if step < skip_first else ())
            opt.step()
            ref.step()
            for s in scheds:
                s.step()
            self.assertFalse(opt.skipped)
            self.assert_close(ours, theirs, 1e-5, "step %d %s" % (step, kw))
        return opt, ref, ours, theirs

    def test_every_option(self):
        for kw in sgd_options():
            with self.subTest(**kw):
                opt, ref, ours, theirs = self.run_pair(**kw)
                for p, q in zip(ours, theirs):
                    if kw["momentum"]:
                        self.assertLessEqual(rel_err(
                            opt.state[p]["momentum_buffer"],
                            ref.state[q]["momentum_buffer"]), 1e-5)
                    else:
                        # The installed torch's entry: a None buffer on
                        # torch 1.13, none from later torch 2.x.
                        self.assertEqual(dict(opt.state[p]),
                                         dict(ref.state[q]))

    def test_one_cycle_schedule_cycles_momentum(self):
        self.run_pair(schedule=True, lr=0.05, momentum=0.9, weight_decay=0.01)

    def test_first_gradient_late_starts_its_buffer(self):
        self.run_pair(skip_first=5, lr=0.01, momentum=0.9, dampening=0.3)

    def test_state_dicts_move_both_ways(self):
        opt, ref, ours, theirs = self.run_pair(steps=5, lr=0.01, momentum=0.9)
        # ours -> torch: a fresh torch optimizer goes on as ours does.
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        other = torch.optim.SGD(fresh, lr=0.01, momentum=0.9)
        other.load_state_dict(opt.state_dict())
        # torch -> ours.
        mine = [torch.nn.Parameter(q.detach().clone()) for q in theirs]
        back = self.make(SGD, mine, lr=0.01, momentum=0.9)
        back.load_state_dict(ref.state_dict())
        for _ in range(5):
            g = [self.randn(*p.shape) for p in ours]
            for params in (ours, theirs, fresh, mine):
                for p, gi in zip(params, g):
                    p.grad = gi.clone()
            for o in (opt, ref, other, back):
                o.step()
        self.assert_close(fresh, theirs, 1e-5, "ours -> torch")
        self.assert_close(mine, theirs, 1e-5, "torch -> ours")

    def assert_same_state(self, ours, theirs, what):
        """State dicts `ours` and `theirs` (torch's) hold the same entries
        with the same keys: None where torch's has None, close tensors
        elsewhere."""
        self.assertEqual(sorted(ours["state"]), sorted(theirs["state"]),
                         what)
        for i, entry in theirs["state"].items():
            self.assertEqual(sorted(ours["state"][i]), sorted(entry),
                             "%s: parameter %d" % (what, i))
            for k, v in entry.items():
                mine = ours["state"][i][k]
                if v is None:
                    self.assertIsNone(mine, "%s: %d %s" % (what, i, k))
                else:
                    self.assertLessEqual(rel_err(mine, v), 1e-5,
                                         "%s: %d %s" % (what, i, k))

    def no_momentum_pair(self, steps=4):
        """optimd's and torch's SGD without momentum after `steps` steps
        in which parameter 2 has no gradient (torch keeps no entry for
        it)."""
        ours, theirs = self.twins()
        opt = self.make(SGD, ours, lr=0.01)
        ref = torch.optim.SGD(theirs, lr=0.01)
        for _ in range(steps):
            self.grads(ours, theirs, skip=(2,))
            opt.step()
            ref.step()
        return opt, ref, ours, theirs

    def test_no_momentum_state_is_what_torch_keeps(self):
        # torch 1.13 keeps {"momentum_buffer": None} per stepped parameter,
        # later torch 2.x no entry; optimd's is the installed torch's.
        opt, ref, ours, theirs = self.no_momentum_pair()
        self.assert_close(ours, theirs, 1e-5, "steps")
        self.assert_same_state(opt.state_dict(), ref.state_dict(),
                               "state_dict")
        for p, q in zip(ours, theirs):
            self.assertEqual(p in opt.state, q in ref.state)
            if q in ref.state:
                self.assertEqual(dict(opt.state[p]), dict(ref.state[q]))

    def test_no_momentum_state_dicts_move_both_ways(self):
        opt, ref, ours, theirs = self.no_momentum_pair()
        # torch -> ours, as torch has it and without the None buffers (as
        # later torch 2.x writes it): each loads, and then holds what
        # torch's SGD holds after loading it.
        bare = ref.state_dict()
        bare["state"] = {}
        backs = []
        for what, sd in (("as torch has it", ref.state_dict()),
                         ("without None", bare)):
            mine = [torch.nn.Parameter(q.detach().clone()) for q in theirs]
            back = self.make(SGD, mine, lr=0.01)
            back.load_state_dict(sd)
            twin = [torch.nn.Parameter(q.detach().clone()) for q in theirs]
            loaded = torch.optim.SGD(twin, lr=0.01)
            loaded.load_state_dict(sd)
            self.assert_same_state(back.state_dict(), loaded.state_dict(),
                                   what)
            backs.append((what, back, mine, loaded, twin))
        # ours -> torch: it holds what torch's own state dict gives it.
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        other = torch.optim.SGD(fresh, lr=0.01)
        other.load_state_dict(opt.state_dict())
        self.assert_same_state(other.state_dict(), ref.state_dict(),
                               "ours -> torch")
        # Then every one trains as torch does.
        runs = [(opt, ours), (ref, theirs), (other, fresh)]
        for _, back, mine, loaded, twin in backs:
            runs += [(back, mine), (loaded, twin)]
        for _ in range(5):
            self.grads(ours, theirs, skip=(2,))
            for _, params in runs[2:]:
                for p, q in zip(params, ours):
                    p.grad = None if q.grad is None else q.grad.clone()
            for o, _ in runs:
                o.step()
        self.assert_close(ours, theirs, 1e-5, "ours")
        self.assert_close(fresh, theirs, 1e-5, "ours -> torch")
        self.assert_same_state(opt.state_dict(), ref.state_dict(), "ours")
        for what, back, mine, loaded, twin in backs:
            self.assert_close(mine, theirs, 1e-5, "torch -> ours, " + what)
            self.assert_same_state(back.state_dict(), loaded.state_dict(),
                                   "after steps, " + what)

    def test_no_momentum_state_follows_a_torch_without_none(self):
        # A torch that keeps no entry without momentum (later torch 2.x),
        # as the probe of the installed torch would find it: no entry, and
        # a torch 1.13 state dict still loads.
        with mock.patch("optimd.torch._torch_sgd_unset_slots",
                        lambda: ()):
            opt, ref, ours, theirs = self.no_momentum_pair()
            self.assertEqual(opt.state_dict()["state"], {})
            self.assertEqual(len(opt.state), 0)
            opt.load_state_dict(ref.state_dict())
            self.assertEqual(opt.state_dict()["state"], {})

    def test_momentum_turned_on_after_steps(self):
        ours, theirs = self.twins()
        opt = self.make(SGD, ours, lr=0.01)
        ref = torch.optim.SGD(theirs, lr=0.01)
        for step in range(6):
            if step == 3:
                for o in (opt, ref):
                    o.param_groups[0]["momentum"] = 0.9
            self.grads(ours, theirs)
            opt.step()
            ref.step()
            self.assert_close(ours, theirs, 1e-5, "step %d" % step)

    def test_bf16_parameters_follow_an_fp32_master(self):
        ours = [torch.nn.Parameter(self.randn(*s).bfloat16()) for s in SHAPES]
        theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
        opt = self.make(SGD, ours, lr=0.01, momentum=0.9,
                        store_param_remainders=True)
        ref = torch.optim.SGD(theirs, lr=0.01, momentum=0.9)
        for _ in range(20):
            for p, q in zip(ours, theirs):
                g = self.randn(*p.shape).bfloat16()
                p.grad, q.grad = g, g.float()
            opt.step()
            ref.step()
        for p, q in zip(ours, theirs):
            # The fp32 master follows torch's fp32 weights, as every SGD
            # comparison here, and the bf16 parameter is the master rounded
            # as the remainder layout rounds: to nearest, ties away from
            # zero (README: Layouts), where torch's .bfloat16() rounds ties
            # to even. Comparing the parameter with torch's weights rounded
            # by torch failed whenever a master landed exactly halfway
            # between two bf16 values (seed 2195558: 0xbf908000).
            master = opt.state[p]["master"]
            self.assertLessEqual(rel_err(master, q.detach()), 1e-5)
            self.assertTrue(torch.equal(bf16_bits(p.detach()),
                                        bf16_ties_away(master)))

    def test_checkpoint_round_trip(self):
        opt, _, ours, _ = self.run_pair(steps=3, lr=0.01, momentum=0.9)
        directory = tempfile.mkdtemp(prefix="optimd-sgd-ckpt-")
        opt.save_checkpoint(directory)
        saved = [p.detach().clone() for p in ours]
        buffers = [opt.state[p]["momentum_buffer"].clone() for p in ours]
        self.grads(ours, ours)
        opt.step()
        opt.load_checkpoint(directory)
        for p, w, b in zip(ours, saved, buffers):
            self.assertTrue(torch.equal(p.detach(), w))
            self.assertTrue(torch.equal(opt.state[p]["momentum_buffer"], b))
        # The file as torch.optim.SGD's state dict.
        from optimd.checkpoint import to_torch_state_dict
        sd, params, _ = to_torch_state_dict(
            os.path.join(directory, "rank-0.safetensors"))
        self.assertEqual(sd["param_groups"][0]["momentum"], 0.9)
        self.assertNotIn("eps", sd["param_groups"][0])
        for i, b in enumerate(buffers):
            self.assertTrue(torch.equal(sd["state"][i]["momentum_buffer"], b))
            self.assertNotIn("step", sd["state"][i])
        fresh = [torch.nn.Parameter(w.clone()) for w in saved]
        torch.optim.SGD(fresh, lr=0.01, momentum=0.9).load_state_dict(sd)

    def test_bad_arguments_raise_as_torch_does(self):
        p = [torch.nn.Parameter(torch.zeros(3))]
        with self.assertRaises(ValueError):
            SGD(p, lr=0.1, nesterov=True, address=self.daemon.address)
        with self.assertRaises(ValueError):
            SGD(p, lr=-1.0, address=self.daemon.address)


class AdamParity(Base):
    def test_adam_is_torch_adam(self):
        for wd, amsgrad in itertools.product((0.0, 0.01), (False, True)):
            with self.subTest(weight_decay=wd, amsgrad=amsgrad):
                ours, theirs = self.twins()
                opt = self.make(Adam, ours, lr=1e-2, weight_decay=wd,
                                amsgrad=amsgrad)
                ref = torch.optim.Adam(theirs, lr=1e-2, weight_decay=wd,
                                       amsgrad=amsgrad)
                self.assertEqual(opt.param_groups[0]["weight_decay"], wd)
                for step in range(50):
                    self.grads(ours, theirs)
                    opt.step()
                    ref.step()
                    self.assert_close(ours, theirs, 1e-5, "step %d" % step)
        with self.assertRaises(TypeError):
            Adam([torch.nn.Parameter(torch.zeros(2))], adam_w_mode=True)
        # torch.optim.Adam's default: no weight decay.
        p = [torch.nn.Parameter(torch.zeros(2))]
        self.assertEqual(self.make(Adam, p).param_groups[0]["weight_decay"],
                         0.0)


class LionParity(Base):
    def test_against_the_reference(self):
        for wd, maximize in itertools.product((0.0, 0.1), (False, True)):
            with self.subTest(weight_decay=wd, maximize=maximize):
                ours, theirs = self.twins()
                kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=wd,
                          maximize=maximize)
                opt = self.make(Lion, ours, **kw)
                ref = LionReference(theirs, **kw)
                for step in range(60):
                    self.grads(ours, theirs)
                    opt.step()
                    ref.step()
                    self.assert_close(ours, theirs, 1e-5, "step %d" % step)
                for p, q in zip(ours, theirs):
                    self.assertLessEqual(
                        rel_err(opt.state[p]["exp_avg"], ref.state[q]), 1e-5)
                    self.assertNotIn("step", opt.state[p])

    def test_state_dict_round_trip_and_schedules(self):
        ours, theirs = self.twins()
        opt = self.make(Lion, ours, lr=1e-3, weight_decay=0.1)
        ref = LionReference(theirs, lr=1e-3, betas=(0.9, 0.99),
                            weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
        for step in range(6):
            self.grads(ours, theirs)
            opt.step()
            ref.step()
            sched.step()
            ref.lr = opt.param_groups[0]["lr"]
        self.assert_close(ours, theirs, 1e-5, "scheduled")
        mine = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        back = self.make(Lion, mine, lr=ref.lr, weight_decay=0.1)
        back.load_state_dict(opt.state_dict())
        for p, q in zip(ours, mine):
            self.assertTrue(torch.equal(opt.state[p]["exp_avg"],
                                        back.state[q]["exp_avg"]))


def float64_err(a, b, floor):
    """The largest element error relative to the larger of the tensor's
    scale now and `floor`, a scale that cannot vanish when the tensor
    shrinks towards zero (weight decay, maximize): its scale before the
    first step, or its values' standard deviation. A float64 bound then
    stays a float64 bound."""
    scale = max(b.double().abs().max().item(), floor)
    return (a.double() - b.double()).abs().max().item() / scale


# Per step, float64 against torch's float64 step: torch's own kernels may
# fuse a multiply-add where the daemon rounds twice (a last-bit difference
# per operation), so the bound is float64's precision times a margin for
# the steps it accumulates over, far below what any fp32 step could reach
# (about 1e-7).
FLOAT64_TOL = 1e-12


class Float64Parity(Base):
    """float64 parameters are stepped in float64 with float64 state, as
    torch steps them."""

    def twins64(self):
        ours = [torch.nn.Parameter(self.randn(*s).double()) for s in SHAPES]
        return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def grads64(self, ours, theirs, skip=()):
        for i, (p, q) in enumerate(zip(ours, theirs)):
            if i in skip:
                p.grad = q.grad = None
                continue
            g = self.randn(*p.shape).double() / 3  # a full double mantissa
            p.grad, q.grad = g.clone(), g.clone()

    def run64(self, cls, ref_cls, steps=40, skip_first=0, **kw):
        """Steps optimd's `cls` and `ref_cls` side by side on float64
        twins; parameter 2 gets its first gradient at step `skip_first`.
        Returns (opt, ref, ours, theirs, the worst error of any step)."""
        ours, theirs = self.twins64()
        start = [q.detach().abs().max().item() for q in theirs]
        opt = self.make(cls, ours, **kw)
        ref = ref_cls(theirs, **kw)
        worst = 0.0
        for step in range(steps):
            self.grads64(ours, theirs,
                         skip=(2,) if step < skip_first else ())
            opt.step()
            ref.step()
            for p, q, s in zip(ours, theirs, start):
                self.assertEqual(p.dtype, torch.float64)
                err = float64_err(p.detach(), q.detach(), s)
                worst = max(worst, err)
                self.assertLessEqual(err, FLOAT64_TOL,
                                     "step %d %s" % (step, kw))
        return opt, ref, ours, theirs, worst

    def test_sgd_every_option_against_torch(self):
        for kw in sgd_options():
            with self.subTest(**kw):
                opt, ref, ours, theirs, worst = self.run64(
                    SGD, torch.optim.SGD, skip_first=5, **kw)
                for p, q in zip(ours, theirs):
                    if kw["momentum"]:
                        buf = opt.state[p]["momentum_buffer"]
                        self.assertEqual(buf.dtype, torch.float64)
                        # The buffers hold sums of gradients of scale 1/3.
                        self.assertLessEqual(float64_err(
                            buf, ref.state[q]["momentum_buffer"], 1 / 3),
                            FLOAT64_TOL)
                    else:
                        self.assertEqual(dict(opt.state[p]),
                                         dict(ref.state[q]))
                print("float64 SGD momentum=%g dampening=%g nesterov=%d "
                      "wd=%g maximize=%d: worst relative error %.2e" %
                      (kw["momentum"], kw["dampening"], kw["nesterov"],
                       kw["weight_decay"], kw["maximize"], worst))

    def test_lion_against_the_reference(self):
        for wd, maximize in itertools.product((0.0, 0.1), (False, True)):
            kw = dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=wd,
                      maximize=maximize)
            with self.subTest(**kw):
                opt, ref, ours, theirs, worst = self.run64(
                    Lion, LionReference, **kw)
                for p, q in zip(ours, theirs):
                    m = opt.state[p]["exp_avg"]
                    self.assertEqual(m.dtype, torch.float64)
                    self.assertLessEqual(
                        float64_err(m, ref.state[q], 1 / 3), FLOAT64_TOL)
                print("float64 Lion wd=%g maximize=%d: worst relative error "
                      "%.2e" % (wd, maximize, worst))

    def test_float32_and_float64_in_one_group(self):
        # The daemon keeps a layout per tensor: torch's group of mixed
        # dtypes steps each in its own precision.
        for cls, ref_cls, kw in (
                (SGD, torch.optim.SGD, dict(lr=0.01, momentum=0.9)),
                (Lion, LionReference,
                 dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1))):
            with self.subTest(optimizer=cls.__name__):
                ours64, theirs64 = self.twins64()
                ours32, theirs32 = self.twins()
                opt = self.make(cls, ours32 + ours64, **kw)
                ref = ref_cls(theirs32 + theirs64, **kw)
                for _ in range(20):
                    self.grads(ours32, theirs32)
                    self.grads64(ours64, theirs64)
                    opt.step()
                    ref.step()
                self.assert_close(ours32, theirs32, 1e-5, "float32")
                for p, q in zip(ours64, theirs64):  # standard normal
                    self.assertLessEqual(float64_err(p.detach(), q.detach(),
                                                     1.0), FLOAT64_TOL)
                slot = "momentum_buffer" if cls is SGD else "exp_avg"
                self.assertEqual(opt.state[ours32[0]][slot].dtype,
                                 torch.float32)
                self.assertEqual(opt.state[ours64[0]][slot].dtype,
                                 torch.float64)

    def test_sgd_state_dicts_move_both_ways(self):
        kw = dict(lr=0.01, momentum=0.9, weight_decay=0.01)
        opt, ref, ours, theirs, _ = self.run64(SGD, torch.optim.SGD,
                                               steps=5, **kw)
        # ours -> torch: a fresh torch optimizer goes on as ours does.
        fresh = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        other = torch.optim.SGD(fresh, **kw)
        other.load_state_dict(opt.state_dict())
        self.assertEqual(
            other.state[fresh[0]]["momentum_buffer"].dtype, torch.float64)
        # torch -> ours.
        mine = [torch.nn.Parameter(q.detach().clone()) for q in theirs]
        back = self.make(SGD, mine, **kw)
        back.load_state_dict(ref.state_dict())
        for _ in range(5):
            g = [self.randn(*p.shape).double() for p in ours]
            for params in (ours, theirs, fresh, mine):
                for p, gi in zip(params, g):
                    p.grad = gi.clone()
            for o in (opt, ref, other, back):
                o.step()
        for a, b in ((fresh, theirs), (mine, theirs), (ours, theirs)):
            for p, q in zip(a, b):  # standard normal parameters
                self.assertLessEqual(
                    float64_err(p.detach(), q.detach(), 1.0), FLOAT64_TOL)

    def test_checkpoint_round_trip(self):
        # A float64 session's checkpoint holds F64 tensors: loading it
        # restores the bits, and it converts to torch's state dicts with
        # float64 state.
        from optimd.checkpoint import to_torch_state_dict
        for cls, kw, slot in (
                (SGD, dict(lr=0.01, momentum=0.9), "momentum_buffer"),
                (Lion, dict(lr=1e-3, weight_decay=0.1), "exp_avg")):
            with self.subTest(optimizer=cls.__name__):
                ours, _ = self.twins64()
                opt = self.make(cls, ours, **kw)
                for _ in range(3):
                    self.grads64(ours, ours)
                    opt.step()
                directory = tempfile.mkdtemp(prefix="optimd-f64-ckpt-")
                opt.save_checkpoint(directory)
                saved = [p.detach().clone() for p in ours]
                state = [opt.state[p][slot].clone() for p in ours]
                self.grads64(ours, ours)
                opt.step()
                opt.load_checkpoint(directory)
                for p, w, b in zip(ours, saved, state):
                    self.assertTrue(torch.equal(p.detach(), w))
                    self.assertTrue(torch.equal(opt.state[p][slot], b))
                sd, _, _ = to_torch_state_dict(
                    os.path.join(directory, "rank-0.safetensors"))
                for i, b in enumerate(state):
                    self.assertEqual(sd["state"][i][slot].dtype,
                                     torch.float64)
                    self.assertTrue(torch.equal(sd["state"][i][slot], b))

    def test_float64_state_must_stay_float64(self):
        p = [torch.nn.Parameter(self.randn(4).double())]
        for cls in (SGD, Lion):
            with self.subTest(optimizer=cls.__name__):
                with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                            "keeps float64 moments"):
                    self.make(cls, p, lr=0.01, state_dtype=torch.bfloat16)
                with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                            "no fp32 master"):
                    self.make(cls, p, lr=0.01, master_weights=True)


class DaemonRefusals(Base):
    def test_the_daemon_refuses_bad_sgd_hyperparameters(self):
        client = optimd.Client(self.daemon.address)
        client.create_session("refusals", rank=0, world_size=1)
        from optimd.v1 import optimd_pb2 as pb
        request = pb.RegisterGroupRequest(group_id="g")
        request.hyperparameters.optimizer = pb.OPTIMIZER_KIND_SGD
        request.hyperparameters.lr = 0.1
        request.hyperparameters.nesterov = True
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.register_group(request)
        self.assertIn("nesterov", str(e.exception))
        request.hyperparameters.optimizer = 9
        with self.assertRaises(optimd.InvalidArgumentError) as e:
            client.register_group(request)
        self.assertIn("unknown optimizer", str(e.exception))
        client.close_session()
        client.close()


if __name__ == "__main__":
    unittest.main()
