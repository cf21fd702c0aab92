"""Inf and NaN gradients, side by side with torch (CPU backend).

By default optimd.torch's optimizers apply a non-finite gradient as torch's
own do: it reaches the update, and with max_grad_norm it is clipped as
torch.nn.utils.clip_grad_norm_(error_if_nonfinite=False) clips it (a NaN
norm makes every gradient NaN, an infinite one multiplies them by 0).
skip_nonfinite=True skips such a step instead. Inputs are fresh random
values each run; the seed is printed.
"""
import math
import os
import random
import tempfile
import unittest

import torch

from optimd.testing import DaemonTestCase
from optimd.torch import SGD, Adam, AdamW, Lion

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(37,), (16, 33), (5,), (3, 4, 7)]
BAD_STEP = 3
STEPS = 7


class LionReference:
    """Lion as lion-pytorch writes it, in torch ops. Its sign is torch's
    (this torch's sign of NaN is 0, as the daemon's is: the momentum turns
    NaN, the weight moves by 0 there)."""

    def __init__(self, params, lr, betas=(0.9, 0.99), weight_decay=0.0):
        self.params = list(params)
        self.lr, self.betas, self.wd = lr, betas, weight_decay
        self.state = {}

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p in self.params:
            m = self.state.setdefault(p, torch.zeros_like(p))
            p.mul_(1 - self.lr * self.wd)
            update = m.clone().mul_(b1).add(p.grad, alpha=1 - b1).sign_()
            p.add_(update, alpha=-self.lr)
            m.mul_(b2).add_(p.grad, alpha=1 - b2)


# optimd's class, its torch peer and the keywords both take.
PAIRS = {
    "adamw": (AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    # eps 1e-3: clip_grad_norm_'s float32 norm and the daemon's float64 one
    # give coefficients an ulp or two apart; where Adam's L2 term nearly
    # cancels the clipped gradient, a first step of lr*g/(|g|+1e-8) would
    # magnify that into 2e-6 of the tensor's scale (seeds 528, 531).
    "adam": (Adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.01,
                                           eps=1e-3)),
    "sgd": (SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9,
                                       weight_decay=0.01)),
    "lion": (Lion, LionReference, dict(lr=1e-3, weight_decay=0.1)),
}


class NonFiniteGradients(DaemonTestCase):
    seed = SEED

    def make(self, cls, params, **kw):
        opt = cls(params, address=self.daemon.address,
                  job_id="t%d" % len(self.opts) + self.id(), **kw)
        self.opts.append(opt)
        return opt

    def twins(self):
        ours = [torch.nn.Parameter(torch.randn(*s, generator=self.gen))
                for s in SHAPES]
        return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def assert_same(self, ours, theirs, what):
        """The same non-finite elements (NaN where torch has NaN, the same
        infinities) and the finite ones within 1e-6 of the tensor's
        scale."""
        for i, (p, q) in enumerate(zip(ours, theirs)):
            a, b = p.detach().double(), q.detach().double()
            self.assertTrue(torch.equal(a.isnan(), b.isnan()),
                            "%s: tensor %d NaN where torch's is not" %
                            (what, i))
            finite = b.isfinite()
            self.assertTrue(torch.equal(a.isfinite(), finite), what)
            self.assertTrue(torch.equal(a[b.isinf()], b[b.isinf()]), what)
            if finite.any():
                scale = b[finite].abs().max().clamp_min(1e-30)
                err = ((a[finite] - b[finite]).abs().max() / scale).item()
                self.assertLessEqual(err, 1e-6, "%s: tensor %d" % (what, i))

    def run_pair(self, kind, bad, max_grad_norm):
        """STEPS steps of optimd and its torch peer on the same gradients,
        one of them (BAD_STEP) holding `bad` in one element; with
        `max_grad_norm`, torch clips with clip_grad_norm_ before its step.
        Returns optimd's optimizer."""
        ours_cls, torch_cls, kw = PAIRS[kind]
        ours, theirs = self.twins()
        opt = self.make(ours_cls, ours, max_grad_norm=max_grad_norm, **kw)
        ref = torch_cls(theirs, **kw)
        what = "%s bad=%s max_grad_norm=%s" % (kind, bad, max_grad_norm)
        for step in range(STEPS):
            for p, q in zip(ours, theirs):
                g = torch.randn(*p.shape, generator=self.gen)
                p.grad, q.grad = g.clone(), g.clone()
            if step == BAD_STEP:
                ours[1].grad.view(-1)[7] = bad
                theirs[1].grad.view(-1)[7] = bad
            if max_grad_norm:
                norm = torch.nn.utils.clip_grad_norm_(theirs, max_grad_norm)
            opt.step()
            ref.step()
            self.assertFalse(opt.skipped, what)
            if max_grad_norm:
                # The norm as torch has it: NaN, inf or the same number.
                n = norm.item()
                if math.isfinite(n):
                    self.assertLessEqual(abs(opt.grad_norm - n), 1e-6 * n)
                else:
                    self.assertEqual(math.isnan(opt.grad_norm), math.isnan(n))
                    self.assertEqual(math.isinf(opt.grad_norm), math.isinf(n))
            self.assert_same(ours, theirs, "%s step %d" % (what, step))
        return opt

    def test_nan_and_inf_reach_the_weights_as_in_torch(self):
        for kind in PAIRS:
            for bad in (float("nan"), float("inf"), float("-inf")):
                with self.subTest(kind=kind, bad=bad):
                    opt = self.run_pair(kind, bad, 0.0)
                    # No statistics pass without clipping: no norm.
                    self.assertTrue(math.isnan(opt.grad_norm))

    def test_clipping_a_non_finite_norm_as_clip_grad_norm_does(self):
        # A NaN norm: the clip coefficient is NaN and every stepped
        # parameter becomes NaN. An infinite norm: the coefficient is 0, the
        # finite gradients become 0 (decay and momentum still move the
        # weights) and the infinite elements NaN.
        for kind in PAIRS:
            for bad in (float("nan"), float("inf")):
                with self.subTest(kind=kind, bad=bad):
                    self.run_pair(kind, bad, 1.0)

    def test_skip_nonfinite_skips_the_step(self):
        for kind, (cls, _, kw) in PAIRS.items():
            for clip in (0.0, 1.0):
                with self.subTest(kind=kind, max_grad_norm=clip):
                    ps, _ = self.twins()
                    opt = self.make(cls, ps, skip_nonfinite=True,
                                    max_grad_norm=clip, **kw)
                    for p in ps:
                        p.grad = torch.randn(*p.shape, generator=self.gen)
                    opt.step()
                    self.assertFalse(opt.skipped)
                    self.assertTrue(math.isfinite(opt.grad_norm))
                    before = [p.detach().clone() for p in ps]
                    state = {k: v.clone() for k, v in opt.state[ps[0]].items()
                             if torch.is_tensor(v)}
                    for bad in (float("nan"), float("inf")):
                        ps[1].grad.view(-1)[7] = bad
                        opt.step()
                        self.assertTrue(opt.skipped)
                        for p, b in zip(ps, before):
                            self.assertTrue(torch.equal(p.detach(), b))
                        for k, v in opt.state[ps[0]].items():
                            if torch.is_tensor(v):
                                self.assertTrue(torch.equal(v, state[k]), k)

    def test_assume_finite_is_refused_with_its_successor_named(self):
        p = torch.nn.Parameter(torch.zeros(3))
        with self.assertRaises(TypeError) as e:
            AdamW([p], address=self.daemon.address, assume_finite=True)
        self.assertIn("skip_nonfinite", str(e.exception))


if __name__ == "__main__":
    unittest.main()
