"""End-to-end training benchmark: the same model, data and seed trained with
torch.optim.AdamW(fused=True) and with optimd.torch.AdamW, in one run on one
GPU, timed per iteration (zero_grad + forward + backward [+ clipping] +
step) and per phase.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 bench/train_bench.py

Models (GPT-style decoders, fp32 parameters, bf16 autocast):
  gpt400m   d=2816, 4 layers: about 404M parameters in 52 tensors (wide
            and shallow: eager PyTorch costs the host tens of microseconds
            per op on the GPU machine, so a deep model's iteration is
            host-bound whatever its optimizer)
  gpt24l    d=1024, 24 layers: about 354M parameters in 292 tensors
  deep2400  d=256, 200 layers: about 2,400 tensors
  small30m  d=512, 8 layers: about 30M parameters, where the daemon round
            trip weighs most
each at two batches by default (--batches also takes mid): an
optimizer-heavy one (torch's step is at least 30%
of its iteration; the ratio goals apply there) and one users train with
(at least 16k tokens per step). Clipping at 1.0 is torch's clip_grad_norm_
against optimd's max_grad_norm (the daemon clips inside its step).

With --graphed, every peer's forward and backward run as CUDA graphs
(torch.cuda.make_graphed_callables): a deep model's eager iteration is
bound by Python's per-op cost whatever the optimizer, and graphs are how a
trainer gets past that; the optimizer step and clipping stay eager.
With --graphed_blocks, each transformer block is a graph of its own (the
rest eager), which --overlap can use: each block's replay waits only for
its own parameters' stages.

With --overlap, two more peers in the same run: optimd with overlap=True,
and the same loop without any optimizer and without clipping (zero_grad,
forward, backward), from which the optimizer time still visible in an iteration is
(iteration - iteration without optimizer) / the step's own GPU time.

Iteration time: back-to-back iterations, wall clock over a block of them
with a device sync at the end, alternating torch and optimd blocks (every
other round in reverse order); the median block, and the median of the
ratios of the blocks of one round ("paired": steadier where the host's
speed drifts during the run). Phases: CUDA events and host clocks around each phase of
separate iterations; GPU ms are event gaps (they include time the GPU
waits for the host), host ms are the Python call's own time; medians.
In those separate iterations optimd's step phase also holds the step
request's way to the daemon (its stream cannot start before the request
comes, where back to back it is queued ahead): bench/step_trace.py
breaks back-to-back iterations down instead, the hand-off included.
"""
import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from optimd.testing import Daemon
from optimd.torch import AdamW as OptimdAdamW


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d, layers, heads, vocab, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        # Every weight is read by its own module's forward (what overlap
        # needs: optimd.torch.AdamW's docstring).
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1],
                                                  device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(),
                               targets.flatten())


# name: (model config, optimizer-heavy (batch, seq), users' (batch, seq))
MODELS = {
    "gpt400m": (dict(d=2816, layers=4, heads=22, vocab=8192),
                (1, 512), (8, 2048)),
    "gpt24l": (dict(d=1024, layers=24, heads=16, vocab=50304),
               (1, 256), (8, 2048)),
    "deep2400": (dict(d=256, layers=200, heads=4, vocab=8192),
                 (1, 256), (8, 2048)),
    "small30m": (dict(d=512, layers=8, heads=8, vocab=8192),
                 (1, 256), (16, 1024)),
}


# Between the two: batches where the forward is longer than the optimizer
# step, what overlap needs to hide it (`--batches mid`).
MID = {"gpt400m": (4, 512), "gpt24l": (2, 512), "deep2400": (2, 512),
       "small30m": (4, 256)}


