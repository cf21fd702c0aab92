"""Convergence with block8 moments: a small next-symbol language model
trained through optimd.torch.AdamW on the CPU backend, once with fp32
moments and once with block8 moments (exp_avg_dtype=optimd.torch.BLOCK8),
on the same data, seeds and batches. Prints both runs' held-out loss
(the mean over the last evaluations) and their ratio; the check passes
when block8's held-out loss is within TOLERANCE (relative) of fp32's.

The data is a synthetic language: an order-2 Markov chain over 48 symbols
with sparse, skewed transitions (entropy well below log(48)), so the model
has something to learn and the floor is known.

    bazel build //server:optimd
    OPTIMD_BINARY=bazel-bin/server/optimd PYTHONPATH=client/python \\
        /usr/bin/python3 bench/block8_convergence.py
"""
import math
import sys

import torch

import optimd.torch as ot
from optimd.testing import Daemon

VOCAB, CONTEXT, EMBED, HIDDEN = 48, 8, 32, 256
STEPS, BATCH, EVAL_EVERY, LAST_EVALS = 1500, 128, 50, 5
TOLERANCE = 0.02


def make_corpus(n, seed=0):
    """n symbols of the chain, and its entropy rate (nats per symbol)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, VOCAB, generator=g) * 3.0
    # Each context allows only 6 next symbols.
    keep = torch.rand(VOCAB, VOCAB, VOCAB, generator=g).argsort(-1) < 6
    probs = torch.softmax(logits.masked_fill(~keep, -1e9), -1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean().item()
    out = torch.empty(n, dtype=torch.long)
    out[:2] = torch.randint(VOCAB, (2,), generator=g)
    u = torch.rand(n, generator=g)
    cdf = probs.cumsum(-1)
    for i in range(2, n):
        row = cdf[out[i - 2], out[i - 1]]
        out[i] = min(int(torch.searchsorted(row, u[i])), VOCAB - 1)
    return out, entropy


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, EMBED)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(CONTEXT * EMBED, HIDDEN), torch.nn.GELU(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
            torch.nn.Linear(HIDDEN, VOCAB))

    def forward(self, x):
        return self.net(self.embed(x).flatten(1))


def windows(corpus, starts):
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    w = corpus[idx]
    return w[:, :-1], w[:, -1]


def train(address, exp_avg_dtype, train_set, held_out):
    torch.manual_seed(0)
    model = Model()
    opt = ot.AdamW(model.named_parameters(), lr=3e-3, weight_decay=0.01,
                   address=address, job_id="conv-%s" % exp_avg_dtype,
                   exp_avg_dtype=exp_avg_dtype)
    g = torch.Generator().manual_seed(1)
    hx, hy = windows(held_out, torch.arange(len(held_out) - CONTEXT - 1))
    evals = []
    for step in range(1, STEPS + 1):
        starts = torch.randint(len(train_set) - CONTEXT - 1, (BATCH,),
                               generator=g)
        x, y = windows(train_set, starts)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if step % EVAL_EVERY == 0:
            with torch.no_grad():
                evals.append(torch.nn.functional.cross_entropy(
                    model(hx), hy).item())
    opt.close()
    return evals


def main():
    torch.set_num_threads(2)
    corpus, entropy = make_corpus(60000)
    train_set, held_out = corpus[:50000], corpus[50000:]
    with Daemon() as d:
        runs = {name: train(d.address, dtype, train_set, held_out)
                for name, dtype in (("fp32", torch.float32),
                                    ("block8", ot.BLOCK8))}
    print("chain entropy %.4f nats/symbol (uniform %.4f)" %
          (entropy, math.log(VOCAB)))
    for name, evals in runs.items():
        print("%-6s held-out loss: first eval %.4f, every %d steps: %s" % (
            name, evals[0], EVAL_EVERY * 6,
            " ".join("%.4f" % e for e in evals[5::6])))
    final = {k: sum(v[-LAST_EVALS:]) / LAST_EVALS for k, v in runs.items()}
    ratio = final["block8"] / final["fp32"]
    ok = abs(ratio - 1) <= TOLERANCE
    print("final held-out loss (mean of last %d evals): fp32 %.4f, block8 "
          "%.4f, ratio %.4f (tolerance %.0f%%): %s" % (
              LAST_EVALS, final["fp32"], final["block8"], ratio,
              TOLERANCE * 100, "PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
