"""What one hand-off between two processes' CUDA streams costs when the
waiting side has been blocked for a while, as in a training loop: the
daemon's stream waits through the trainer's backward for the ready flag,
the trainer's stream waits through the daemon's update for the done flag.

Per round, process A (the trainer) runs a spin kernel of `a_us`, writes
ready=i and waits for done>=i; process B (the daemon) waits for ready>=i,
runs a spin kernel of `b_us` and writes done=i. A's CUDA events around
"ready ... done" measure both hand-offs plus B's spin; the script prints
that minus B's spin ("2 hand-offs"), median and 90th percentile.

B's wait on ready, by `mode`:
  flag      a stream memory wait enqueued as soon as B hears of the round
            (the daemon today): blocked for about a_us.
  hostpoll  A's stream also writes ready into pinned host memory; B's host
            polls it and enqueues the spin and done only then (B's stream
            never waits).
  lateflag  B's host polls the host word as hostpoll does, then enqueues
            the stream memory wait (already satisfied) and the rest.

With UPDATE_N, first a training-like loop: A runs matmuls, then an
update of UPDATE_N fp32 elements (a stand-in for the optimizer step) runs
either on A's own stream ("local") or in B behind the flags; milliseconds
per iteration.

    PYTHONPATH=client/python python3 bench/handoff_latency.py \
        [ROUNDS [UPDATE_N [gpt]]]

(gpt: the loop's compute is train_bench's 405M GPT forward and backward
instead of matmuls.)
"""
import statistics
import sys

import torch
import torch.multiprocessing as mp

from optimd import cuda_ipc

CASES = [  # (mode, a_us, b_us)
    ("flag", 0, 0), ("flag", 200, 0), ("flag", 2000, 0), ("flag", 0, 2), ("flag", 0, 10), ("flag", 0, 50),
    ("flag", 0, 100), ("flag", 0, 200), ("flag", 0, 500), ("flag", 0, 1000),
    ("flag", 0, 2000), ("flag", 0, 5000), ("flag", 2000, 2000),
    ("flag", 5000, 3000),
    ("hostpoll", 0, 0), ("hostpoll", 2000, 0), ("hostpoll", 2000, 2000),
    ("hostpoll", 5000, 3000),
    ("lateflag", 2000, 0), ("lateflag", 5000, 3000),
]


def cycles_per_us():
    """torch.cuda._sleep spins for a number of SM clock cycles."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1000.0)


def wait_host_word(host_words, i):
    while int(host_words[0]) < i:
        pass


class Update:
    """A memory-bound stand-in for the optimizer step: `n` fp32 elements
    read and written in a few passes (about what AdamW moves per
    parameter)."""

    def __init__(self, n):
        self.p, self.m, self.v, self.g = (
            torch.rand(n, device="cuda") for _ in range(4))

    def __call__(self):
        self.m.mul_(0.9).add_(self.g, alpha=0.1)
        self.v.mul_(0.999).addcmul_(self.g, self.g, value=0.001)
        self.p.addcdiv_(self.m, self.v.sqrt().add_(1e-8), value=-1e-3)


def side_b(words, host_words, inbox, outbox, update_n):
    """B as the daemon is: one message per round, then wait, work, done."""
    stream = torch.cuda.Stream()
    host = host_words.numpy()
    with torch.cuda.stream(stream):
        update = Update(update_n) if update_n else None
    outbox.put(0)
    while True:
        message = inbox.get()
        if message is None:
            break
        i, mode, cycles = message
        if mode != "flag":
            wait_host_word(host, i)
        if mode != "hostpoll":
            cuda_ipc.stream_wait_value32(stream, words.data_ptr(), i)
        with torch.cuda.stream(stream):
            if cycles < 0:
                update()
            elif cycles:
                torch.cuda._sleep(cycles)
        cuda_ipc.stream_write_value32(stream, words.data_ptr() + 4, i)
        outbox.put(i)
    stream.synchronize()


def run_case(a, words, host_dev, inbox, outbox, first, rounds, mode, a_cyc,
             b_cyc):
    """Rounds first..first+rounds-1; A's host runs at most two rounds
    ahead of B's replies, as the trainer's does."""
    pairs = [(torch.cuda.Event(enable_timing=True),
              torch.cuda.Event(enable_timing=True)) for _ in range(rounds)]
    replies = first - 1
    for k in range(rounds):
        i = first + k
        if a_cyc:
            with torch.cuda.stream(a):
                torch.cuda._sleep(a_cyc)
        pairs[k][0].record(a)
        if mode != "flag":
            cuda_ipc.stream_write_value32(a, host_dev, i)
        cuda_ipc.stream_write_value32(a, words.data_ptr(), i)
        inbox.put((i, mode, b_cyc))
        cuda_ipc.stream_wait_value32(a, words.data_ptr() + 4, i)
        pairs[k][1].record(a)
        while i - replies > 2:
            replies = outbox.get()
    while replies < first + rounds - 1:
        replies = outbox.get()
    a.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in pairs]


def loop_case(a, words, host_dev, inbox, outbox, first, rounds, mode,
              compute, update):
    """A training-like loop: compute (matmuls), then the update, either on
    A's own stream (mode "local", torch's way) or in B behind the flags;
    milliseconds per iteration, from A's stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    replies = first - 1
    start.record(a)
    for k in range(rounds):
        i = first + k
        with torch.cuda.stream(a):
            compute()
            if mode == "local":
                update()
                continue
        if mode != "flag":
            cuda_ipc.stream_write_value32(a, host_dev, i)
        cuda_ipc.stream_write_value32(a, words.data_ptr(), i)
        inbox.put((i, mode, -1))
        cuda_ipc.stream_wait_value32(a, words.data_ptr() + 4, i)
        while i - replies > 2:
            replies = outbox.get()
    end.record(a)
    while mode != "local" and replies < first + rounds - 1:
        replies = outbox.get()
    end.synchronize()
    return start.elapsed_time(end) / rounds


