"""How often per-tensor FP8 scaling's amax prediction would hold in a real
training loop: a model of the CUDA rule (docs/fp8_parameters.md, "Fusion";
kernels/fp8_cuda.cuh) run on a CPU training loop with torch's AdamW.

After each step every 2-D weight keeps as candidates the elements whose
magnitude lies in a band below the amax (amax / 2^(4 + narrow)): all of
them when at most 64, else 64 of them at random (the kernels keep the
first 64 to arrive, in no order the weights decide). The band narrows
while more than 64 lie in it and widens below 16. At the next step the
prediction holds when the largest new magnitude lies among the
candidates (the kernels step the candidates with the update's own
arithmetic, so equal values are equal bits). torch's default
initializations: uniform for Linear weights (a flat top), normal for the
embedding. Minibatch gradients of a small next-token model.

    /usr/bin/python3 bench/fp8_amax_prediction_model.py [--no_narrow]
"""
import argparse
import random

import torch

CANDIDATES = 64
MAX_NARROW = 20


def band(amax, narrow):
    return amax - amax * 2.0 ** (-4 - narrow)


def keep(state, w):
    """The candidates of weight magnitudes w for the next step."""
    amax = w.max().item()
    inband = (w >= band(amax, state["narrow"])).nonzero().flatten().tolist()
    state["list"] = (random.sample(inband, CANDIDATES)
                     if len(inband) > CANDIDATES else inband)
    if len(inband) > CANDIDATES and state["narrow"] < state["max_narrow"]:
        state["narrow"] += 1
    elif len(inband) < CANDIDATES // 4 and state["narrow"] > 0:
        state["narrow"] -= 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no_narrow", action="store_true",
                    help="the band stays 1/16 of the amax (the first form)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    d, hidden, vocab, tokens = 256, 1024, 512, 64
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, d), torch.nn.Linear(d, hidden),
        torch.nn.GELU(), torch.nn.Linear(hidden, d), torch.nn.LayerNorm(d),
        torch.nn.Linear(d, vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    weights = {n: p for n, p in model.named_parameters() if p.dim() == 2}
    states = {n: {"list": [], "narrow": 0, "hits": 0, "steps": 0,
                  "max_narrow": 0 if args.no_narrow else MAX_NARROW}
              for n in weights}
    data = torch.randint(0, vocab, (4096,))
    for _ in range(args.steps):
        starts = torch.randint(0, data.numel() - tokens - 1, (16,))
        x = torch.stack([data[s:s + tokens] for s in starts])
        y = torch.stack([data[s + 1:s + tokens + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(
            model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for n, p in weights.items():
            w = p.detach().abs().flatten()
            s = states[n]
            if s["list"]:
                s["steps"] += 1
                s["hits"] += int(w[s["list"]].max().item() == w.max().item())
            keep(s, w)
    for n, p in weights.items():
        s = states[n]
        print("%-9s %-12s prediction held %3d of %3d steps" % (
            n, "x".join(map(str, p.shape)), s["hits"], s["steps"]))


if __name__ == "__main__":
    main()
