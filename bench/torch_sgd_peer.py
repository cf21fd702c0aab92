"""torch.optim.SGD(momentum=0.9, fused=True) per step on the GPU, the peer
of `cuda_step_bench --optimizer=sgd` (same parameter count and tensor
count, fp32; CUDA events around back-to-back steps).

    python3 bench/torch_sgd_peer.py --params 1e9 --tensors 1000
"""
import argparse

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    per = int(a.params) // a.tensors
    ps = [torch.nn.Parameter(torch.randn(per, device="cuda"))
          for _ in range(a.tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
        enable_timing=True)
    s.record()
    for _ in range(a.steps):
        opt.step()
    e.record()
    torch.cuda.synchronize()
    print("torch SGD(momentum=0.9, fused=True) fp32, %d params in %d "
          "tensors: %.3f ms per step" % (per * a.tensors, a.tensors,
                                         s.elapsed_time(e) / a.steps))


if __name__ == "__main__":
    main()