def matmuls():
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def compute():
        y = x
        for _ in range(16):
            y = torch.mm(y, x) * 0.01
    return compute, "16 bf16 4096^3 matmuls"


def gpt_step():
    """train_bench's 405M GPT, forward and backward at 512 tokens (many
    kernels, a host barely ahead of its GPU)."""
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import train_bench
    cfg, (batch, seq), _ = train_bench.MODELS["gpt400m"]
    model = train_bench.GPT(seq=seq, **cfg).cuda()
    (x, y), = train_bench.batches(cfg, batch, seq, n=1)

    def compute():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
    return compute, "gpt400m forward and backward"


def run_loops(a, words, host_words, inbox, outbox, first, rounds, update_n,
              gpt):
    with torch.cuda.stream(a):
        compute, what = gpt_step() if gpt else matmuls()
        update = Update(update_n)
    print("%-9s %12s   (compute: %s; update: %.0e fp32 elements)" % (
        "loop mode", "ms per iter", what, update_n))
    for mode in ("local", "flag", "hostpoll", "local", "flag", "hostpoll"):
        ms = loop_case(a, words, host_words.data_ptr(), inbox, outbox, first,
                       rounds, mode, compute, update)
        first += rounds
        print("%-9s %12.3f" % (mode, ms))
        sys.stdout.flush()
    return first


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    update_n = int(float(sys.argv[2])) if len(sys.argv) > 2 else 0
    gpt = len(sys.argv) > 3 and sys.argv[3] == "gpt"
    per_us = cycles_per_us()
    words = torch.zeros(2, dtype=torch.int32, device="cuda")
    host_words = torch.zeros(2, dtype=torch.int32).share_memory_()
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(host_words.data_ptr(), 8, 3)  # portable|mapped
    assert int(err) == 0, "cudaHostRegister failed: %s" % err
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=side_b,
                        args=(words, host_words, inbox, outbox, update_n))
    child.start()
    outbox.get()
    a = torch.cuda.Stream()
    print("%-9s %7s %7s %14s %14s" % ("mode", "A us", "B us",
                                      "2 hand-offs us", "p90 us"))
    first = 1
    if update_n:
        first = run_loops(a, words, host_words, inbox, outbox, first,
                          rounds, update_n, gpt)
    for mode, a_us, b_us in CASES:
        us = run_case(a, words, host_words.data_ptr(), inbox, outbox, first,
                      rounds, mode, int(a_us * per_us), int(b_us * per_us))
        first += rounds
        us = sorted(x - b_us for x in us[5:])  # the first rounds warm up
        print("%-9s %7d %7d %14.1f %14.1f" % (
            mode, a_us, b_us, statistics.median(us),
            us[int(0.9 * (len(us) - 1))]))
        sys.stdout.flush()
    inbox.put(None)
    child.join(timeout=30)


if __name__ == "__main__":
    main()
