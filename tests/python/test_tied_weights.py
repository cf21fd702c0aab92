"""Tied weights (a language model's embedding and LM head sharing one
Parameter) through optimd.torch.AdamW, side by side with torch.optim.AdamW.

The tied parameter is registered once, its other name kept as an alias: the
weights follow torch's, and a checkpoint loads in a new process and exports
weights that a fresh tied model loads with load_state_dict(strict=True).
Every test drives the real daemon (CPU backend) over its socket.
"""
import copy
import os
import random
import subprocess
import sys
import tempfile
import unittest

import torch

import optimd
from optimd.checkpoint import aliases, read_checkpoint, to_torch_state_dict
from optimd.testing import DaemonTestCase
from optimd.torch import AdamW, tied_named_parameters

SEED = int(os.environ.get("OPTIMD_TEST_SEED", random.randrange(1 << 30)))
print("seed", SEED)
# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

VOCAB, DIM, BATCH = 23, 8, 6
# The hyperparameters of every run, optimd's and torch's.
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


class TinyLM(torch.nn.Module):
    """An embedding, one mixing layer and an LM head tied to the embedding,
    as GPT-2 ties them."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Linear(DIM, DIM)
        self.lm_head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(torch.tanh(self.mix(self.embed(tokens))))


def train_step(model, opt, step):
    """One step on the batch of `step` (the same in every process)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, 5), generator=gen)
    targets = torch.randint(VOCAB, (BATCH, 5), generator=gen)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             targets.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def rel_err(a, b):
    """The largest element error relative to the tensor's scale."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# Run by test_checkpoint_resumes_in_a_new_process as a process of its own:
# a fresh model and optimizer (default job id) load the directory's
# checkpoint, train steps [first, end) and save the weights.
RESUME = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_tied_weights import HYPER, TinyLM, train_step
from optimd.torch import AdamW, tied_named_parameters
address, directory, first, end, out = sys.argv[2:7]
model = TinyLM()
opt = AdamW(tied_named_parameters(model), address=address, **HYPER)
opt.load_checkpoint(directory)
assert model.lm_head.weight is model.embed.weight
for step in range(int(first), int(end)):
    train_step(model, opt, step)
torch.save(model.state_dict(), out)
opt.close()
"""


class TiedWeights(DaemonTestCase):
    seed = SEED

    def setUp(self):
        super().setUp()
        self.dir = tempfile.mkdtemp(prefix="optimd-tied-")

    def twins(self):
        """A tied model for optimd and an equal one (tied too) for torch."""
        torch.manual_seed(self.seed)
        ours = TinyLM()
        return ours, copy.deepcopy(ours)

    def optimd(self, params, **kw):
        opt = AdamW(params, address=self.daemon.address,
                    job_id="t%d" % len(self.opts) + self.id(), **HYPER, **kw)
        self.opts.append(opt)
        return opt

    def assert_same_weights(self, ours, theirs, what, tolerance=1e-6):
        mine, ref = ours.state_dict(), theirs.state_dict()
        self.assertEqual(sorted(mine), sorted(ref))
        for name in ref:
            self.assertLessEqual(rel_err(mine[name], ref[name]), tolerance,
                                 "%s: %s" % (what, name))

    def test_tied_model_trains_as_with_torch(self):
        ours, theirs = self.twins()
        opt = self.optimd(tied_named_parameters(ours))
        ref = torch.optim.AdamW(theirs.parameters(), **HYPER)
        # One tensor registered per parameter, as torch's optimizer has them.
        self.assertEqual(len(opt.param_groups[0]["params"]),
                         len(ref.param_groups[0]["params"]))
        for step in range(30):
            train_step(ours, opt, step)
            train_step(theirs, ref, step)
            self.assert_same_weights(ours, theirs, "step %d" % step)
        self.assertIs(ours.lm_head.weight, ours.embed.weight)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertLessEqual(
                    rel_err(opt.state[p][k], ref.state[q][k]), 1e-5, k)

    def test_checkpoint_resumes_in_a_new_process(self):
        # Save after some steps; a new process loads the checkpoint into a
        # fresh model and optimizer and goes on as torch goes on.
        ours, theirs = self.twins()
        opt = self.optimd(tied_named_parameters(ours))
        ref = torch.optim.AdamW(theirs.parameters(), **HYPER)
        for step in range(10):
            train_step(ours, opt, step)
            train_step(theirs, ref, step)
        opt.save_checkpoint(self.dir)
        opt.close()
        for step in range(10, 20):
            train_step(theirs, ref, step)
        out = os.path.join(self.dir, "resumed.pt")
        subprocess.run(
            [sys.executable, "-c", RESUME, os.path.dirname(__file__),
             self.daemon.address, self.dir, "10", "20", out],
            check=True, env=dict(os.environ))
        resumed = TinyLM()
        resumed.load_state_dict(torch.load(out), strict=True)
        self.assert_same_weights(resumed, theirs, "resumed")

    def test_exported_weights_load_strictly_into_a_fresh_model(self):
        ours, theirs = self.twins()
        opt = self.optimd(tied_named_parameters(ours))
        for step in range(5):
            train_step(ours, opt, step)
        path = opt.save_checkpoint(self.dir).path
        meta, tensors = read_checkpoint(path)
        # Stored once, under its registered name; the alias is listed in
        # the metadata.
        self.assertIn("embed.weight", tensors)
        self.assertNotIn("lm_head.weight", tensors)
        self.assertEqual(aliases(meta), {"lm_head.weight": "embed.weight"})
        state, params, _ = to_torch_state_dict(path)
        fresh = TinyLM()
        fresh.load_state_dict(params, strict=True)
        self.assertIs(fresh.lm_head.weight, fresh.embed.weight)
        self.assert_same_weights(fresh, ours, "exported", tolerance=0.0)
        # The optimizer state dict is torch's: one entry per parameter.
        ref = torch.optim.AdamW(fresh.parameters(), **HYPER)
        ref.load_state_dict(state)
        self.assertEqual(len(ref.state), 3)

    @unittest.skipUnless(
        "remove_duplicate" in torch.nn.Module.named_parameters.__code__
        .co_varnames, "torch < 2.0: named_parameters keeps no duplicates")
    def test_named_parameters_without_removing_duplicates(self):
        ours, _ = self.twins()
        opt = self.optimd(ours.named_parameters(remove_duplicate=False))
        train_step(ours, opt, 0)
        path = opt.save_checkpoint(self.dir).path
        self.assertEqual(aliases(read_checkpoint(path)[0]),
                         {"lm_head.weight": "embed.weight"})

    def test_alias_taken_by_another_parameter_is_refused(self):
        # "b" is p's second name (its alias) and q's name: the daemon
        # refuses q's name, checked after p's aliases.
        p = torch.nn.Parameter(torch.randn(4))
        q = torch.nn.Parameter(torch.randn(4))
        with self.assertRaises(optimd.InvalidArgumentError) as raised:
            AdamW([("a", p), ("b", q), ("b", p)],
                  address=self.daemon.address, job_id="taken")
        self.assertIn("tensor name 'b' is already an alias of another tensor",
                      str(raised.exception))
        # One name given twice is a parameter listed twice, as before.
        with self.assertRaises(ValueError):
            AdamW([("a", p), ("a", p)], address=self.daemon.address,
                  job_id="twice")


if __name__ == "__main__":
    unittest.main()
