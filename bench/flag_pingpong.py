"""How long one hand-off through stream memory operations takes: two CUDA
streams (in one process, or in two processes over CUDA IPC) order each
other through 32-bit flags, as the trainer's and the daemon's streams do
with step flags. Per round: A writes ready=i and waits done>=i; B waits
ready>=i, runs `work` (a small kernel or nothing) and writes done=i.
The "paced" variants run as the trainer and the daemon do: one host
message per round (the request), B enqueueing its round only then, and
B's wait on A's ready through a flag or through A's interprocess event.

    PYTHONPATH=client/python python3 bench/flag_pingpong.py [VARIANT...]

Each variant runs in a process of its own with a 60 s timeout: in one
process, a kernel between B's wait and its write hung once (run 12 in
bench/RESULTS.md), and a hang must not hide the other variants.
"""
import sys
import time

import torch
import torch.multiprocessing as mp

from optimd import cuda_ipc

ROUNDS = 200


def side_b(stream, words, work, rounds, first=1):
    for i in range(first, rounds + 1):
        cuda_ipc.stream_wait_value32(stream, words.data_ptr(), i)
        if work is not None:
            with torch.cuda.stream(stream):
                work.add_(1)
        cuda_ipc.stream_write_value32(stream, words.data_ptr() + 4, i)


def side_a(stream, words, rounds, first=1):
    for i in range(first, rounds + 1):
        cuda_ipc.stream_write_value32(stream, words.data_ptr(), i)
        cuda_ipc.stream_wait_value32(stream, words.data_ptr() + 4, i)


def one_process(where, with_work):
    """Rounds enqueued alternately on the two streams (all of B's rounds
    first can fill B's queue while it waits, blocking the host that would
    enqueue A's: the hang of run 12)."""
    if where == "device":
        words = torch.zeros(2, dtype=torch.int32, device="cuda")
    else:
        words = torch.zeros(2, dtype=torch.int32).pin_memory()
    work = torch.zeros(1024, device="cuda") if with_work else None
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, ROUNDS + 1):
        side_b(b, words, work, i, first=i)
        side_a(a, words, i, first=i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / ROUNDS * 1e6


def child(words, work, ready, rounds):
    stream = torch.cuda.Stream()
    side_b(stream, words, work, rounds)
    ready.put(1)
    stream.synchronize()


def two_processes(with_work):
    """B enqueues every round at once; A's rounds then run against them."""
    words = torch.zeros(2, dtype=torch.int32, device="cuda")
    work = torch.zeros(1024, device="cuda") if with_work else None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(words, work, q, ROUNDS))
    p.start()
    q.get()  # the child has enqueued its side
    a = torch.cuda.Stream()
    t0 = time.perf_counter()
    side_a(a, words, ROUNDS)
    a.synchronize()
    us = (time.perf_counter() - t0) / ROUNDS * 1e6
    p.join()
    return us


EVENT_RING = 4


def paced_child(words, events, work, inbox, outbox, rounds):
    """B as the daemon is: per round a message ("step i"), then wait for
    A's ready (a flag, or A's interprocess event of the round), the work,
    and the done flag."""
    stream = torch.cuda.Stream()
    ring = None
    if events is not None:
        ring = [torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(),
                                                 h) for h in events]
    outbox.put(0)
    for i in range(1, rounds + 1):
        assert inbox.get() == i
        if ring is None:
            cuda_ipc.stream_wait_value32(stream, words.data_ptr(), i)
        else:
            stream.wait_event(ring[i % EVENT_RING])
        if work is not None:
            with torch.cuda.stream(stream):
                work.add_(1)
        cuda_ipc.stream_write_value32(stream, words.data_ptr() + 4, i)
        outbox.put(i)  # the reply
    stream.synchronize()


def paced(ready_by, with_work):
    """A as the trainer is: per round mark ready (flag or event), send the
    round, wait on its stream for done, never wait for the reply on the
    host by more than two rounds."""
    words = torch.zeros(2, dtype=torch.int32, device="cuda")
    work = torch.zeros(1 << 20, device="cuda") if with_work else None
    ring = None
    if ready_by == "event":
        ring = [torch.cuda.Event(interprocess=True, blocking=False)
                for _ in range(EVENT_RING)]
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=paced_child, args=(
        words, [e.ipc_handle() for e in ring] if ring else None, work,
        inbox, outbox, ROUNDS))
    p.start()
    outbox.get()
    a = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    replies = 0
    for i in range(1, ROUNDS + 1):
        if ring is None:
            cuda_ipc.stream_write_value32(a, words.data_ptr(), i)
        else:
            ring[i % EVENT_RING].record(a)
        inbox.put(i)
        cuda_ipc.stream_wait_value32(a, words.data_ptr() + 4, i)
        while i - replies > 2:
            replies = outbox.get()
    a.synchronize()
    us = (time.perf_counter() - t0) / ROUNDS * 1e6
    p.join()
    return us


VARIANTS = {
    "one-process": lambda: one_process("device", False),
    "one-process-kernel": lambda: one_process("device", True),
    "two-processes": lambda: two_processes(False),
    "two-processes-kernel": lambda: two_processes(True),
    "paced-flags": lambda: paced("flag", False),
    "paced-events": lambda: paced("event", False),
    "paced-flags-kernel": lambda: paced("flag", True),
    "paced-events-kernel": lambda: paced("event", True),
}


def main():
    """Each variant in a process of its own, with a timeout: a variant
    that hangs is reported and the others still run."""
    import subprocess
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print("%-22s %8.1f us per round" % (sys.argv[2],
                                            VARIANTS[sys.argv[2]]()))
        return
    names = sys.argv[1:] or list(VARIANTS)
    for name in names:
        try:
            out = subprocess.run([sys.executable, __file__, "--variant", name],
                                 capture_output=True, text=True, timeout=60)
            print(out.stdout.strip() or "%-22s failed: %s" % (
                name, out.stderr.strip().splitlines()[-1:]))
        except subprocess.TimeoutExpired:
            print("%-22s did not finish within 60 s" % name)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
