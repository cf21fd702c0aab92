"""A write into the parameters every step (a pruning mask applied in place
after each step), through optimd.torch.AdamW and torch's fused AdamW in the
same run: bf16 parameters, whose fp32 masters live in the daemon, so each
write is told to it (with the next step's request since API revision 12,
adopted after the step's wait for the trainer's stream). Prints ms per
iteration with and without the mask, for both, and their ratios, and checks
that both step the masked elements from zero alike.

    OPTIMD_BINARY=... PYTHONPATH=client/python \\
        python3 bench/written_params_bench.py [--device cuda] [--dim 4096]
"""
import argparse
import sys
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


def run(make_opt, params, mask, iters, device):
    """ms per iteration of `p.grad = g; opt.step(); p.mul_(mask)` (the
    mask left out when None), after 5 warm-up iterations."""
    opt = make_opt(params)
    grads = [torch.full_like(p, 0.01) for p in params]

    def iteration():
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        if mask is not None:
            with torch.no_grad():
                for p in params:
                    p.mul_(mask)

    for _ in range(5):
        iteration()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        iteration()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / iters
    return ms, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available()
                    else "cpu")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    shape = (args.dim, args.dim)
    mask = (torch.rand(shape, device=device) > 0.5).to(torch.bfloat16)
    backend = "cuda" if device.type == "cuda" else "cpu"
    with Daemon(backend=backend) as d:
        def fresh():
            torch.manual_seed(1)
            return [torch.nn.Parameter(torch.randn(
                shape, device=device).to(torch.bfloat16))
                for _ in range(args.tensors)]

        ours = {}
        for name, m in (("none", None), ("mask", mask)):
            ms, opt = run(lambda ps: AdamW(ps, lr=1e-3, address=d.address,
                                           job_id="written-" + name),
                          fresh(), m, args.iters, device)
            ours[name] = (ms, opt)
            print("optimd, %s: %.3f ms" % (name, ms), file=sys.stderr,
                  flush=True)
        theirs = {}
        for name, m in (("none", None), ("mask", mask)):
            theirs[name] = run(
                lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)
                if device.type == "cuda" else torch.optim.AdamW(ps, lr=1e-3),
                fresh(), m, args.iters, device)
        # One more step from the masked values: the masked elements step
        # from zero in both (lr in magnitude).
        masked = []
        for opt in (ours["mask"][1], theirs["mask"][1]):
            p = opt.param_groups[0]["params"][0]
            p.grad = torch.full_like(p, 0.01)
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            masked.append(p.detach()[mask == 0].float().abs())
        for o in ours.values():
            o[1].close()
    print("%d x %dx%d bf16, %d iterations, %s" % (
        args.tensors, args.dim, args.dim, args.iters, device))
    print("%-28s %10s %10s" % ("ms/iteration", "no mask", "mask"))
    print("%-28s %10.3f %10.3f" % ("optimd.torch.AdamW",
                                   ours["none"][0], ours["mask"][0]))
    print("%-28s %10.3f %10.3f" % ("torch AdamW" + (
        " (fused)" if device.type == "cuda" else ""),
        theirs["none"][0], theirs["mask"][0]))
    print("%-28s %10.3f %10.3f" % ("ratio optimd / torch",
                                   ours["none"][0] / theirs["none"][0],
                                   ours["mask"][0] / theirs["mask"][0]))
    print("masked elements after one more step: optimd %.3g..%.3g, "
          "torch %.3g..%.3g" % (masked[0].min(), masked[0].max(),
                                masked[1].min(), masked[1].max()))


if __name__ == "__main__":
    main()
