"""A training loop under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(set by the caller before torch starts): optimd.torch.AdamW on a CUDA
daemon, each step's gradients (autograd's, in expandable segments) also
given to the same optimizer on a CPU daemon; the parameters must stay
equal bit for bit. The daemon reaches the parameters and gradients where
torch put them (chunk by chunk over its descriptor socket): no warning,
no parameter moved. zero_grad alternates set_to_none True and False, one
parameter never has a gradient (not stepped), and torch.cuda.empty_cache()
between some steps unmaps the freed gradients' chunks, so that the next
backward's gradients may lie in new chunks at the same addresses. Run by
test_cuda_e2e.py:

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
    # The middle weight's gradient (64 MiB, torch's large pool of 20 MiB
    # chunks) spans chunks of its own, past the parameters': freed by
    # zero_grad(set_to_none=True), they are unmapped by empty_cache, and the
    # next backward's gradient is mapped anew at the same addresses.
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 8)).cuda()
    unused = torch.nn.Parameter(torch.randn(33, 7, device="cuda"))
    assert not cuda_ipc.torch_memory_shareable(unused.device), \
        "torch's allocations are shareable: expandable segments are off"
    ref_model = copy.deepcopy(model).cpu()
    ref_unused = torch.nn.Parameter(unused.detach().cpu())
    where = [p.data_ptr() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = AdamW(list(model.parameters()) + [unused], lr=1e-3,
                    weight_decay=0.1, address=gpu_address,
                    job_id="expandable-gpu")
    said = [str(w.message) for w in said if "optimd" in str(w.message)]
    assert not said, said
    ref = AdamW(list(ref_model.parameters()) + [ref_unused], lr=1e-3,
                weight_decay=0.1, address=cpu_address,
                job_id="expandable-cpu")
    x = torch.randn(32, 64, device="cuda")
    y = torch.randn(32, 8, device="cuda")
    with torch.no_grad():
        first_loss = (model(x) - y).square().mean().item()
    frees = torch.cuda.memory_stats()["num_device_free"]
    for step in range(20):
        set_to_none = step % 2 == 0
        opt.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
        if step % 6 == 4:
            torch.cuda.empty_cache()  # unmaps the free chunks
        (model(x) - y).square().mean().backward()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.detach().cpu()
        opt.step()
        ref.step()
        pairs = list(zip(model.parameters(), ref_model.parameters()))
        for i, (p, q) in enumerate(pairs + [(unused, ref_unused)]):
            assert torch.equal(p.detach().cpu(), q.detach()), (step, i)
    assert unused.grad is None
    assert [p.data_ptr() for p in model.parameters()] == where, \
        "parameters moved: the daemon did not step them where they are"
    # empty_cache unmapped chunks: the client saw it and sent anew.
    assert torch.cuda.memory_stats()["num_device_free"] > frees
    with torch.no_grad():
        last_loss = (model(x) - y).square().mean().item()
    assert last_loss < first_loss, (first_loss, last_loss)
    opt.close()
    ref.close()
    print("expandable segments: 20 steps equal to the CPU reference; "
          "loss %.5f -> %.5f" % (first_loss, last_loss))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
