"""Where a training iteration's GPU time goes, phase by phase and across the
hand-off between the trainer's context and the daemon's: torch's fused
AdamW and optimd.torch.AdamW, the same model, data and seed, back-to-back
iterations in alternating blocks, one run.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python:bench python3 bench/step_trace.py

Each phase boundary is stamped on the trainer's stream with the GPU's
global timer (a one-thread kernel, through CuPy), and optimd's step flags
are 32 bytes, so that the daemon's stream writes its own stamps of each
step's start (after its wait for the ready flag) and end (before it writes
done) on the same clock (StepRequest.step_flags). Per peer, medians over
the traced iterations, in ms:

  zero_grad, forward, backward, clip   the trainer's phases
  step                                 from the end of clipping (or of
                                       backward) to the end of opt.step()'s
                                       work on the stream
  optimd only:
    before_ready   step() up to its ready flag (copies of gradients the
                   client stages, if any)
    to_daemon      ready flag written -> the daemon's stream starts
    daemon         the daemon's work on the step
    to_trainer     the daemon's end -> the trainer's stream goes on
    after_done     after the wait for done to the end of step()
  idle                                 the end of one iteration's work
                                       to the start of the next (the GPU
                                       waiting for the trainer's host)
  iteration                            start to start

Every stamp is one more small kernel on the trainer's stream, for both
peers alike; the iteration times are a little longer than
bench/train_bench.py's.
"""
import argparse
import statistics
import warnings

import cupy
import torch

from optimd._step_flags import StepFlags
from train_bench import MODELS, MID, make_peers
from optimd.testing import Daemon

_STAMP = cupy.RawKernel(r'''
extern "C" __global__ void stamp(unsigned long long* where) {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *where = now;
}''', "stamp")

# Slots of one iteration's row in the ring.
SLOTS = dict(start=0, zero_grad=1, forward=2, backward=3, clip=4, ready=5,
             done=6, step=7, daemon_began=8, daemon_ended=9)


class Ring:
    """Stamps of `n` iterations on the trainer's stream, read after."""

    def __init__(self, n):
        self.rows = torch.zeros((n, len(SLOTS)), dtype=torch.int64,
                                device="cuda")
        self.i = 0

    def stamp(self, slot):
        where = self.rows.data_ptr() + 8 * (self.i * len(SLOTS) + SLOTS[slot])
        stream = torch.cuda.current_stream().cuda_stream
        with cupy.cuda.ExternalStream(stream):
            _STAMP((1,), (1,), (cupy.uint64(where),))

    def copy_daemon_stamps(self, words):
        # After the wait for done: the daemon wrote them before done.
        self.rows[self.i, 8:10].copy_(words[4:8].view(torch.int64))


def traced(trainer, ring):
    """One iteration, its phase boundaries stamped into ring's row."""
    phases, state = trainer.phases()
    ring.stamp("start")
    for name, fn in phases:
        fn()
        ring.stamp(name)
    return state


def stamp_step_flags(opt, ring):
    """optimd's step flags made 32 bytes before the first step (private to
    the client: a diagnostic of this bench), and stamps around the
    hand-off."""
    flags = StepFlags(opt._device, stamps=True)
    opt._flags = flags
    mark_ready, wait_done = flags.mark_ready, flags.wait_done

    def ready(stream, staged=False):
        ring.stamp("ready")
        mark_ready(stream, staged)

    def done(stream):
        wait_done(stream)
        ring.stamp("done")
        ring.copy_daemon_stamps(flags.words)
    flags.mark_ready, flags.wait_done = ready, done


def spans(rows, clip, is_optimd):
    """Per iteration (but the last), the named spans in ms."""
    ms = 1e-6
    out = {}
    for r, nxt in zip(rows[:-1], rows[1:]):
        before_step = r[SLOTS["clip"]] if clip else r[SLOTS["backward"]]
        span = dict(zero_grad=r[1] - r[0], forward=r[2] - r[1],
                    backward=r[3] - r[2], step=r[7] - before_step,
                    idle=nxt[0] - r[7], iteration=nxt[0] - r[0])
        if clip:
            span["clip"] = r[4] - r[3]
        if is_optimd:
            span.update(before_ready=r[5] - before_step, to_daemon=r[8] - r[5],
                        daemon=r[9] - r[8], to_trainer=r[6] - r[9],
                        after_done=r[7] - r[6])
        for k, v in span.items():
            out.setdefault(k, []).append(v * ms)
    return out


def row(name, batch, seq, clip, daemon, args):
    # train_bench's peers, plain: no overlap, no graphs, torch's
    # non-finite semantics (the defaults main() sets on args).
    peers = make_peers(name, MODELS[name][0], batch, seq, clip, daemon, args)
    rings = {k: Ring(args.iters) for k in peers}
    stamp_step_flags(peers["optimd"].opt, rings["optimd"])
    for t in peers.values():
        for _ in range(args.warmup):
            t.iterate()
    got = {k: {} for k in peers}
    for b in range(args.blocks):
        order = list(peers)
        for k in (order[::-1] if b % 2 else order):
            ring = rings[k]
            torch.cuda.synchronize()
            for ring.i in range(args.iters):
                traced(peers[k], ring)
            torch.cuda.synchronize()
            rows = ring.rows.cpu().tolist()
            for s, v in spans(rows, peers[k].clip, k == "optimd").items():
                got[k].setdefault(s, []).extend(v)
    return {k: {s: statistics.median(v) for s, v in d.items()}
            for k, d in got.items()}


def print_row(label, result):
    print("\n== %s (ms, medians)" % label)
    names = []
    for d in result.values():
        names += [n for n in d if n not in names]
    print("%-13s" % "" + "".join("%10s" % k for k in result))
    for n in names:
        print("%-13s" % n + "".join(
            "%10.3f" % d[n] if n in d else "%10s" % "" for d in
            result.values()))
    it = result["optimd"]["iteration"] / result["torch"]["iteration"]
    print("iteration ratio, optimd / torch: %.3f" % it)


def main():
    # CuPy's ExternalStream: deprecated in newer CuPy, still the call that
    # takes a bare stream handle.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt400m")
    ap.add_argument("--batches", default="heavy", help="heavy, mid, users")
    ap.add_argument("--clips", default="none,1.0")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--daemon_flag", action="append", default=[])
    ap.set_defaults(overlap=False, skip_nonfinite=False, graphed=False,
                    graphed_blocks=False)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    with Daemon(backend="cuda", flags=args.daemon_flag) as daemon:
        for name in args.models.split(","):
            for which in args.batches.split(","):
                batch, seq = {"heavy": MODELS[name][1],
                              "users": MODELS[name][2],
                              "mid": MID[name]}[which]
                for c in args.clips.split(","):
                    clip = None if c == "none" else float(c)
                    print_row("%s %s (batch %d x %d), clip %s" % (
                        name, which, batch, seq, c),
                        row(name, batch, seq, clip, daemon, args))


if __name__ == "__main__":
    main()