class Trainer:
    """One model and its optimizer, stepping on fixed random batches."""

    def __init__(self, model, make_opt, clip, batches):
        self.model = model
        self.opt = make_opt(model) if make_opt else None
        self.clip = clip
        self.batches = batches
        self.i = 0
        self.graphed = False

    def graph(self):
        """Forward and backward captured in CUDA graphs and replayed
        (torch.cuda.make_graphed_callables), as a host-bound trainer would
        run them: the iteration's host time is then the optimizer's and
        the launches of a few graphs. Autocast's weight cache must be off
        in capture and replay. Gradients come out of the graphs' static
        buffers, at the same addresses every iteration. The sample batch
        is a copy: the graphs keep their sample tensors as their static
        inputs and copy every later batch into them, which would overwrite
        the first batch that every peer shares."""
        sample = tuple(t.clone() for t in self.batches[0])
        with torch.autocast("cuda", dtype=torch.bfloat16,
                            cache_enabled=False):
            torch.cuda.make_graphed_callables(self.model, sample)
        self.graphed = True

    def graph_blocks(self):
        """Each transformer block's forward and backward as CUDA graphs of
        its own, the embeddings, final norm and head eager: with overlap,
        each block's replay waits only for its own parameters' stages
        (optimd waits, for a module whose forward is a graph, for every
        parameter under it)."""
        x, _ = self.batches[0]
        d = self.model.tok.embedding_dim
        blocks = tuple(self.model.blocks)
        # A block takes the fp32 residual stream (autocast's bf16 outputs
        # are added to it) and gives it back.
        sample = tuple((torch.randn(*x.shape, d, device=x.device,
                                    requires_grad=True),) for _ in blocks)
        with torch.autocast("cuda", dtype=torch.bfloat16,
                            cache_enabled=False):
            torch.cuda.make_graphed_callables(blocks, sample)
        self.graphed = True

    def phases(self):
        """(name, callable) of one iteration, in order."""
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        state = {}

        def forward():
            with torch.autocast("cuda", dtype=torch.bfloat16,
                                cache_enabled=not self.graphed):
                state["loss"] = self.model(x, y)

        def clip():
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                               self.clip)
        zero = self.opt.zero_grad if self.opt else self.model.zero_grad
        out = [("zero_grad", zero), ("forward", forward),
               ("backward", lambda: state["loss"].backward())]
        if self.clip is not None:
            out.append(("clip", clip))
        if self.opt is not None:
            out.append(("step", self.opt.step))
        return out, state

    def iterate(self, host=None):
        """One iteration; with `host`, each phase's host seconds are added
        to host[name] (back to back, a phase whose call waits for the GPU
        shows here, where phase_ms's synchronized iterations hide it)."""
        phases, state = self.phases()
        for name, fn in phases:
            t0 = time.perf_counter()
            fn()
            if host is not None:
                host[name] = host.get(name, 0.0) + time.perf_counter() - t0
        return state

    def block_ms(self, iters, host=None):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.iterate(host)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters * 1e3

    def phase_ms(self, iters):
        """Per phase, the median GPU ms (event gaps) and host ms."""
        gpu = {}
        host = {}
        for _ in range(iters):
            phases, _ = self.phases()
            events = [torch.cuda.Event(enable_timing=True)
                      for _ in range(len(phases) + 1)]
            clocks = []
            events[0].record()
            for k, (name, fn) in enumerate(phases):
                t0 = time.perf_counter()
                fn()
                clocks.append((time.perf_counter() - t0) * 1e3)
                events[k + 1].record()
            torch.cuda.synchronize()
            for k, (name, _) in enumerate(phases):
                gpu.setdefault(name, []).append(
                    events[k].elapsed_time(events[k + 1]))
                host.setdefault(name, []).append(clocks[k])
        return ({k: statistics.median(v) for k, v in gpu.items()},
                {k: statistics.median(v) for k, v in host.items()})


def batches(cfg, batch, seq, n=4):
    g = torch.Generator(device="cuda").manual_seed(1234)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg["vocab"], (batch, seq), device="cuda",
                          generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


# Both peers' hyperparameters.
HYPER = dict(lr=3e-4, weight_decay=0.1)


def torch_adamw(model):
    return torch.optim.AdamW(model.parameters(), fused=True, **HYPER)


def optimd_adamw(daemon, job_id, **options):
    """A make_opt for Trainer: optimd.torch.AdamW with `options`."""
    return lambda m: OptimdAdamW(m.parameters(), address=daemon.address,
                                 job_id=job_id, **HYPER, **options)


def make_peers(name, cfg, batch, seq, clip, daemon, args):
    """The trainers of one row, each over its own copy of one model: torch
    fused, optimd, and with --overlap optimd overlapped and no optimizer."""
    torch.manual_seed(0)
    base = GPT(seq=seq, **cfg).cuda()
    data = batches(cfg, batch, seq)

    def optimd(overlap):
        return optimd_adamw(
            daemon, "%s-%d-%s-%s" % (name, batch, clip, overlap),
            max_grad_norm=clip or 0.0, overlap=overlap,
            skip_nonfinite=args.skip_nonfinite)
    peers = {
        "torch": Trainer(copy.deepcopy(base), torch_adamw, clip, data),
        "optimd": Trainer(copy.deepcopy(base), optimd(False), None, data),
    }
    if args.overlap:
        peers["overlap"] = Trainer(copy.deepcopy(base), optimd(True), None,
                                   data)
        # No clipping either: optimd clips inside its step.
        peers["no_opt"] = Trainer(copy.deepcopy(base), None, None, data)
    del base
    if args.graphed:
        for t in peers.values():
            t.graph()
    elif args.graphed_blocks:
        for t in peers.values():
            t.graph_blocks()
    return peers


