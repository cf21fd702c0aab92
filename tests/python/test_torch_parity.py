"""The optimizer's numerics against PyTorch's own AdamW and Adam.

Every test drives the real daemon (CPU backend) over its socket through
optimd.torch.AdamW, side by side with torch.optim on the same data. Inputs
are fresh random values each run; the seed is printed.
"""
import itertools
import math
import os
import random
import unittest

import tempfile

import torch

import optimd
from optimd.testing import DaemonTestCase
from optimd.torch import AdamW

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

SHAPES = [(37,), (16, 33), (5,), (3, 4, 7)]


def _as_grad(p, g):
    """A fresh gradient for `p` holding `g`, as autograd would set it."""
    return g.detach().to(device=p.device, dtype=p.dtype).reshape(
        p.shape).clone()


def rel_err(a, b, step_size=0.0):
    """max_i |a_i - b_i| / max(max_i |b_i|, step_size): the largest element
    error relative to the tensor's scale, or to one update's size where the
    tensor is smaller than that (a one-element bias crossing zero has no
    scale of its own: there the update's last bits are what differ).

    An element-by-element ratio is meaningless where a parameter crosses zero
    (a one-ulp difference in the operands of p - update is then an arbitrary
    multiple of the tiny result), and torch's own CPU kernels are not
    consistent to the ulp within one tensor: ATen's vectorized
    add_(alpha=...) is a fused multiply-add while its scalar tail is not.
    """
    a = a.double()
    b = b.double()
    scale = b.abs().max().clamp_min(max(step_size, 1e-30))
    return ((a - b).abs().max() / scale).item()


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32
                               else torch.int16)


class DaemonTest(DaemonTestCase):
    seed = SEED

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(*shape, generator=self.gen).to(dtype)

    def twin_params(self):
        """Random parameters of SHAPES, and a copy of them for torch."""
        ours = [torch.nn.Parameter(self.randn(*s)) for s in SHAPES]
        return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def same_grads(self, ours, theirs, scale=1.0, ours_factor=1.0):
        """Fresh random gradients (times `scale`), the same for both lists;
        ours get them times `ours_factor` (a loss scale optimd divides out)."""
        for p, q in zip(ours, theirs):
            g = self.randn(*p.shape) * scale
            p.grad = _as_grad(p, g * ours_factor)
            q.grad = g.clone()

    def optimd(self, params, **kw):
        opt = AdamW(params, address=self.daemon.address,
                    job_id="t%d" % len(self.opts) + self.id(), **kw)
        self.opts.append(opt)
        return opt


class ParityWithTorch(DaemonTest):
    def run_pair(self, mode, weight_decay, amsgrad, maximize, schedule,
                 steps=200):
        torch_cls = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
        ours, theirs = self.twin_params()
        kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                  weight_decay=weight_decay, amsgrad=amsgrad,
                  maximize=maximize)
        opt = self.optimd(ours, adam_w_mode=(mode == "adamw"), **kw)
        ref = torch_cls(theirs, **kw)
        scheds = []
        if schedule:
            scheds = [torch.optim.lr_scheduler.StepLR(o, 7, gamma=0.8)
                      for o in (opt, ref)]
        worst = 0.0
        for step in range(steps):
            self.same_grads(ours, theirs)
            opt.step()
            ref.step()
            for s in scheds:
                s.step()
            self.assertFalse(opt.skipped)
            for p, q in zip(ours, theirs):
                err = rel_err(p.detach(), q.detach())
                worst = max(worst, err)
                self.assertLessEqual(
                    err, 1e-6, "step %d %s wd=%g amsgrad=%s maximize=%s" %
                    (step, mode, weight_decay, amsgrad, maximize))
        # The moments agree too.
        for p, q in zip(ours, theirs):
            for k in ("exp_avg", "exp_avg_sq") + (
                    ("max_exp_avg_sq",) if amsgrad else ()):
                self.assertLessEqual(
                    rel_err(opt.state[p][k], ref.state[q][k]), 1e-5, k)
            self.assertEqual(int(opt.state[p]["step"]), steps)
        return worst

    def test_every_combination(self):
        for mode, wd, ams, maxi in itertools.product(
                ("adamw", "adam"), (0.0, 0.05), (False, True), (False, True)):
            with self.subTest(mode=mode, wd=wd, amsgrad=ams, maximize=maxi):
                worst = self.run_pair(mode, wd, ams, maxi, schedule=False)
                print("%s wd=%g amsgrad=%d maximize=%d: worst relative "
                      "error %.2e" % (mode, wd, ams, maxi, worst))

    def test_lr_scheduler_drives_the_daemon(self):
        for mode in ("adamw", "adam"):
            with self.subTest(mode=mode):
                self.run_pair(mode, 0.01, False, False, schedule=True)


