"""CPU backend benchmark: optimd's step (through the daemon, over its Unix
socket, from optimd.torch.AdamW) against torch.optim.AdamW on the CPU and
against a memcpy of the same bytes, in the same run on the same machine.

    bazel build //server:optimd && tools/gen_python_proto.sh
    PYTHONPATH=client/python /usr/bin/python3 bench/cpu_bench.py

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
from optimd.torch import AdamW


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
    args = ap.parse_args()
    total = int(args.params)
    print("optimd CPU benchmark: %d fp32 parameters, torch %s, %d CPUs" %
          (total, torch.__version__, os.cpu_count()))
    rows = []
    for threads in sorted({int(t) for t in args.threads.split(",")}):
        torch.set_num_threads(threads)
        t_copy = memcpy_time(total * 14, threads, args.repeats)
        with Daemon(flags=["--cpu_threads=%d" % threads]) as daemon:
            for count in [int(c) for c in args.counts.split(",")]:
                ours = make_params(total, count)
                opt = AdamW(ours, lr=1e-3, address=daemon.address,
                            job_id="bench-%d-%d" % (threads, count))
                t_ours = median_time(opt.step, args.repeats)
                opt.close()
                del ours, opt
                t_torch = None
                for foreach in (False, True):
                    theirs = make_params(total, count)
                    ref = torch.optim.AdamW(theirs, lr=1e-3, foreach=foreach)
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
    print("\ngoals: torch/optimd >= 3x; optimd/memcpy <= 2x")


if __name__ == "__main__":
    main()
