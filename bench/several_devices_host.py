"""The host time of a step through an optimizer over several parts
(optimd/_several_devices.py), on the CPU backend: parameters of odd and
even sizes in two parts, as parameters on two devices would be
(bench/RESULTS.md).

    PYTHONPATH=client/python OPTIMD_BINARY=bazel-bin/server/optimd \\
        python3 bench/several_devices_host.py [--params 100,2000]

Prints, per parameter count, the medians of 30 steps: the host ms of the
parts' bookkeeping (_sync_parts) alone and of a whole opt.step().
"""
import argparse
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


class TwoPartAdamW(AdamW):
    """Parameters of an odd number of elements in a part of their own."""

    def _part_key(self, p):
        return (str(p.device), p.numel() % 2)

    def _part_label(self, key):
        return "%s-%d" % (key[0], key[1])


def median_ms(f, n=30):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="100,2000")
    args = ap.parse_args()
    for n in map(int, args.params.split(",")):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(16 + i % 2))
                  for i in range(n)]
        with Daemon(backend="cpu") as d:
            opt = TwoPartAdamW(params, lr=1e-3, address=d.address,
                               job_id="several-host")
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
            sync = median_ms(opt._sync_parts)
            step = median_ms(opt.step)
            print("params %5d  _sync_parts %.3f ms  step %.3f ms"
                  % (n, sync, step))
            opt.close()


if __name__ == "__main__":
    main()
