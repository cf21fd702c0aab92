"""Scrape cost of the daemon's metrics with N open sessions: M scrapes of
GET /metrics over HTTP (a new connection each, as Prometheus's scraper may)
and M GetMetrics calls over the Unix socket (each renders the Prometheus
text too); microseconds per call, median and 99th percentile, and the mean.

    OPTIMD_BINARY=bazel-bin/server/optimd PYTHONPATH=client/python \
        /usr/bin/python3 bench/metrics_scrape_bench.py --sessions 100 --scrapes 1000
"""
import argparse
import re
import statistics
import tempfile
import time
import urllib.request

import optimd
from optimd.testing import Daemon


def timed(fn, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return (statistics.median(times), times[int(len(times) * 0.99)],
            statistics.fmean(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--scrapes", type=int, default=1000)
    args = parser.parse_args()
    log = tempfile.TemporaryFile("w+")
    with Daemon(flags=["--metrics_listen=127.0.0.1:0"], stderr=log) as d:
        deadline = time.time() + 20
        while True:
            log.seek(0)
            port = re.search(r"metrics on http port (\d+)", log.read())
            if port or time.time() > deadline:
                break
            time.sleep(0.05)
        url = "http://127.0.0.1:%s/metrics" % port.group(1)
        clients = []
        for i in range(args.sessions):
            c = optimd.Client(d.address)
            c.create_session("job-%d" % (i // 8), rank=i % 8, world_size=8)
            clients.append(c)
        admin = optimd.Client(d.address)

        def http():
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read()

        size = len(http())
        for name, fn in (("HTTP GET /metrics", http),
                         ("GetMetrics", admin.get_metrics)):
            timed(fn, 50)  # warm-up
            p50, p99, mean = timed(fn, args.scrapes)
            print("%-18s sessions %d, %d bytes: p50 %.0f us, p99 %.0f us, "
                  "mean %.0f us" % (name, args.sessions, size, p50, p99, mean))
        for c in clients:
            c.close_session()
            c.close()
        admin.close()


if __name__ == "__main__":
    main()
