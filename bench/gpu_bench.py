"""GPU benchmark: optimd's CUDA step against torch.optim.AdamW(fused=True)
on the same GPU in the same run, and against a device copy of the bytes a
step must move.

    python3 bench/gpu_bench.py --bench .gpu/cuda_step_bench

optimd's figures come from bench/cuda_step_bench (the CUDA backend stepping
parameters that live in another process's CUDA IPC buffers, as in
production), run first as a subprocess; torch's are measured here with CUDA
events around back-to-back steps (the method of
shared/reference/torch_adamw_anchor.py). Prints a table of ratios.
"""
import argparse
import os
import subprocess
import sys
import time

import torch


def ev_time(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def torch_fused_ms(total, tensors, dtype):
    per = total // tensors
    params = [torch.nn.Parameter(torch.randn(per, device="cuda", dtype=dtype))
              for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    ms = ev_time(opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return ms


def run_optimd(binary, extra):
    env = dict(os.environ)
    out = subprocess.run([binary] + extra, capture_output=True, text=True,
                         env=env)
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        raise SystemExit("cuda_step_bench failed: %d" % out.returncode)
    rows = []
    for line in out.stdout.splitlines():
        print(line)
        if line.startswith("RESULT "):
            f = line.split()
            rows.append(dict(name=f[1], tensors=int(f[2]), params=int(f[3]),
                             bpp=int(f[4]), gpu_ms=float(f[5]),
                             host_us=float(f[6]), copy_ms=float(f[7])))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default=".gpu/cuda_step_bench")
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--assume_finite", action="store_true")
    args = ap.parse_args()
    extra = ["--params=%g" % args.params]
    if args.assume_finite:
        extra.append("--assume_finite")
    rows = run_optimd(args.bench, extra)
    print("torch", torch.__version__, torch.cuda.get_device_name())
    peers = {}
    for r in rows:
        if r["name"] in ("fp32", "fp32_small"):
            key = (r["params"], r["tensors"])
            if key not in peers:
                peers[key] = torch_fused_ms(r["params"], r["tensors"],
                                            torch.float32)
    print()
    print("%-16s %8s %6s %10s %10s %10s %12s %10s" % (
        "layout", "tensors", "B/par", "optimd ms", "torch ms", "copy ms",
        "optimd/torch", "% of copy"))
    for r in rows:
        t = peers.get((r["params"], r["tensors"]))
        print("%-16s %8d %6d %10.3f %10s %10.3f %12s %9.1f%%" % (
            r["name"], r["tensors"], r["bpp"], r["gpu_ms"],
            "%.3f" % t if t else "-", r["copy_ms"],
            "%.3f" % (r["gpu_ms"] / t) if t else "-",
            100 * r["copy_ms"] / r["gpu_ms"]))
    print("\nhost time per asynchronous Step (us):",
          ", ".join("%s/%d: %.1f" % (r["name"], r["tensors"], r["host_us"])
                    for r in rows))
    print("copy ms: device-to-device copy of (bytes/param x params)/2 bytes,"
          " i.e. the same bytes read plus written")


if __name__ == "__main__":
    main()
