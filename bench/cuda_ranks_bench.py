"""The cost of the ranks' agreement on the device: two ranks (one process
and one GPU each, one daemon) step 5e8 fp32 parameters each, with
gradient_sharding="sharded" (an NCCL all-reduce inside each step) and
without (each rank on its own), in the same run; per-step wall time over
timed steps, each waited for (opt.synchronize()).

With --zero, ZeRO for DDP in the same run instead: the step of every rank
holding the whole (already all-reduced) gradient of 5e8 fp32 parameters,
clipped to norm 1.0, with optimd.torch.AdamW(shard_state=True) (each
daemon session updates half and the halves are gathered through NCCL),
torch.distributed.optim.ZeroRedundancyOptimizer over torch's fused AdamW
(NCCL process group), and DDP's usual torch.optim.AdamW(fused=True) on
every rank; with each one's optimizer state per rank (optimd: the
daemon's state bytes of the rank's session; torch: the memory the
optimizer allocated on the rank's GPU).

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 bench/cuda_ranks_bench.py [--zero]
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimd.testing import Daemon, session_state_bytes
from optimd.torch import AdamW

MAX_NORM = 1.0


def _rank(rank, init_file, address, params, tensors, steps, out):
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    per = params // tensors
    ps = [torch.nn.Parameter(torch.randn(per, device="cuda"))
          for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    results = {}
    for sharding in (None, "sharded") * 3:
        opt = AdamW(ps, lr=1e-4, address=address, max_grad_norm=1.0,
                    gradient_sharding=sharding)
        for _ in range(3):
            opt.step()
        opt.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.step()
        opt.synchronize()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / steps * 1e3
        results.setdefault(str(sharding), []).append(ms)
        opt.close()
        dist.barrier()
    torch.save(results, out % rank)


def _timed(step, steps):
    """Milliseconds per step over `steps` steps after three warm-up ones,
    the device drained before and after."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3




def _zero_rank(rank, init_file, address, params, tensors, steps, out):
    """One DDP rank: the three optimizers in turn, three blocks each."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    dist.init_process_group("gloo", init_method="file://" + init_file,
                            rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl")
    per = params // tensors
    torch.manual_seed(0)  # the same model and gradient on both ranks
    ps = [torch.nn.Parameter(torch.randn(per, device="cuda") * 0.02)
          for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)

    def clipped(opt):
        def step():
            torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)
            opt.step()
        return step

    times, state = {}, {}
    for _ in range(3):
        opt = AdamW(ps, lr=1e-4, address=address, max_grad_norm=MAX_NORM,
                    shard_state=True)
        # The trainer's stream waits for each step's done flag, so the
        # device drain at the end of _timed waits for the daemon's work.
        times.setdefault("optimd", []).append(_timed(opt.step, steps))
        opt.synchronize()  # raises a failed step's error
        state["optimd"] = session_state_bytes(address, opt._identity["job"],
                                               rank)
        opt.close()
        dist.barrier()
        for name, make in (
                ("zero", lambda: ZeroRedundancyOptimizer(
                    ps, optimizer_class=torch.optim.AdamW,
                    process_group=nccl, lr=1e-4, fused=True)),
                ("fused", lambda: torch.optim.AdamW(ps, lr=1e-4,
                                                    fused=True))):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            opt = make()
            times.setdefault(name, []).append(_timed(clipped(opt), steps))
            state[name] = torch.cuda.memory_allocated() - before
            del opt
            torch.cuda.empty_cache()
            dist.barrier()
    torch.save({"times": times, "state": state}, out % rank)
    dist.destroy_process_group()


def zero_main(a, scratch):
    out = os.path.join(scratch, "zero%d.pt")
    with Daemon(backend="cuda") as d:
        mp.start_processes(
            _zero_rank, nprocs=2, start_method="spawn",
            args=(os.path.join(scratch, "init"), d.address, int(a.params),
                  a.tensors, a.steps, out))
    res = [torch.load(out % r) for r in (0, 1)]
    whole = 8 * int(a.params)  # AdamW's two fp32 moments
    print("ZeRO for DDP: %.0e fp32 params per rank in %d tensors, whole "
          "gradients, clip %.1f; best of 3 blocks of %d steps"
          % (a.params, a.tensors, MAX_NORM, a.steps))
    print("%-44s %10s %14s %9s" % ("", "step ms", "state MiB/rank", "of 1/N"))
    names = (("optimd", "optimd AdamW(shard_state=True)"),
             ("zero", "ZeroRedundancyOptimizer(fused AdamW)"),
             ("fused", "DDP + torch.optim.AdamW(fused=True)"))
    step = {}
    for key, label in names:
        # The job steps at its slower rank's pace.
        step[key] = max(min(r["times"][key]) for r in res)
        mib = max(r["state"][key] for r in res) / 2**20
        print("%-44s %10.3f %14.1f %9.2f" % (label, step[key], mib,
                                             mib * 2**20 / (whole / 2)))
    print("optimd / ZeroRedundancyOptimizer step: %.3f (goal <= 0.5); "
          "optimd / DDP fused AdamW: %.3f"
          % (step["optimd"] / step["zero"], step["optimd"] / step["fused"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=5e8)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--zero", action="store_true",
                    help="ZeRO for DDP against ZeroRedundancyOptimizer and "
                    "DDP + fused AdamW")
    a = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="optimd-ranks-bench-")
    if a.zero:
        zero_main(a, scratch)
        return
    out = os.path.join(scratch, "rank%d.pt")
    with Daemon(backend="cuda") as d:
        mp.start_processes(
            _rank, nprocs=2, start_method="spawn",
            args=(os.path.join(scratch, "init"), d.address, int(a.params),
                  a.tensors, a.steps, out))
    res = [torch.load(out % r) for r in (0, 1)]
    for r in (0, 1):
        print("rank %d: %.0e fp32 params in %d tensors, clip 1.0: alone "
              "%.3f ms, ranks agree (NCCL) %.3f ms (best of %d blocks of %d "
              "steps)" % (r, a.params, a.tensors, min(res[r]["None"]),
                          min(res[r]["sharded"]), len(res[r]["None"]),
                          a.steps))
    # Agreeing ranks step together: the job against its slower rank alone.
    alone = max(min(x["None"]) for x in res)
    agreed = max(min(x["sharded"]) for x in res)
    print("job: slower rank alone %.3f ms, ranks agree %.3f ms, ratio %.3f"
          % (alone, agreed, agreed / alone))


if __name__ == "__main__":
    main()
