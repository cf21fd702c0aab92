"""Where a model's back-to-back iterations spend the trainer's host time,
with torch's fused AdamW and with optimd.torch.AdamW in variants that each
rule one cause in or out (bench/RESULTS.md, run 78).

Run on a GPU machine from the repository root, after tools/gpu_bundle.sh
(OPTIMD_BINARY and LD_LIBRARY_PATH as tools/gpu_test.sh sets them):

    python3 bench/host_probe.py [--model deep2400] [--iters 8]

Rows run one after the other in the order printed; the host's speed drifts
within a run, so compare neighbours only.
"""
import argparse
import functools
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench as tb  # noqa: E402
import optimd.torch as ot  # noqa: E402
from optimd.testing import Daemon  # noqa: E402


def run(label, make_opt, cfg, batches, seq, iters, sync=False, nogc=False):
    """Prints one row: 3 warm-up iterations, then `iters` back to back,
    each phase's host ms (means) and Python's collections meanwhile. With
    `sync`, the host waits for the GPU after each step; with `nogc`, the
    cyclic collector is off."""
    torch.manual_seed(0)
    trainer = tb.Trainer(tb.GPT(seq=seq, **cfg).cuda(), make_opt, None,
                         batches)
    for _ in range(3):
        trainer.iterate()
    torch.cuda.synchronize()
    host = {}
    before = [s["collections"] for s in gc.get_stats()]
    if nogc:
        gc.disable()
    t0 = time.perf_counter()
    for _ in range(iters):
        phases, _ = trainer.phases()
        for name, fn in phases:
            start = time.perf_counter()
            fn()
            if sync and name == "step":
                torch.cuda.synchronize()
            host[name] = host.get(name, 0.0) + time.perf_counter() - start
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / iters * 1e3
    gc.enable()
    after = [s["collections"] for s in gc.get_stats()]
    print("%-38s iter %7.2f ms  %s  gc %s" % (
        label, total, "  ".join("%s %.2f" % (k, v / iters * 1e3)
                                for k, v in host.items()),
        [b - a for a, b in zip(before, after)]), flush=True)
    if hasattr(trainer.opt, "close"):
        trainer.opt.close()
    del trainer
    torch.cuda.empty_cache()


def optimd_opt(daemon, keep_grads=False):
    def make(model):
        opt = ot.AdamW(model.parameters(), lr=1e-4, address=daemon.address)
        if keep_grads:  # gradients stay put: none move between steps
            opt.zero_grad = functools.partial(opt.zero_grad,
                                              set_to_none=False)
        return opt
    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deep2400")
    ap.add_argument("--iters", type=int, default=8)
    args = ap.parse_args()
    cfg, (batch, seq), _ = tb.MODELS[args.model]
    batches = tb.batches(cfg, batch, seq)
    row = functools.partial(run, cfg=cfg, batches=batches, seq=seq,
                            iters=args.iters)
    torch_opt = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)

    def torch_fused(model):
        return torch_opt(model.parameters())

    with Daemon(backend="cuda") as d:
        row("torch fused", torch_fused)
        row("optimd", optimd_opt(d))
        row("optimd, gc disabled", optimd_opt(d), nogc=True)
        row("optimd, synchronize after step", optimd_opt(d), sync=True)
        row("optimd, zero_grad(set_to_none=False)",
            optimd_opt(d, keep_grads=True))
    with Daemon(backend="cuda", flags=["--cuda_blocking_sync"]) as d:
        row("optimd, daemon waits blocking", optimd_opt(d))
    row("torch fused", torch_fused)


if __name__ == "__main__":
    main()