class Float64(DaemonTest):
    """float64 parameters are stepped in float64, as torch steps them."""

    def float64_twins(self):
        ours = [torch.nn.Parameter(self.randn(*s).double()) for s in SHAPES]
        return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def test_float64_matches_torch_every_step(self):
        for mode, ams, maxi in itertools.product(
                ("adamw", "adam"), (False, True), (False, True)):
            with self.subTest(mode=mode, amsgrad=ams, maximize=maxi):
                torch_cls = (torch.optim.AdamW if mode == "adamw"
                             else torch.optim.Adam)
                ours, theirs = self.float64_twins()
                kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                          weight_decay=0.05, amsgrad=ams, maximize=maxi)
                opt = self.optimd(ours, adam_w_mode=(mode == "adamw"), **kw)
                ref = torch_cls(theirs, **kw)
                worst = 0.0
                for step in range(100):
                    for p, q in zip(ours, theirs):
                        g = self.randn(*p.shape, dtype=torch.float64)
                        p.grad, q.grad = g.clone(), g.clone()
                    opt.step()
                    ref.step()
                    for p, q in zip(ours, theirs):
                        self.assertEqual(p.dtype, torch.float64)
                        err = rel_err(p.detach(), q.detach())
                        worst = max(worst, err)
                        self.assertLessEqual(err, 1e-12, "step %d" % step)
                for p, q in zip(ours, theirs):
                    for k, v in ref.state[q].items():
                        if k == "step":
                            continue
                        self.assertEqual(opt.state[p][k].dtype, torch.float64)
                        self.assertLessEqual(rel_err(opt.state[p][k], v),
                                             1e-12, k)
                print("float64 %s amsgrad=%d maximize=%d: worst relative "
                      "error %.2e" % (mode, ams, maxi, worst))

    def test_float32_and_float64_groups_side_by_side(self):
        ours64, theirs64 = self.float64_twins()
        ours32, theirs32 = self.twin_params()
        opt = self.optimd([{"params": ours32}, {"params": ours64}], lr=1e-2)
        ref = torch.optim.AdamW([{"params": theirs32}, {"params": theirs64}],
                                lr=1e-2)
        for step in range(50):
            for p, q in zip(ours32 + ours64, theirs32 + theirs64):
                g = self.randn(*p.shape, dtype=p.dtype)
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            for p, q in zip(ours32, theirs32):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-6)
            for p, q in zip(ours64, theirs64):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-12)
        self.assertEqual(opt.state[ours32[0]]["exp_avg"].dtype, torch.float32)
        self.assertEqual(opt.state[ours64[0]]["exp_avg"].dtype, torch.float64)

    def test_float64_state_dict_crosses_to_torch_and_back(self):
        ours, theirs = self.float64_twins()
        opt = self.optimd(ours, lr=1e-2)
        for _ in range(5):
            for p in ours:
                p.grad = self.randn(*p.shape, dtype=torch.float64)
            opt.step()
        # Into torch: its state dict is float64 as torch's own would be.
        with torch.no_grad():
            for p, q in zip(ours, theirs):
                q.copy_(p)
        ref = torch.optim.AdamW(theirs, lr=1e-2)
        ref.load_state_dict(opt.state_dict())
        # And back into a new optimd optimizer.
        again = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        opt2 = self.optimd(again, lr=1e-2)
        opt2.load_state_dict(ref.state_dict())
        for _ in range(5):
            for p, q, r in zip(ours, theirs, again):
                g = self.randn(*p.shape, dtype=torch.float64)
                p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
            for o in (opt, ref, opt2):
                o.step()
        for p, q, r in zip(ours, theirs, again):
            self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-12)
            self.assertTrue(torch.equal(p.detach(), r.detach()))

    def test_float64_refusals_are_clear(self):
        p = torch.nn.Parameter(self.randn(4).double())
        with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                    "keeps float64 moments"):
            self.optimd([p], exp_avg_dtype=torch.bfloat16)
        with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                    "no fp32 master"):
            self.optimd([p], master_weights=True)


