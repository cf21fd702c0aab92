"""How much of a bandwidth-bound optimizer update can hide beside a forward.

One process, one GPU: the forward of bench/train_bench.py's gpt400m (bf16
autocast, fp32 weights) on one stream, and an fp32 AdamW update over as many
elements as the model has parameters on another, each alone and both at
once. The update runs in the forms of bench/overlap_probe.cu on a chosen
number of blocks (SMs), and as torch's fused AdamW. For each form:

  visible = (both at once - forward alone) / best standalone update

the share of the standalone step an overlapped iteration still shows
(issue 11's overlap goal: at most 25%). A probe of the hardware, not of
optimd: the daemon's own overlap runs its update in another process under
MPS, which shares the SMs as one process's streams do.

    nvcc -cubin -O3 -gencode arch=compute_90,code=sm_90 \\
        -o overlap_probe.cubin bench/overlap_probe.cu
    python3 bench/overlap_probe.py --cubin overlap_probe.cubin \\
        --forms simt:132,simt:32,bulk:132,bulk:32,torch
(simt:0, bulk:0: short blocks, as many as the work needs, which a
higher-priority stream's blocks pass when SMs free up.)
"""

import argparse
import ctypes
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import train_bench  # noqa: E402  (the benchmark's model)

CHUNK = 2048  # probe_adamw_bulk's floats per stream per stage
BULK_SMEM = 4 * 4 * CHUNK * 4


class Hyper(ctypes.Structure):
    _fields_ = [(n, ctypes.c_float) for n in
                ("lr", "beta1", "beta2", "eps", "decay", "bc1", "bc2_sqrt")]


HYPER = Hyper(3e-4, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9 ** 3,
              (1 - 0.999 ** 3) ** 0.5)


