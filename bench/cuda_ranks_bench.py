"""The cost of the ranks' agreement on the device: two ranks (one process
and one GPU each, one daemon) step 5e8 fp32 parameters each, with
gradient_sharding="sharded" (an NCCL all-reduce inside each step) and
without (each rank on its own), in the same run; per-step wall time over
timed steps, each waited for (opt.synchronize()).

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python python3 bench/cuda_ranks_bench.py
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from optimd.testing import Daemon
from optimd.torch import AdamW


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=5e8)
    ap.add_argument("--tensors", type=int, default=50)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="optimd-ranks-bench-")
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