class Precisions(DaemonTest):
    def test_low_precision_params_with_fp32_master(self):
        for dtype in (torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                start = [self.randn(*s).to(dtype) for s in SHAPES]
                ours = [torch.nn.Parameter(t.clone()) for t in start]
                theirs = [torch.nn.Parameter(t.float()) for t in start]
                opt = self.optimd(ours, lr=1e-2)
                ref = torch.optim.AdamW(theirs, lr=1e-2)
                for step in range(200):
                    for p, q in zip(ours, theirs):
                        g = self.randn(*p.shape, dtype=dtype)
                        p.grad = _as_grad(p, g)
                        q.grad = g.float()
                    opt.step()
                    ref.step()
                    for p, q in zip(ours, theirs):
                        master = opt.state[p]["master"]
                        self.assertLessEqual(rel_err(master, q.detach()), 1e-6)
                        # The parameter is the master rounded to nearest even.
                        self.assertTrue(torch.equal(
                            bits(p.detach()), bits(master.to(dtype))))

    def test_remainders_equal_fp32_master_bit_for_bit(self):
        start = [self.randn(*s, dtype=torch.bfloat16) for s in SHAPES]
        a = [torch.nn.Parameter(t.clone()) for t in start]
        b = [torch.nn.Parameter(t.clone()) for t in start]
        opt_a = self.optimd(a, lr=1e-3)
        opt_b = self.optimd(b, lr=1e-3, store_param_remainders=True)
        ties = 0
        for step in range(500):
            for p, q in zip(a, b):
                g = self.randn(*p.shape, dtype=torch.bfloat16)
                p.grad = _as_grad(p, g)
                q.grad = _as_grad(q, g)
            opt_a.step()
            opt_b.step()
            for p, q in zip(a, b):
                ma, mb = opt_a.state[p]["master"], opt_b.state[q]["master"]
                self.assertTrue(torch.equal(bits(ma), bits(mb)),
                                "masters differ at step %d" % step)
                diff = bits(p.detach()) != bits(q.detach())
                if diff.any():
                    # Only exact ties between two bf16 values may round
                    # differently (see README: Layouts).
                    low = bits(ma)[diff] & 0xFFFF
                    self.assertTrue(bool((low == 0x8000).all()))
                    ties += int(diff.sum())
        print("remainder vs fp32 master: 500 steps, masters bit-identical, "
              "%d tie roundings" % ties)

    def test_bf16_moments_stay_close(self):
        ours, theirs = self.twin_params()
        opt = self.optimd(ours, lr=1e-3, exp_avg_dtype=torch.bfloat16)
        ref = torch.optim.AdamW(theirs, lr=1e-3)
        for _ in range(50):
            self.same_grads(ours, theirs)
            opt.step()
            ref.step()
        for p, q in zip(ours, theirs):
            self.assertEqual(opt.state[p]["exp_avg"].dtype, torch.bfloat16)
            self.assertLess((p.detach() - q.detach()).abs().max().item(), 1e-3)

    def test_keep_fp32_frozen_and_empty(self):
        w = torch.nn.Parameter(self.randn(8, 4, dtype=torch.bfloat16))
        norm = torch.nn.Parameter(self.randn(4))
        frozen = torch.nn.Parameter(self.randn(6), requires_grad=False)
        empty = torch.nn.Parameter(torch.empty(0))
        norm_ref = torch.nn.Parameter(norm.detach().clone())
        opt = self.optimd([w, norm, frozen, empty], lr=1e-2,
                          master_weights=True, keep_fp32=[norm])
        ref = torch.optim.AdamW([norm_ref], lr=1e-2)
        frozen_before = frozen.detach().clone()
        for _ in range(20):
            w.grad = _as_grad(w, self.randn(8, 4, dtype=torch.bfloat16))
            g = self.randn(4)
            norm.grad = _as_grad(norm, g)
            norm_ref.grad = g.clone()
            opt.step()
            ref.step()
        self.assertLessEqual(rel_err(norm.detach(), norm_ref.detach()), 1e-6)
        self.assertTrue(torch.equal(frozen.detach(), frozen_before))
        self.assertNotIn(frozen, opt.state)
        self.assertEqual(empty.numel(), 0)
        self.assertEqual(opt.state[empty]["exp_avg"].numel(), 0)

    def test_empty_group_still_counts_steps(self):
        p = torch.nn.Parameter(self.randn(3))
        opt = self.optimd([{"params": [p]},
                           {"params": [torch.nn.Parameter(torch.empty(0))]}])
        for _ in range(3):
            p.grad = _as_grad(p, self.randn(3))
            opt.step()
        steps = {g.group_id: g.step for g in opt.client.get_state().groups}
        self.assertEqual(steps, {"0": 3, "1": 3})


class GradientHandling(DaemonTest):
    def test_skip_nonfinite_skips_everything(self):
        ps = [torch.nn.Parameter(self.randn(*s)) for s in SHAPES]
        opt = self.optimd([{"params": ps[:2]}, {"params": ps[2:]}],
                          skip_nonfinite=True)
        for p in ps:
            p.grad = _as_grad(p, self.randn(*p.shape))
        opt.step()
        before = [p.detach().clone() for p in ps]
        state_before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
        for bad in (float("inf"), float("-inf"), float("nan")):
            ps[3].grad.view(-1)[5] = bad
            opt.step()
            self.assertTrue(opt.skipped)
            for p, b in zip(ps, before):
                self.assertTrue(torch.equal(p.detach(), b))
            for k, v in opt.state[ps[0]].items():
                self.assertTrue(torch.equal(v, state_before[k]), k)
        ps[3].grad.view(-1)[5] = 0.0
        opt.step()
        self.assertFalse(opt.skipped)
        self.assertEqual(int(opt.state[ps[0]]["step"]), 2)

    def test_grad_scale_divides_gradients(self):
        ours, theirs = self.twin_params()
        opt = self.optimd(ours, lr=1e-2)
        opt.grad_scale = 1024.0
        ref = torch.optim.AdamW(theirs, lr=1e-2)
        for _ in range(30):
            self.same_grads(ours, theirs, ours_factor=1024.0)
            opt.step()
            ref.step()
            for p, q in zip(ours, theirs):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-6)

    def test_clipping_matches_clip_grad_norm(self):
        ours, theirs = self.twin_params()
        opt = self.optimd([{"params": ours[:2]}, {"params": ours[2:]}],
                          lr=1e-2, max_grad_norm=1.5)
        ref = torch.optim.AdamW([{"params": theirs[:2]},
                                 {"params": theirs[2:]}], lr=1e-2)
        for step in range(50):
            scale = 0.05 if step % 2 else 3.0  # below and above the maximum
            self.same_grads(ours, theirs, scale=scale)
            norm = torch.nn.utils.clip_grad_norm_(theirs, 1.5)
            opt.step()
            ref.step()
            self.assertLessEqual(abs(opt.grad_norm - norm.item()),
                                 1e-6 * norm.item())
            for p, q in zip(ours, theirs):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-6)

    def test_by_default_no_check_and_torchs_math(self):
        ours, theirs = self.twin_params()
        opt = self.optimd(ours, lr=1e-2)
        ref = torch.optim.AdamW(theirs, lr=1e-2)
        for _ in range(20):
            self.same_grads(ours, theirs)
            opt.step()
            ref.step()
            self.assertFalse(opt.skipped)
            self.assertTrue(math.isnan(opt.grad_norm))  # no statistics pass
            for p, q in zip(ours, theirs):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-6)
        # As in torch, the daemon does not look: a NaN is applied instead of
        # skipping the step (test_nonfinite.py compares it with torch).
        ours[0].grad.view(-1)[0] = float("nan")
        opt.step()
        self.assertFalse(opt.skipped)
        self.assertTrue(torch.isnan(ours[0].detach().view(-1)[0]))
        # With max_grad_norm the statistics pass runs again; the NaN norm
        # clips every gradient to NaN, as clip_grad_norm_ does.
        opt.max_grad_norm = 1.0
        opt.step()
        self.assertFalse(opt.skipped)
        self.assertTrue(math.isnan(opt.grad_norm))
        for p in ours:
            self.assertTrue(torch.isnan(p.detach()).all())


