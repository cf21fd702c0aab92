"""Do other sessions wait while one session saves or loads a checkpoint?

One daemon (CPU backend), session A with a large fp32 AdamW state, session
B with a trivial one. B steps back to back, first alone, then while A runs
synchronous SaveState and LoadState calls in another thread; prints B's
step round trip in both phases (the peer: B alone, same run) and how long
A's calls took.

    PYTHONPATH=client/python /usr/bin/python3 bench/save_blocking_bench.py \\
        --params 5e7 --dir /tmp
"""
import argparse
import tempfile
import threading
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


def percentiles(xs):
    xs = sorted(xs)
    return "p50 %.0f us, p99 %.0f us, max %.0f us (%d steps)" % (
        xs[len(xs) // 2] * 1e6, xs[len(xs) * 99 // 100] * 1e6, xs[-1] * 1e6,
        len(xs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    n = int(args.params)
    with Daemon(backend="cpu") as d, \
            tempfile.TemporaryDirectory(dir=args.dir) as where:
        big = torch.nn.Parameter(torch.randn(n))
        a = AdamW([("w", big)], lr=1e-3, address=d.address, job_id="big")
        big.grad = torch.randn_like(big)
        a.step()
        small = torch.nn.Parameter(torch.randn(16))
        b = AdamW([("w", small)], lr=1e-3, address=d.address, job_id="small")
        small.grad = torch.randn_like(small)
        for _ in range(200):
            b.step()

        alone = []
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            b.step()
            alone.append(time.perf_counter() - t0)

        calls = []
        done = threading.Event()

        def saver():
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                a.save_checkpoint(where)
                calls.append(("save", time.perf_counter() - t0))
                t0 = time.perf_counter()
                a.load_checkpoint(where)
                calls.append(("load", time.perf_counter() - t0))
            done.set()

        during = []
        thread = threading.Thread(target=saver)
        thread.start()
        while not done.is_set():
            t0 = time.perf_counter()
            b.step()
            during.append(time.perf_counter() - t0)
        thread.join()
        print("session B alone:          ", percentiles(alone))
        print("session B during A's I/O: ", percentiles(during))
        print("session A (%d params, %.0f MB file): %s" % (
            n, n * 12 / 1e6, ", ".join("%s %.2f s" % c for c in calls)))
        a.close()
        b.close()


if __name__ == "__main__":
    main()
