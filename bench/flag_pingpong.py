"""How long one hand-off through stream memory operations takes: two CUDA
streams (in one process, or in two processes over CUDA IPC) order each
other through 32-bit flags, as the trainer's and the daemon's streams do
with step flags. Per round: A writes ready=i and waits done>=i; B waits
ready>=i, runs `work` (a small kernel or nothing) and writes done=i.

    PYTHONPATH=client/python python3 bench/flag_pingpong.py

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


def side_b(stream, words, work, rounds):
    for i in range(1, rounds + 1):
        cuda_ipc.stream_wait_value32(stream, words.data_ptr(), i)
        if work is not None:
            with torch.cuda.stream(stream):
                work.add_(1)
        cuda_ipc.stream_write_value32(stream, words.data_ptr() + 4, i)


def side_a(stream, words, rounds):
    for i in range(1, rounds + 1):
        cuda_ipc.stream_write_value32(stream, words.data_ptr(), i)
        cuda_ipc.stream_wait_value32(stream, words.data_ptr() + 4, i)


def one_process(where, with_work):
    if where == "device":
        words = torch.zeros(2, dtype=torch.int32, device="cuda")
    else:
        words = torch.zeros(2, dtype=torch.int32).pin_memory()
    work = torch.zeros(1024, device="cuda") if with_work else None
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    side_b(b, words, work, ROUNDS)
    side_a(a, words, ROUNDS)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / ROUNDS * 1e6


def child(words, work, ready, rounds):
    stream = torch.cuda.Stream()
    side_b(stream, words, work, rounds)
    ready.put(1)
    stream.synchronize()


def two_processes(with_work):
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


VARIANTS = {
    "one-process": lambda: one_process("device", False),
    "one-process-kernel": lambda: one_process("device", True),
    "two-processes": lambda: two_processes(False),
    "two-processes-kernel": lambda: two_processes(True),
}


def main():
    """Each variant in a process of its own, with a timeout: a variant
    that hangs is reported and the others still run."""
    import subprocess
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        print("%-22s %8.1f us per round" % (sys.argv[2],
                                            VARIANTS[sys.argv[2]]()))
        return
    for name in ("two-processes", "one-process", "two-processes-kernel",
                 "one-process-kernel"):
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