class GradientsWhereAutogradPutsThem(DaemonTest):
    """zero_grad both ways, parameters without gradients and gradients that
    move between steps, each against torch.optim.AdamW step by step."""

    def moe_twins(self):
        """A small mixture of experts: a router picks one of two experts per
        step; returns (ours, theirs), each (model, experts)."""
        def build():
            torch.manual_seed(SEED)
            shared = torch.nn.Linear(6, 6)
            experts = torch.nn.ModuleList(
                [torch.nn.Linear(6, 1) for _ in range(3)])
            return torch.nn.ModuleDict(dict(shared=shared, experts=experts))
        return build(), build()

    def run_twins(self, steps, zero, pick, **kw):
        """Trains both twins for `steps`; zero(step) -> set_to_none for that
        step's zero_grad, pick(step) -> the expert used. The torch twin
        takes our gradients (or None where we have none), so the comparison
        measures the optimizers alone. Compares after every step."""
        ours, theirs = self.moe_twins()
        opt = self.optimd(list(ours.parameters()), lr=1e-2,
                          weight_decay=0.1, **kw)
        ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2,
                                weight_decay=0.1)
        x = self.randn(8, 6)
        for step in range(steps):
            opt.zero_grad(set_to_none=zero(step))
            ref.zero_grad(set_to_none=zero(step))
            h = torch.tanh(ours["shared"](x))
            ours["experts"][pick(step)](h).square().mean().backward()
            for p, q in zip(ours.parameters(), theirs.parameters()):
                if p.grad is None:
                    self.assertIsNone(q.grad)  # torch's zero_grad agrees
                else:
                    q.grad = p.grad.clone()
            opt.step()
            ref.step()
            for (name, p), q in zip(ours.named_parameters(),
                                    theirs.parameters()):
                self.assertLessEqual(
                    rel_err(p.detach(), q.detach(), step_size=1e-2), 1e-6,
                    "%s at step %d" % (name, step))
                self.assertEqual(p.grad is None, q.grad is None, name)
        return opt, ref

    def test_set_to_none_both_ways(self):
        self.run_twins(8, zero=lambda s: s % 3 != 1, pick=lambda s: 0)

    def test_parameter_without_gradient_is_not_stepped(self):
        # Experts 1 and 2 get no gradient until steps 4 and 6: torch leaves
        # them alone (no decay, no moments), and so must the daemon.
        opt, _ = self.run_twins(4, zero=lambda s: True, pick=lambda s: 0)
        fresh, _ = self.moe_twins()
        trained = opt.param_groups[0]["params"]
        # Parameters: shared (0, 1), then experts 0 (2, 3), 1 and 2 (4-7).
        for i, (p, q) in enumerate(zip(trained, fresh.parameters())):
            self.assertEqual(torch.equal(p.detach(), q.detach()), i >= 4, i)

    def test_unused_expert_returns(self):
        # Expert 1 is used at steps 0-2, unused at 3-5 (its .grad None
        # after zero_grad), used again from step 6; expert 0 only at 3-5.
        # torch counts steps per parameter (bias correction), so must we,
        # and the state dicts agree on every parameter's step.
        opt, ref = self.run_twins(
            10, zero=lambda s: True, pick=lambda s: 1 if s < 3 or s >= 6
            else 0)
        ours = {i: float(v["step"])
                for i, v in opt.state_dict()["state"].items()}
        theirs = {i: float(v["step"])
                  for i, v in ref.state_dict()["state"].items()}
        self.assertEqual(ours, theirs)
        # shared: 10 steps (2 tensors), expert 0: 3, expert 1: 7.
        self.assertEqual(sorted(ours.values()),
                         [3.0, 3.0, 7.0, 7.0, 10.0, 10.0])

    def test_moved_gradient_storage(self):
        # Gradients replaced by new tensors between steps (as a gradient
        # hook or a trainer's own accumulation might do), mixed with
        # in-place accumulation: the daemon reads whatever .grad holds.
        ours, theirs = self.twin_params()
        opt = self.optimd(ours, lr=1e-2)
        ref = torch.optim.AdamW(theirs, lr=1e-2)
        for step in range(6):
            for p, q in zip(ours, theirs):
                g = self.randn(*p.shape)
                if step % 2 and p.grad is not None:
                    p.grad.add_(g)
                    q.grad.add_(g)
                else:
                    p.grad = g.clone()
                    q.grad = g.clone()
            opt.step()
            ref.step()
            for p, q in zip(ours, theirs):
                self.assertLessEqual(rel_err(p.detach(), q.detach()), 1e-6)


class BadInput(DaemonTest):
    def test_remainders_need_bf16_parameters(self):
        p = torch.nn.Parameter(self.randn(4))
        with self.assertRaises(optimd.InvalidArgumentError) as cm:
            self.optimd([("encoder.weight", p)], store_param_remainders=True)
        self.assertIn("encoder.weight", str(cm.exception))
        self.assertIn("bfloat16", str(cm.exception))

    def test_master_none_needs_fp32(self):
        p = torch.nn.Parameter(self.randn(4, dtype=torch.float16))
        with self.assertRaises(optimd.InvalidArgumentError) as cm:
            self.optimd([("h", p)], master_weights=False)
        self.assertIn("'h'", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
