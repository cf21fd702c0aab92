"""A training loop under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(set by the caller before torch starts): optimd.torch.AdamW on a CUDA
daemon, each step's gradients (autograd's, in expandable segments) also
given to the same optimizer on a CPU daemon; the parameters must stay
equal bit for bit. zero_grad alternates set_to_none True and False, and one
parameter never has a gradient (not stepped). Run by test_cuda_e2e.py:

    python3 tests/python/expandable_segments_run.py GPU_ADDRESS CPU_ADDRESS SEED
"""
import copy
import sys
import warnings

import torch

from optimd import cuda_ipc
from optimd.torch import AdamW


def main(gpu_address, cpu_address, seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8)).cuda()
    unused = torch.nn.Parameter(torch.randn(33, 7, device="cuda"))
    assert not cuda_ipc.torch_memory_shareable(unused.device), \
        "torch's allocations are shareable: expandable segments are off"
    ref_model = copy.deepcopy(model).cpu()
    ref_unused = torch.nn.Parameter(unused.detach().cpu())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = AdamW(list(model.parameters()) + [unused], lr=1e-2,
                    weight_decay=0.1, address=gpu_address,
                    job_id="expandable-gpu")
    said = [str(w.message) for w in said if "cannot share" in str(w.message)]
    assert len(said) == 1, said  # once, not per parameter
    ref = AdamW(list(ref_model.parameters()) + [ref_unused], lr=1e-2,
                weight_decay=0.1, address=cpu_address,
                job_id="expandable-cpu")
    first_loss = None
    for step in range(20):
        set_to_none = step % 2 == 0
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        x = torch.randn(32, 64, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        first_loss = first_loss or loss.item()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.detach().cpu()
        opt.step()
        ref.step()
        pairs = list(zip(model.parameters(), ref_model.parameters()))
        for i, (p, q) in enumerate(pairs + [(unused, ref_unused)]):
            assert torch.equal(p.detach().cpu(), q.detach()), (step, i)
    assert unused.grad is None
    last_loss = model(x).square().mean().item()
    assert last_loss < first_loss, (first_loss, last_loss)
    opt.close()
    ref.close()
    print("expandable segments: 20 steps equal to the CPU reference; "
          "loss %.5f -> %.5f" % (first_loss, last_loss))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
