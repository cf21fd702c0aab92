"""optimd.torch.AdamW side by side with torch.optim.AdamW where a training
script touches what torch's optimizer leaves to it: gradient tensors the
trainer owns, zero_grad over edited param_groups, parameter memory shared
with other tensors. Each test runs the same script through both and asserts
the same result (or the same exception).

The real daemon (CPU backend) over its socket, real shared memory.
"""
import os
import tempfile
import unittest

import torch

from optimd.testing import DaemonTestCase
from optimd.torch import AdamW

os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# Per step, AdamW's numerics agree with torch's to float32 rounding.
TOL = dict(rtol=1e-5, atol=1e-6)


class DropIn(DaemonTestCase):
    def both(self, make_params, **kw):
        """(ours, theirs): optimd's and torch's AdamW, each over its own
        copy of make_params()'s parameters (the same values)."""
        torch.manual_seed(0)
        ours = make_params()
        torch.manual_seed(0)
        theirs = make_params()
        opt = AdamW(ours, address=self.daemon.address, **kw)
        self.opts.append(opt)
        return opt, torch.optim.AdamW(theirs, **kw)

    def assert_same(self, opt, ref):
        for g, h in zip(opt.param_groups, ref.param_groups):
            for p, q in zip(g["params"], h["params"]):
                torch.testing.assert_close(p.detach(), q.detach(), **TOL)

    def test_gradients_in_a_buffer_of_the_trainers_stay_there(self):
        # A trainer that keeps every gradient in one flat buffer of its own
        # (p.grad = a view of it) and clears that buffer itself.
        shapes = [(4, 3), (5,), (2, 2)]

        def params():
            return [torch.nn.Parameter(torch.randn(s)) for s in shapes]

        opt, ref = self.both(params, lr=1e-2, weight_decay=0.1)
        runs = []
        for o in (opt, ref):
            ps = o.param_groups[0]["params"]
            flat = torch.zeros(sum(p.numel() for p in ps))
            offset = 0
            for p in ps:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            runs.append((o, ps, flat))
        for step in range(4):
            for o, ps, flat in runs:
                flat.zero_()
                torch.manual_seed(step)
                sum((p * torch.randn(p.shape)).sum() for p in ps).backward()
                o.step()
                # The gradients are still views of the trainer's buffer.
                self.assertEqual(ps[1].grad.data_ptr(),
                                 flat.data_ptr() + 12 * 4)
        self.assert_same(opt, ref)
        torch.testing.assert_close(runs[0][2], runs[1][2])

    def test_autograds_own_gradients_are_taken_into_shared_memory(self):
        # What autograd made and nobody holds becomes the tensor's view of
        # the shared gradient segment: later backwards accumulate there and
        # the step copies nothing (the CPU backend's fast path).
        def params():
            return [torch.nn.Parameter(torch.randn(5, 2))]

        opt, ref = self.both(params, lr=1e-2)
        p = opt.param_groups[0]["params"][0]
        segment = opt._groups[0]["tensors"][0].gview
        for _ in range(2):
            for o in (opt, ref):
                (o.param_groups[0]["params"][0] ** 2).sum().backward()
                o.step()
                o.zero_grad(set_to_none=False)
            self.assertEqual(p.grad.data_ptr(), segment.data_ptr())
        self.assert_same(opt, ref)

    def test_a_gradient_the_trainer_keeps_is_zeroed_in_place(self):
        def params():
            return [torch.nn.Parameter(torch.randn(6))]

        opt, ref = self.both(params, lr=1e-2)
        held = []
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            p.grad = torch.ones(6)
            held.append(p.grad)
            o.step()
            o.zero_grad(set_to_none=False)
            self.assertIs(p.grad, held[-1])
        torch.testing.assert_close(held[0], torch.zeros(6))
        self.assert_same(opt, ref)

    def test_detach_and_zero_a_gradient_as_in_torch(self):
        # Older training loops clear gradients by hand.
        def params():
            return [torch.nn.Parameter(torch.randn(3, 3))]

        opt, ref = self.both(params, lr=1e-2)
        for o in (opt, ref):
            p = o.param_groups[0]["params"][0]
            for _ in range(3):
                (p * p).sum().backward()
                o.step()
                o.zero_grad(set_to_none=False)
                p.grad.detach_()
                p.grad.zero_()
        self.assert_same(opt, ref)

    def test_zero_grad_acts_on_the_param_groups_as_they_are_now(self):
        def params():
            return [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]

        opt, ref = self.both(params, lr=1e-2)
        for set_to_none in (True, False):
            seen = []
            for o in (opt, ref):
                ps = o.param_groups[0]["params"]
                for p in ps:
                    p.grad = torch.ones(4)
                o.step()
                removed = ps.pop()  # taken out of the group
                added = torch.nn.Parameter(torch.ones(2))
                added.grad = torch.ones(2)
                ps.append(added)
                o.zero_grad(set_to_none=set_to_none)
                seen.append([None if p.grad is None else p.grad.tolist()
                             for p in (ps[0], removed, added)])
                ps.pop()
                ps.append(removed)
            self.assertEqual(seen[0], seen[1], set_to_none)


if __name__ == "__main__":
    unittest.main()