def run_rounds(peers, client, args):
    """Timed blocks of back-to-back iterations, peers alternating. Returns
    the blocks' ms per iteration, the daemon's own timing of each peer's
    steps ([count, device s, ready-wait s]: device time of the step's work,
    and its stream's wait for the trainer's ready flag), and the host's
    back-to-back seconds per phase."""
    blocks = {k: [] for k in peers}
    device = {k: [0, 0.0, 0.0] for k in peers}
    ahead = {k: {} for k in peers}
    for b in range(args.blocks):
        # Every other round in reverse order, so that a drift of the
        # machine (its host clock) weighs on every peer alike.
        order = list(peers.items())
        for k, t in (order[::-1] if b % 2 else order):
            m0 = client.get_metrics()
            blocks[k].append(t.block_ms(args.iters, ahead[k]))
            m1 = client.get_metrics()
            device[k][0] += m1.step_device_time.count - \
                m0.step_device_time.count
            device[k][1] += m1.step_device_time.sum - m0.step_device_time.sum
            device[k][2] += m1.step_ready_wait.sum - m0.step_ready_wait.sum
    return blocks, device, ahead


def compare(name, cfg, batch, seq, clip, daemon, args):
    peers = make_peers(name, cfg, batch, seq, clip, daemon, args)
    params = sum(p.numel() for p in peers["torch"].model.parameters())
    tensors = len(list(peers["torch"].model.parameters()))
    losses = {}
    for k, t in peers.items():
        for _ in range(args.warmup):
            losses[k] = t.iterate()["loss"].item()
    client = peers["optimd"].opt.client
    moved_before = client.get_metrics().plan_entry_updates
    blocks, device, ahead = run_rounds(peers, client, args)
    # Plan entries the daemon rewrote per step (gradients the allocator
    # moved): 0 in the steady state.
    moved = (client.get_metrics().plan_entry_updates - moved_before) / (
        args.blocks * args.iters)
    phases = {k: t.phase_ms(args.iters) for k, t in peers.items()}
    if args.profile_steps:
        profile_steps(peers["optimd"], args.profile_steps)
    it = {k: statistics.median(v) for k, v in blocks.items()}
    # Ratios of the blocks of one round (run next to each other): steadier
    # than the ratio of medians where the host's speed drifts.
    paired = sorted(o / t for o, t in zip(blocks["optimd"], blocks["torch"]))
    row = dict(model=name, graphed=bool(args.graphed),
               graphed_blocks=bool(args.graphed_blocks), params=params,
               tensors=tensors, batch=batch,
               seq=seq, tokens=batch * seq, clip=clip,
               torch_ms=it["torch"], optimd_ms=it["optimd"],
               ratio=it["optimd"] / it["torch"],
               paired_ratio=statistics.median(paired),
               paired_range=(paired[0], paired[-1]),
               torch_step_share=phases["torch"][0]["step"] / it["torch"],
               optimd_step_share=phases["optimd"][0]["step"] / it["optimd"],
               phases={k: dict(gpu=v[0], host=v[1])
                       for k, v in phases.items()},
               iteration_ms=it,
               back_to_back_host_ms={
                   k: {n: v / (args.blocks * args.iters) * 1e3
                       for n, v in h.items()} for k, h in ahead.items()},
               moved_entries_per_step=moved,
               daemon_device_ms={k: (v[1] / v[0] * 1e3, v[2] / v[0] * 1e3)
                                 for k, v in device.items() if v[0]},
               skip_nonfinite=bool(args.skip_nonfinite),
               native_steps=client.native_steps,
               loss_after_warmup=losses)
    if args.overlap:
        # The optimizer time left in an iteration, as a fraction of the
        # step's own GPU time.
        base_ms = it["no_opt"]
        row["overlap_ratio"] = it["overlap"] / it["torch"]
        row["visible_overlap"] = (it["overlap"] - base_ms) / \
            phases["optimd"][0]["step"]
        row["visible_torch"] = (it["torch"] - base_ms) / \
            phases["torch"][0]["step"]
    for t in peers.values():
        if isinstance(t.opt, OptimdAdamW):
            t.opt.close()
    del peers
    torch.cuda.empty_cache()
    return row


