"""Checkpoint benchmark: the daemon's SaveState and LoadState of an fp32
AdamW state (parameters, exp_avg, exp_avg_sq: 12 bytes per parameter)
beside a plain sequential write (with fsync) and read of the same number of
bytes in the same directory, in the same run.

    PYTHONPATH=client/python /usr/bin/python3 bench/checkpoint_bench.py \\
        --params 2.5e8 --dir /tmp [--device cuda]

Reads are timed after dropping the page cache when the script may (root);
otherwise both reads come from the cache alike.
"""
import argparse
import os
import tempfile
import time

import torch

from optimd.testing import Daemon
from optimd.torch import AdamW


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def plain_write_read(path, data, chunk=64 << 20):
    """Writes `data` (as many bytes as the checkpoint, in memory like the
    state) sequentially with fsync, then reads it back into it."""
    view = memoryview(data)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for off in range(0, len(data), chunk):
        os.write(fd, view[off:off + chunk])
    os.fsync(fd)
    os.close(fd)
    t_write = time.perf_counter() - t0
    dropped = drop_caches()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    off = 0
    while off < len(data):
        n = os.readv(fd, [view[off:off + chunk]])
        if n <= 0:
            break
        off += n
    os.close(fd)
    t_read = time.perf_counter() - t0
    os.unlink(path)
    return t_write, t_read, dropped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=2.5e8)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tensors", type=int, default=100)
    args = ap.parse_args()
    total = int(args.params)
    per = total // args.tensors
    work = tempfile.mkdtemp(prefix="optimd-ckpt-bench-", dir=args.dir)
    backend = "cuda" if args.device.startswith("cuda") else "cpu"
    with Daemon(backend=backend) as d:
        params = [torch.nn.Parameter(torch.randn(per, device=args.device))
                  for _ in range(args.tensors)]
        opt = AdamW(params, lr=1e-3, address=d.address, job_id="ckpt-bench")
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        # Best of two for each side: the disk's speed varies run to run.
        t_save = t_load = float("inf")
        for _ in range(2):
            saved = opt.save_checkpoint(work)
            t_save = min(t_save, saved.seconds)
            dropped = drop_caches()
            t0 = time.perf_counter()
            loaded = opt.load_checkpoint(work)
            t_load = min(t_load, time.perf_counter() - t0)
        nbytes = saved.bytes
        opt.close()
    os.unlink(saved.path)
    data = bytearray(nbytes)
    data[::4096] = os.urandom(len(data[::4096]))
    t_write = t_read = float("inf")
    for _ in range(2):
        w, r, _ = plain_write_read(os.path.join(work, "plain"), data)
        t_write, t_read = min(t_write, w), min(t_read, r)
    os.rmdir(work)
    gb = nbytes / 1e9
    print("checkpoint of %d fp32 parameters (%s backend): %.2f GB, page cache "
          "%s before reads" % (total, backend, gb,
                               "dropped" if dropped else "kept"))
    print("%-8s %10s %10s %10s %8s" % ("", "optimd s", "plain s", "GB/s",
                                       "ratio"))
    print("%-8s %10.3f %10.3f %10.2f %7.0f%%" % (
        "save", t_save, t_write, gb / t_save, 100 * t_write / t_save))
    print("%-8s %10.3f %10.3f %10.2f %7.0f%%" % (
        "load", t_load, t_read, gb / t_load, 100 * t_read / t_load))
    print("peak staging during load: %d bytes" % loaded.peak_staging_bytes)
    print("ratio = plain time / optimd time (goal: at least 80%)")


if __name__ == "__main__":
    main()
