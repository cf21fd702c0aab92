"""Trains a small character-level transformer language model through the
optimd daemon, with optimd.torch.AdamW in place of torch.optim.AdamW.

    PYTHONPATH=client/python /usr/bin/python3 examples/lm_train.py \\
        --address unix:/path/to/optimd.sock

The text is generated: sentences from a small grammar, so the model has
something to learn and its loss falls well below that of guessing. Runs on
the CPU by default (the daemon's CPU backend), on CUDA with --device cuda
(a daemon with --backend=cuda).
"""
import argparse
import math
import random
import sys
import time

import torch

from optimd.torch import AdamW

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird",
            "the teacher", "our neighbour"]
VERBS = ["sees", "likes", "follows", "draws", "finds", "remembers"]
OBJECTS = ["the river", "a red ball", "the garden", "an open door",
           "the moon", "a quiet street"]
ENDINGS = [" .", " today .", " again .", " at night ."]


def make_text(n_sentences, rng):
    return " ".join(rng.choice(SUBJECTS) + " " + rng.choice(VERBS) + " " +
                    rng.choice(OBJECTS) + rng.choice(ENDINGS)
                    for _ in range(n_sentences))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, dim=64, layers=2, heads=4, context=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=4 * dim, dropout=0.0,
            batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        mask = torch.triu(torch.full((context, context), float("-inf")), 1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t])
        return self.head(self.norm(h))


def progress(step, total, loss, started, width=30):
    done = width * step // total
    rate = step / max(time.time() - started, 1e-9)
    return "[%s%s] %4d/%d  loss %.4f  %.1f steps/s" % (
        "#" * done, "." * (width - done), step, total, loss, rate)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", default=None,
                    help="optimd daemon (default: its default socket)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    text = make_text(3000, rng)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    context = 32
    model = TinyLM(len(chars), context=context).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    print("lm_train: %d parameters, vocabulary of %d characters, %d "
          "characters of text, device %s" % (params, len(chars), len(data),
                                              args.device))
    opt = AdamW(model.named_parameters(), lr=args.lr, weight_decay=0.01,
                address=args.address, job_id="lm-demo")
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    print("lm_train: optimizer state lives in the optimd daemon at %s" %
          opt.client.address)

    def batch():
        starts = torch.randint(0, len(data) - context - 1, (args.batch,))
        x = torch.stack([data[s:s + context] for s in starts])
        y = torch.stack([data[s + 1:s + context + 1] for s in starts])
        return x.to(args.device), y.to(args.device)

    uniform = math.log(len(chars))
    first = None
    started = time.time()
    smoothed = None
    for step in range(1, args.steps + 1):
        x, y = batch()
        opt.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        value = loss.item()
        first = first if first is not None else value
        smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
        line = progress(step, args.steps, smoothed, started)
        if step % 50 == 0 or step == args.steps:
            print(line, flush=True)
        elif sys.stdout.isatty():
            print(line, end="\r", flush=True)
    opt.close()
    print("lm_train: loss %.3f -> %.3f (guessing: %.3f)" %
          (first, smoothed, uniform))
    if smoothed > 0.5 * first:
        print("lm_train: FAILED: the loss did not fall by half")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