def use_step_call(kind):
    """Client.step_async replaced by a unary Step: blocking on this thread
    ("unary") or a gRPC future ("future"), to measure what the step
    stream's Python threads cost the trainer's thread."""
    import concurrent.futures
    from optimd import client as client_mod

    def unary(self, **kw):
        future = concurrent.futures.Future()
        future.set_result(self._call("Step", self._step_request(**kw)))
        return future

    def grpc_future(self, **kw):
        return self._stub.Step.future(
            self._step_request(**kw), timeout=self.timeout,
            metadata=((client_mod.SESSION_METADATA_KEY, self.token),))
    client_mod.Client.step_async = unary if kind == "unary" else grpc_future


def profile_steps(trainer, iters):
    """cProfile of opt.step() alone over `iters` back-to-back iterations;
    prints the functions taking most of its time."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    step = trainer.opt.step

    def profiled():
        prof.enable()
        step()
        prof.disable()
    trainer.opt.step = profiled
    try:
        trainer.block_ms(iters)
    finally:
        del trainer.opt.step
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(30)
    stats.sort_stats("tottime").print_stats(15)


def _graph_label(r):
    """How a row's forward and backward ran: whole-model graphs, a graph
    per block, or eager."""
    if r["graphed"]:
        return "graphed "
    return "blocks " if r.get("graphed_blocks") else ""


def print_row(r):
    print("%-9s %s%5.0fM %5d tensors  batch %2dx%-4d clip %-4s  torch %8.3f ms"
          "  optimd %8.3f ms  ratio %.3f  step share torch %4.1f%% optimd "
          "%4.1f%%" % (r["model"], _graph_label(r),
                       r["params"] / 1e6, r["tensors"],
                       r["batch"], r["seq"], r["clip"], r["torch_ms"],
                       r["optimd_ms"], r["ratio"],
                       100 * r["torch_step_share"],
                       100 * r["optimd_step_share"]))
    print("    ratio of the blocks of each round: median %.3f, %.3f-%.3f" %
          ((r["paired_ratio"],) + tuple(r["paired_range"])))
    for peer, ph in r["phases"].items():
        print("    %-6s " % peer + "  ".join(
            "%s %.3f/%.3f" % (k, ph["gpu"][k], ph["host"][k])
            for k in ph["gpu"]) + "   (GPU/host ms)")
    for peer, ph in r["back_to_back_host_ms"].items():
        print("    %-6s " % peer + "  ".join(
            "%s %.3f" % kv for kv in ph.items()) +
            "   (host ms back to back, means)")
    print("    loss after warm-up: %s; plan entries moved per step %.2f%s" %
          (" ".join("%s %.5f" % kv for kv in r["loss_after_warmup"].items()),
           r["moved_entries_per_step"],
           "; optimd with skip_nonfinite" if r["skip_nonfinite"] else ""))
    lt, lo = (r["loss_after_warmup"][k] for k in ("torch", "optimd"))
    if abs(lo - lt) > 0.01 * abs(lt):
        # Eager runs agree to four or five digits: the rows compare
        # different training (as run 104's graphed rows did, whose peers
        # shared a graph's static input: bench/RESULTS.md run 105).
        print("    WARNING: torch's and optimd's losses after the warm-up "
              "differ by more than 1%")
    print("    steps through %s" % ("liboptimd_step_channel.so"
                                     if r["native_steps"] else
                                     "grpcio's step stream"))
    for peer, (run, wait) in r.get("daemon_device_ms", {}).items():
        print("    daemon, %s steps: device %.3f ms, ready wait %.3f ms "
              "(means)" % (peer, run, wait))
    if "overlap_ratio" in r:
        it = r["iteration_ms"]
        print("    overlap %.3f ms (ratio %.3f), without optimizer %.3f ms; "
              "visible optimizer time: overlap %.0f%% of optimd's step, "
              "torch %.0f%% of its own" %
              (it["overlap"], r["overlap_ratio"], it["no_opt"],
               100 * r["visible_overlap"], 100 * r["visible_torch"]))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt400m,deep2400,small30m")
    ap.add_argument("--batches", default="heavy,users",
                    help="heavy (optimizer-heavy), mid, users; a list")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--json", default="", help="also write the rows here")
    ap.add_argument("--skip_nonfinite", action="store_true",
                    help="optimd checks every step's gradients for inf/NaN "
                         "and skips such a step (a statistics pass even "
                         "without clipping; by default it checks nothing, "
                         "the same work as torch's fused step)")
    ap.add_argument("--overlap", action="store_true",
                    help="also optimd with overlap=True, and the loop "
                         "without an optimizer")
    ap.add_argument("--graphed", action="store_true",
                    help="every peer's forward and backward captured in CUDA "
                         "graphs and replayed (make_graphed_callables), so "
                         "that a deep model's iteration is not bound by "
                         "Python's per-op cost; not with --overlap")
    ap.add_argument("--graphed_blocks", action="store_true",
                    help="each transformer block's forward and backward "
                         "captured as CUDA graphs of its own, the rest "
                         "eager; with --overlap each block waits for its "
                         "own parameters")
    ap.add_argument("--daemon_env", action="append", default=[],
                    help="KEY=VALUE for the daemon's environment only (e.g. "
                         "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 under MPS)")
    ap.add_argument("--daemon_flag", action="append", default=[],
                    help="a flag for the daemon, attached with '=' "
                         "(e.g. --daemon_flag=--cuda_graphs=false); "
                         "repeatable")
    ap.add_argument("--clips", default="none,1.0",
                    help="which clip rows, a list of none and max norms "
                         "(default: none,1.0; the users batch runs without "
                         "clipping only for gpt400m)")
    ap.add_argument("--step_call", default="stream",
                    choices=("stream", "unary", "future"),
                    help="how optimd's client sends a step: over its step "
                         "stream (liboptimd_step_channel.so where found, "
                         "else grpcio's, whose Python threads take the "
                         "request and read the reply), as a blocking unary Step on the "
                         "trainer's thread, or as a unary Step future "
                         "(gRPC's channel thread completes it)")
    ap.add_argument("--profile_steps", type=int, default=0,
                    help="also profile optimd's opt.step() (cProfile) over "
                         "this many back-to-back iterations of each row")
    ap.add_argument("--queued_send", action="store_true",
                    help="optimd's step requests queued for gRPC's thread "
                         "without waiting for it to take them (how they "
                         "were sent before; bench/step_handoff.py); "
                         "grpcio's stream only: set "
                         "OPTIMD_STEP_CHANNEL=python")
    args = ap.parse_args()
    if args.graphed and args.overlap:
        ap.error("--graphed and --overlap exclude each other: a whole "
                 "model's graph waits for every stage before its replay "
                 "(use --graphed_blocks)")
    if args.graphed and args.graphed_blocks:
        ap.error("--graphed or --graphed_blocks, not both")
    return args


def run_rows(args):
    """Every row asked for, each printed as it is measured."""
    rows = []
    saved = dict(os.environ)
    os.environ.update(kv.split("=", 1) for kv in args.daemon_env)
    # The daemon inherits them; this process does not.
    daemon = Daemon(backend="cuda", flags=args.daemon_flag)
    os.environ.clear()
    os.environ.update(saved)
    with daemon:
        for name in args.models.split(","):
            cfg, heavy, users = MODELS[name]
            for which in args.batches.split(","):
                batch, seq = {"heavy": heavy, "users": users,
                              "mid": MID[name]}[which]
                for clip in [None if c == "none" else float(c)
                             for c in args.clips.split(",")]:
                    if which == "users" and clip is None and name != "gpt400m":
                        continue
                    r = compare(name, cfg, batch, seq, clip, daemon, args)
                    print_row(r)
                    rows.append(r)
    return rows


def main():
    args = parse_args()
    if args.queued_send:
        from optimd import _step_stream
        from step_handoff import queued_send
        _step_stream.StepStream.send = queued_send
    if args.step_call != "stream":
        use_step_call(args.step_call)
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = run_rows(args)
    print("\n== iteration time, optimd / torch fused (same run)")
    for r in rows:
        print("%-9s %stokens %6d clip %-4s ratio %.3f, paired %.3f (torch "
              "step %4.1f%% of its iteration)%s" % (
                  r["model"], _graph_label(r),
                  r["tokens"], r["clip"], r["ratio"],
                  r["paired_ratio"],
                  100 * r["torch_step_share"],
                  "  overlap ratio %.3f, visible %.0f%%" % (
                      r["overlap_ratio"], 100 * r["visible_overlap"])
                  if "overlap_ratio" in r else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