class Kernels:
    """The probe's kernels, loaded through the driver API into torch's
    context."""

    def __init__(self, cubin):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.module = ctypes.c_void_p()
        data = open(cubin, "rb").read()
        self._check(self.cu.cuModuleLoadData(ctypes.byref(self.module), data),
                    "cuModuleLoadData")
        self.fn = {}
        for name in ("probe_adamw_simt", "probe_adamw_simtcs",
                     "probe_adamw_bulk"):
            f = ctypes.c_void_p()
            self._check(self.cu.cuModuleGetFunction(
                ctypes.byref(f), self.module, name.encode()), name)
            self.fn[name] = f
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.cu.cuFuncSetAttribute(
            self.fn["probe_adamw_bulk"], 8, BULK_SMEM), "cuFuncSetAttribute")

    def _check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA driver error {rc}")

    def launch(self, kind, blocks, bufs, n, stream):
        """blocks 0: short blocks, as many as the work needs (two float4
        of each stream a thread, or eight chunks a block)."""
        p, g, m, v = (ctypes.c_void_p(t.data_ptr()) for t in bufs)
        if kind in ("simt", "simtcs"):
            count, threads, smem = ctypes.c_uint64(n // 4), 1024, 0
            blocks = blocks or -(-n // (4 * 2 * threads))
        else:
            count, threads, smem = ctypes.c_uint64(n), 512, BULK_SMEM
            blocks = blocks or -(-n // (8 * CHUNK))
        args = (ctypes.c_void_p * 6)(*[ctypes.cast(ctypes.pointer(a),
                                                   ctypes.c_void_p)
                                       for a in (p, g, m, v, count, HYPER)])
        self._check(self.cu.cuLaunchKernel(
            self.fn[f"probe_adamw_{kind}"], blocks, 1, 1, threads, 1, 1, smem,
            ctypes.c_void_p(stream.cuda_stream), args, None), kind)


def reference(bufs):
    p, g, m, v = (t.clone() for t in bufs)
    h = HYPER
    p.mul_(1 - h.lr * h.decay)
    m.mul_(h.beta1).add_(g * (1 - h.beta1))
    v.mul_(h.beta2).add_(g * g * (1 - h.beta2))
    p.sub_((h.lr / h.bc1) * m / (v.sqrt() / h.bc2_sqrt + h.eps))
    return p, m, v


def check(kernels, forms):
    """Each probe form against torch's arithmetic on a small buffer."""
    n = CHUNK * 300
    gen = torch.Generator(device="cuda").manual_seed(7)
    bufs = [torch.randn(n, device="cuda", generator=gen) for _ in range(4)]
    bufs[3].abs_()
    want = reference(bufs)
    for kind, blocks in forms:
        if kind == "torch":
            continue
        got = [t.clone() for t in bufs]
        kernels.launch(kind, blocks, got, n, torch.cuda.current_stream())
        torch.cuda.synchronize()
        for name, a, b in zip("pmv", (got[0], got[2], got[3]), want):
            # Contractions into FMA move a result by a few ulps.
            err = ((a - b).abs() / (b.abs() + 1e-3)).max().item()
            if err > 1e-5:
                raise SystemExit(f"{kind}:{blocks} {name}: rel err {err}")
    print("probe kernels agree with torch's arithmetic to 1e-5")


def timed(fn, streams, iters):
    """Median GPU ms of fn() across the given streams, one run at a time."""
    out = []
    main = torch.cuda.current_stream()
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(main)
        for s in streams:
            s.wait_event(start)
        fn()
        for s in streams:
            done = torch.cuda.Event()
            done.record(s)
            main.wait_event(done)
        end.record(main)
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cubin", required=True)
    ap.add_argument("--forms", default="simt:132,simt:32,bulk:132,bulk:32,"
                    "torch", help="simt:<blocks>, simtcs:<blocks>, bulk:<blocks>, "
                    "torch")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--forward_priority", type=int, default=0,
                    help="the forward stream's priority (lower: higher; "
                    "the update's stream keeps 0, the lowest)")
    args = ap.parse_args()
    forms = [(f.split(":")[0], int(f.split(":")[1]) if ":" in f else 0)
             for f in args.forms.split(",")]
    torch.manual_seed(0)
    torch.zeros(1, device="cuda")  # torch's context, current on this thread
    kernels = Kernels(args.cubin)
    check(kernels, forms)

    cfg = train_bench.MODELS["gpt400m"][0]
    model = train_bench.GPT(seq=args.seq, **cfg).cuda()
    n = sum(p.numel() for p in model.parameters())
    n -= n % CHUNK
    bufs = [torch.rand(n, device="cuda") * 1e-2 for _ in range(4)]
    # torch's peer: the same buffers in 52 tensors, as the model has.
    tparams = [torch.nn.Parameter(c) for c in torch.split(bufs[0],
                                                          n // 52 + 1)]
    for tp, gc in zip(tparams, torch.split(bufs[1], n // 52 + 1)):
        tp.grad = gc
    topt = torch.optim.AdamW(tparams, lr=3e-4, weight_decay=0.1, fused=True)
    x, y = train_bench.batches(cfg, args.batch, args.seq, n=1)[0]
    fs = torch.cuda.Stream(priority=args.forward_priority)
    us = torch.cuda.Stream()

    def forward():
        with torch.cuda.stream(fs), torch.autocast("cuda", torch.bfloat16):
            model(x, y)

    def update(kind, blocks):
        if kind == "torch":
            with torch.cuda.stream(us):
                topt.step()
        else:
            kernels.launch(kind, blocks, bufs, n, us)

    for _ in range(3):
        forward()
        update("torch", 0)
    f_ms = timed(forward, [fs], args.iters)
    alone = {f: timed(lambda: update(*f), [us], args.iters) for f in forms}
    best = min(alone.values())
    print(f"{n} parameters; forward {args.batch}x{args.seq} tokens alone "
          f"{f_ms:.3f} ms; best standalone update {best:.3f} ms; forward "
          f"priority {fs.priority}; {torch.cuda.get_device_name()}")
    print("form        blocks  update alone  both at once  visible ms  "
          "visible/best")
    for f in forms:
        both = timed(lambda: (forward(), update(*f)), [fs, us], args.iters)
        vis = both - f_ms
        print(f"{f[0]:<10} {f[1]:>6}  {alone[f]:>12.3f}  {both:>12.3f}  "
              f"{vis:>10.3f}  {vis / best:>11.1%}")


if __name__ == "__main__":
    main()
