"""AdamW with block8 moments (exp_avg_dtype=optimd.torch.BLOCK8) through the
real daemon (CPU backend): close to torch.optim.AdamW, fp32 state dicts
both ways, checkpoints converted to torch's format, and refusals.
Inputs are fresh random values each run; the seed is printed.
"""
import os
import random
import shutil
import tempfile
import unittest

import torch

import optimd
from optimd.checkpoint import block8_values, to_torch_state_dict
from optimd.testing import DaemonTestCase
from optimd.torch import BLOCK8, SGD, AdamW, Lion

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

# A partial block, several blocks, a single element.
SHAPES = [(37,), (16, 33), (1,), (3, 300)]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


class Block8Test(DaemonTestCase):
    seed = SEED

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="optimd-block8-")

    def tearDown(self):
        super().tearDown()
        shutil.rmtree(self.dir, ignore_errors=True)

    def params(self, dtype=torch.float32):
        return [torch.nn.Parameter(torch.randn(*s, generator=self.gen)
                                   .to(dtype)) for s in SHAPES]

    def make(self, cls, params, **kw):
        opt = cls(params, address=self.daemon.address,
                  job_id="b%d" % len(self.opts) + self.id(), **kw)
        self.opts.append(opt)
        return opt

    def step(self, opts_params, grads):
        for opt, params in opts_params:
            for p, g in zip(params, grads):
                p.grad = g.to(p.dtype).clone()
            opt.step()

    def grads(self):
        return [torch.randn(*s, generator=self.gen) for s in SHAPES]

    def test_close_to_torch_adamw(self):
        ours = self.params()
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        opt = self.make(AdamW, ours, lr=1e-2, weight_decay=0.01,
                        exp_avg_dtype=BLOCK8)
        ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.01)
        for _ in range(20):
            self.step([(opt, ours), (ref, theirs)], self.grads())
            self.assertFalse(opt.skipped)
        for p, q in zip(ours, theirs):
            # 20 steps of 1e-2 against weights of about 1: block8 moments
            # change step sizes by a few percent.
            self.assertLessEqual(rel_err(p.detach(), q.detach()), 2e-2)
            self.assertEqual(opt.state[p]["exp_avg"].dtype, torch.float32)
            # Each store rounds exp_avg to 3 mantissa bits (1/16), and the
            # running average carries about 1 / (1 - beta1) such errors.
            self.assertLessEqual(
                rel_err(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]),
                0.25)

    def test_state_dict_is_fp32_and_loads_bit_exact(self):
        a, b = self.params(torch.bfloat16), None
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        kw = dict(lr=1e-2, store_param_remainders=True, exp_avg_dtype=BLOCK8)
        opt_a = self.make(AdamW, a, **kw)
        for _ in range(3):
            self.step([(opt_a, a)], self.grads())
        sd = opt_a.state_dict()
        for entry in sd["state"].values():
            self.assertEqual(entry["exp_avg"].dtype, torch.float32)
            self.assertEqual(entry["exp_avg_sq"].dtype, torch.float32)
        opt_b = self.make(AdamW, b, **kw)
        opt_b.load_state_dict(sd)
        for p, q in zip(a, b):
            q.data.copy_(p.data)
        # Values read back from block8 quantize to themselves, and the
        # masters travel exactly: both continue with the same bits.
        for _ in range(3):
            g = self.grads()
            self.step([(opt_a, a), (opt_b, b)], g)
        for p, q in zip(a, b):
            self.assertTrue(torch.equal(p.detach(), q.detach()))
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(opt_a.state[p][k],
                                            opt_b.state[q][k]))

    def test_checkpoint_converts_to_the_state_dict(self):
        ours = self.params()
        opt = self.make(AdamW, ours, lr=1e-2, exp_avg_dtype=BLOCK8)
        for _ in range(3):
            self.step([(opt, ours)], self.grads())
        path = opt.save_checkpoint(self.dir).path
        sd, _, _ = to_torch_state_dict(
            path, {"%d" % i: p.shape for i, p in enumerate(ours)})
        mine = opt.state_dict()["state"]
        for i, p in enumerate(ours):
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(
                    sd["state"][i][k].reshape(-1),
                    mine[i][k].reshape(-1)), k)

    def test_block8_values_decode_the_codes(self):
        codes = torch.tensor([0x78, 0xF8, 0x01, 0x00, 0x08], dtype=torch.uint8)
        scales = torch.tensor([2.0])
        self.assertEqual(block8_values(codes, scales, True).tolist(),
                         [2.0, -2.0, 2.0 ** -16, 0.0, 2.0 ** -13])
        self.assertEqual(block8_values(codes, scales, False)[1].item(), 2.0)
        for code, signed in ((0x7F, True), (0xFF, True), (0x79, True),
                             (0xF9, False)):
            bad = torch.tensor([0x01, code], dtype=torch.uint8)
            with self.assertRaisesRegex(ValueError, "at element 1"):
                block8_values(bad, scales, signed)

    def test_refusals(self):
        with self.assertRaisesRegex(ValueError, "AdamW/Adam moments only"):
            SGD(self.params(), lr=0.1, momentum=0.9, state_dtype=BLOCK8)
        with self.assertRaisesRegex(ValueError, "amsgrad"):
            AdamW(self.params(), amsgrad=True, exp_avg_dtype=BLOCK8)
        with self.assertRaises(TypeError):
            AdamW(self.params(), exp_avg_dtype="int8")
        # The daemon refuses on its own, for a client that does not check.
        Lion._takes_block8 = True
        try:
            with self.assertRaisesRegex(optimd.InvalidArgumentError,
                                        "block8 moments are for AdamW"):
                self.make(Lion, self.params(), lr=1e-4, state_dtype=BLOCK8)
        finally:
            Lion._takes_block8 = False


if __name__ == "__main__":
    unittest.main()
