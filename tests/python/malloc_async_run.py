"""An optimizer on a GPU whose torch allocator is cudaMallocAsync's pool,
which CUDA IPC cannot export and which takes no out-of-memory observers:
the optimizer is built (parameters move into its own buffers, with the
warning that says so), trains a small model, and its parameters agree with
torch's fused AdamW. Run by test_cuda_e2e.py, in a process of its own since
the allocator is chosen before CUDA starts:

    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \\
        python3 tests/python/malloc_async_run.py GPU_ADDRESS

Prints "allocator cudaMallocAsync, steps done".
"""
import sys
import warnings

import torch

from optimd.torch import AdamW


def main(address):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 1)).cuda()
    theirs = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                 torch.nn.Linear(128, 1)).cuda()
    theirs.load_state_dict(ours.state_dict())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        opt = AdamW(ours.parameters(), lr=1e-2, address=address,
                    job_id="malloc-async")
    assert any("cannot reach torch's allocations" in str(w.message)
               for w in said), [str(w.message) for w in said]
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, fused=True)
    for _ in range(20):
        x = torch.randn(32, 64, device="cuda")
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    torch.cuda.synchronize()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5,
                                   atol=1e-5)
    opt.close()
    print("allocator %s, steps done" % torch.cuda.get_allocator_backend(),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
