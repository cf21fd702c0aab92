"""How much device memory torch.cuda.empty_cache() gives back after
zero_grad(set_to_none=True) frees the last step's gradients, with torch's
fused AdamW and with optimd.torch.AdamW on a CUDA daemon (which mapped
those gradients to read them at the step). The device's free memory
(cudaMemGetInfo, every process) is read before zero_grad and after
empty_cache; the gradients are GRAD_MIB MiB in all.

    python3 bench/release_probe.py            # both allocators, each in a
                                              # process of its own
"""
import os
import subprocess
import sys

import torch

GRAD_MIB = 1024  # 16 weights of 4096 x 4096 fp32


def free_mib():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def probe(label, make_opt):
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
               for _ in range(GRAD_MIB // 64)]
    opt = make_opt(weights)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        for w in weights:
            w.grad = torch.randn_like(w)
        opt.step()
    before = free_mib()
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    given = free_mib() - before
    opt.zero_grad(set_to_none=True)
    for w in weights:
        w.grad = torch.randn_like(w)
    opt.step()  # a step after the release: the client looks again
    opt.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    after_next = free_mib() - before
    print("%-44s gradients %5d MiB  given back %7.1f MiB  "
          "after one more step %7.1f MiB" % (label, GRAD_MIB, given,
                                              after_next), flush=True)
    if hasattr(opt, "close"):
        opt.close()


def main(address):
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default allocator")
    probe("torch fused, " + alloc,
          lambda ws: torch.optim.AdamW(ws, lr=1e-3, fused=True))
    torch.cuda.empty_cache()
    from optimd.torch import AdamW
    probe("optimd, " + alloc, lambda ws: AdamW(ws, lr=1e-3, address=address))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        from optimd.testing import Daemon
        with Daemon(backend="cuda") as daemon:
            for conf in (None, "expandable_segments:True"):
                env = dict(os.environ)
                if conf:
                    env["PYTORCH_CUDA_ALLOC_CONF"] = conf
                subprocess.run([sys.executable, __file__, daemon.address],
                               env=env, check=True)
