"""GPU benchmark: optimd's CUDA step against torch.optim.AdamW(fused=True)
on the same GPU in the same run, and against a device copy of the bytes a
step must move.

    python3 bench/gpu_bench.py --bench .gpu/cuda_step_bench

optimd's figures come from bench/cuda_step_bench (the CUDA backend stepping
parameters that live in another process's CUDA IPC buffers, as in
production), run first as a subprocess; torch's are measured here with CUDA
events around back-to-back steps (the method of
shared/reference/torch_adamw_anchor.py). Prints a table of ratios.
Gradients: torch's are random normal; optimd's are a constant 0.0115
(cuda_step_bench --grad_byte): both keep every moment a normal number, as
in training (the kernels' speed does not depend on the values otherwise).
"""
import argparse
import os
import subprocess
import sys

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
    """Per-step ms of three torch peers on the same parameters:
    plain: AdamW(fused=True).step(), which checks nothing;
    scaler: GradScaler.step + update around it (the non-finite check of
      mixed-precision training: reads and rewrites every gradient, then
      the fused step skips on inf/NaN);
    clip: clip_grad_norm_(foreach=True, max_norm=1) then the fused step."""
    per = total // tensors
    params = [torch.nn.Parameter(torch.randn(per, device="cuda", dtype=dtype))
              for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    out = {"plain": ev_time(opt.step)}
    # GradScaler unscales fp32 and fp16 gradients only (torch has no
    # bfloat16 kernel for its check): no such peer for bf16 parameters.
    if dtype != torch.bfloat16:
        scaler = torch.amp.GradScaler("cuda", init_scale=1.0,
                                      growth_interval=1 << 30)
        scaler.scale(torch.ones((), device="cuda"))  # creates the scale

        def scaled():
            scaler.step(opt)
            scaler.update()

        out["scaler"] = ev_time(scaled)
        del scaler

    def clipped():
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    out["clip"] = ev_time(clipped)
    del opt, params
    torch.cuda.empty_cache()
    return out


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
                             host_us=float(f[6]), copy_ms=float(f[7]),
                             mode=f[8], item=int(f[9]),
                             graphs=int(f[10]), cpu_us=float(f[11])))
    return rows


def peer_key(row):
    """The torch model a row is compared with: the same parameter count
    and tensors, in the parameter dtype a torch user of that layout trains
    (bf16 for bf16 parameters, with torch's bf16 moments; fp32 for the
    rest, FP8 layouts included, whose masters are fp32)."""
    dtype = torch.bfloat16 if row["name"].startswith("bf16") else torch.float32
    return (row["params"], row["tensors"], dtype)


# The torch peer doing the same work as each optimd step mode.
PEER = {"assume_finite": "plain", "default": "scaler", "clip": "clip"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default=".gpu/cuda_step_bench")
    ap.add_argument("--params", type=float, default=0,
                    help="parameters per configuration (0: 1e9 on a card "
                    "of 120 GiB or more, as the H200; else 5e8, which fits "
                    "an 80 GB H100 with the copy baseline)")
    ap.add_argument("--modes", default="assume_finite,default,clip")
    ap.add_argument("--item_elements", default="0",
                    help="comma-separated item sizes (0: the default)")
    ap.add_argument("--graphs", default="1",
                    help="comma-separated use_graphs values (0, 1)")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    if not args.params:
        total = torch.cuda.get_device_properties(0).total_memory
        args.params = 1e9 if total >= 120 * 2**30 else 5e8
    extra = ["--params=%g" % args.params, "--modes=" + args.modes,
             "--item_elements=" + args.item_elements,
             "--graphs=" + args.graphs]
    if args.only:
        extra.append("--only=" + args.only)
    rows = run_optimd(args.bench, extra)
    print("torch", torch.__version__, torch.cuda.get_device_name())
    peers = {}
    for r in rows:
        key = peer_key(r)
        if key not in peers:
            peers[key] = torch_fused_ms(*key)
            print("torch %d tensors of %s: %s" % (key[1], key[2], ", ".join(
                "%s %.3f ms" % kv for kv in peers[key].items())))
    print()
    print("optimd mode -> torch peer: " + ", ".join(
        "%s -> %s" % kv for kv in PEER.items()))
    print("%-16s %7s %5s %-13s %6s %2s %9s %9s %7s %8s %7s %7s %7s %6s" % (
        "layout", "tensors", "B/par", "mode", "item", "gr", "optimd ms",
        "peer ms", "/peer", "plain ms", "/plain", "% copy", "host us",
        "cpu us"))
    for r in rows:
        t = peers.get(peer_key(r))
        peer = t.get(PEER[r["mode"]]) if t else None
        plain = t["plain"] if t else None
        fmt = lambda x: "%.3f" % x if x else "-"
        print("%-16s %7d %5d %-13s %6d %2d %9.3f %9s %7s %8s %7s %6.1f%% "
              "%7.1f %6.1f" % (
                  r["name"], r["tensors"], r["bpp"], r["mode"], r["item"],
                  r["graphs"], r["gpu_ms"], fmt(peer),
                  fmt(peer and r["gpu_ms"] / peer), fmt(plain),
                  fmt(plain and r["gpu_ms"] / plain),
                  100 * r["copy_ms"] / r["gpu_ms"], r["host_us"],
                  r["cpu_us"]))
    print("host us, cpu us: medians of 51 asynchronous Steps (wall, thread"
          " CPU time)")
    print("copy: device-to-device copy of (bytes/param x params)/2 bytes,"
          " i.e. the same bytes read plus written, in the same run")


if __name__ == "__main__":
    main()
