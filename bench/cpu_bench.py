"""CPU backend benchmark: optimd's step (through the daemon, over its Unix
socket, from optimd.torch.AdamW, SGD or Lion) against torch's own on the
CPU and against a memcpy of the same bytes, in the same run on the same
machine.

    bazel build //server:optimd && tools/gen_python_proto.sh
    PYTHONPATH=client/python /usr/bin/python3 bench/cpu_bench.py \
        [--optimizer adamw|sgd|lion]

SGD runs with momentum 0.9 against torch.optim.SGD; Lion against a
foreach implementation in torch ops (torch has no Lion), the fastest a
user gets without a fused kernel.

The same 1e7 fp32 parameters are split evenly into 1, 100 and 10,000
tensors. Each configuration gives optimd's daemon (--cpu_threads) and torch
(torch.set_num_threads) the same number of threads; the memcpy peer is libc
memcpy (numpy.copyto) of 14 bytes per parameter on as many threads, so it
moves 28 bytes per parameter, what one AdamW step must move (read param,
grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq). Times are
medians after warm-up; torch's figure is the faster of foreach=False/True.
"""
import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from optimd.testing import Daemon
from optimd.torch import SGD, AdamW, Lion


class ForeachLion:
    """Lion with torch's foreach ops: the peer for optimd.torch.Lion."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 foreach=True):
        self.params = list(params)
        self.lr, self.betas, self.wd = lr, betas, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        grads = [p.grad for p in self.params]
        torch._foreach_mul_(self.params, 1 - self.lr * self.wd)
        update = torch._foreach_mul(self.m, b1)
        torch._foreach_add_(update, grads, alpha=1 - b1)
        if hasattr(torch, "_foreach_sign_"):
            torch._foreach_sign_(update)
        else:  # torch before 2.1
            for u in update:
                u.sign_()
        torch._foreach_add_(self.params, update, alpha=-self.lr)
        torch._foreach_mul_(self.m, b2)
        torch._foreach_add_(self.m, grads, alpha=1 - b2)


# optimizer -> (optimd class, torch peer, keyword arguments, bytes one step
# moves each way per parameter).
OPTIMIZERS = {
    "adamw": (AdamW, torch.optim.AdamW, dict(lr=1e-3), 14),
    "sgd": (SGD, torch.optim.SGD, dict(lr=1e-3, momentum=0.9), 10),
    "lion": (Lion, ForeachLion, dict(lr=1e-4, weight_decay=0.1), 10),
}


def median_time(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_params(total, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [total // count] * count
    sizes[-1] += total - sum(sizes)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def memcpy_time(nbytes, threads, repeats):
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    bounds = np.linspace(0, nbytes, threads + 1).astype(np.int64)
    pool = ThreadPoolExecutor(threads)

    def copy():
        list(pool.map(lambda i: np.copyto(dst[bounds[i]:bounds[i + 1]],
                                          src[bounds[i]:bounds[i + 1]]),
                      range(threads)))
    t = median_time(copy, repeats)
    pool.shutdown()
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e7)
    ap.add_argument("--counts", default="1,100,10000")
    ap.add_argument("--threads", default="1,%d" % os.cpu_count(),
                    help="thread counts to compare, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS),
                    default="adamw")
    args = ap.parse_args()
    ours_cls, peer_cls, kw, half_bytes = OPTIMIZERS[args.optimizer]
    total = int(args.params)
    print("optimd CPU benchmark, %s: %d fp32 parameters, torch %s, %d CPUs" %
          (args.optimizer, total, torch.__version__, os.cpu_count()))
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        torch.set_num_threads(threads)
        t_copy = memcpy_time(total * half_bytes, threads, args.repeats)
        with Daemon(flags=["--cpu_threads=%d" % threads]) as daemon:
            for count in [int(c) for c in args.counts.split(",")]:
                ours = make_params(total, count)
                opt = ours_cls(ours, address=daemon.address,
                               job_id="bench-%d-%d" % (threads, count), **kw)
                t_ours = median_time(opt.step, args.repeats)
                opt.close()
                del ours, opt
                t_torch = None
                for foreach in (False, True):
                    theirs = make_params(total, count)
                    ref = peer_cls(theirs, foreach=foreach, **kw)
                    t = median_time(ref.step, max(3, args.repeats // 4))
                    t_torch = t if t_torch is None else min(t_torch, t)
                    del theirs, ref
                rows.append((threads, count, t_ours, t_torch, t_copy))
    print()
    print("%7s %8s %11s %11s %11s %13s %12s" % (
        "threads", "tensors", "optimd ms", "torch ms", "memcpy ms",
        "torch/optimd", "optimd/memcpy"))
    for threads, count, t_ours, t_torch, t_copy in rows:
        print("%7d %8d %11.2f %11.2f %11.2f %12.2fx %12.2fx" % (
            threads, count, t_ours * 1e3, t_torch * 1e3, t_copy * 1e3,
            t_torch / t_ours, t_ours / t_copy))
    print("\ngoals (AdamW): torch/optimd >= 3x; optimd/memcpy <= 2x")


if __name__ == "__main__":
    main()
