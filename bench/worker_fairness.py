"""One session's concurrent requests against another session's steps on the
same daemon (CPU backend): session A tells writes into a large bf16
parameter (UpdateBuffers with param_written, each an O(elements) pass on
the backend's worker) from several threads at once, while session B steps
a small parameter. Prints B's step latency (median, max) alone and under
A's load, and their ratio. Owners taking turns on the worker
(server/device_worker.h) keep the ratio near the length of one of A's
requests over B's step, whatever the number of A's threads.

    OPTIMD_BINARY=bazel-bin/server/optimd PYTHONPATH=client/python \\
        python3 bench/worker_fairness.py [--threads 8,64] [--numel 33554432]
"""
import argparse
import statistics
import threading
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


def step_times(opt, p, count):
    times = []
    for _ in range(count):
        p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="8,64")
    ap.add_argument("--numel", type=int, default=1 << 25)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    with Daemon() as d:
        big = torch.nn.Parameter(torch.zeros(args.numel, dtype=torch.bfloat16))
        a = AdamW([big], lr=1e-3, address=d.address, job_id="fair-a")
        big.grad = torch.zeros_like(big)
        a.step()
        small = torch.nn.Parameter(torch.zeros(1024))
        b = AdamW([small], lr=1e-3, address=d.address, job_id="fair-b")
        step_times(b, small, 5)
        alone = step_times(b, small, args.steps)
        t0 = time.perf_counter()
        a._tell_written(a._homed)
        one_write = (time.perf_counter() - t0) * 1e3
        print("B's step alone: median %.3f ms, max %.3f ms; one of A's "
              "writes alone %.1f ms" % (statistics.median(alone), max(alone),
                                        one_write))
        for threads in [int(t) for t in args.threads.split(",")]:
            stop = threading.Event()

            def load():
                while not stop.is_set():
                    a._tell_written(a._homed)

            workers = [threading.Thread(target=load) for _ in range(threads)]
            for w in workers:
                w.start()
            time.sleep(0.5)  # A's requests queue up
            loaded = step_times(b, small, args.steps)
            stop.set()
            for w in workers:
                w.join()
            print("A with %3d threads: B's step median %8.3f ms, max %8.3f "
                  "ms; median over alone %.1f, over one of A's writes %.2f" % (
                      threads, statistics.median(loaded), max(loaded),
                      statistics.median(loaded) / statistics.median(alone),
                      statistics.median(loaded) / one_write))
        a.close()
        b.close()


if __name__ == "__main__":
    main()
