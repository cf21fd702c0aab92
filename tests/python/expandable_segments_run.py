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

With a fourth argument, `release-in-copy`, it runs release_in_copy
instead; `release-in-copy-one-pass` runs it with the client's updates
built once (as before the client built them again), which must fail.
`side-release` runs release_on_a_side_stream, and `side-release-unheld`
its negative control. `oom-release` runs out_of_memory, and
`oom-release-held` its negative control.
"""
import copy
import sys
import warnings

import torch

from optimd import cuda_ipc
from optimd._grads import GradRouter
from optimd._vmm import VmmSharer, close_channels
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


def release_in_copy(gpu_address, cpu_address, seed, one_pass=False):
    """A gradient the client must copy for the daemon (its strides are not
    its parameter's) while torch releases cached memory to make room for
    that copy, as its allocator does when an allocation would exceed the
    device (torch.cuda.empty_cache() at the copy's start stands in for that
    release, once a step). The copy is then mapped at the address of a
    chunk the daemon was sent earlier (the other parameter's freed
    gradient): the client must name the copy's new chunk, not the old."""
    torch.manual_seed(seed)
    # Gradients of 128 and 64 MiB, chunks of their own in the large pool:
    # the hole the first leaves when unmapped holds the second's copy
    # (torch maps a new block in the smallest unmapped range it fits).
    n = 4096
    shapes = [(2 * n, n), (n, n)]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 1e-2)
              for s in shapes]
    refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    opt = AdamW(params, lr=1e-3, address=gpu_address,
                job_id="release-in-copy-gpu")
    ref = AdamW(refs, lr=1e-3, address=cpu_address,
                job_id="release-in-copy-cpu")
    if one_pass:
        GradRouter.updates = GradRouter._updates_once
    checked = GradRouter._checked
    release = [False]

    freed = [0]  # where the first parameter's last gradient was

    def releasing_checked(router, s, grad):
        if not (grad.is_cuda and release[0]):
            return checked(router, s, grad)
        release[0] = False
        torch.cuda.empty_cache()
        copy = checked(router, s, grad)
        print("copy at %+d bytes from the freed gradient"
              % (copy.data_ptr() - freed[0]))
        return copy

    GradRouter._checked = releasing_checked
    frees = torch.cuda.memory_stats()["num_device_free"]
    for step in range(6):
        if step % 2 == 0:
            grads = [torch.randn(shapes[0], device="cuda"), None]
        else:
            # Made while the first gradient still holds its chunks; that
            # gradient is then freed, and the copy of this one may take
            # its addresses.
            grads = [None, torch.randn(n, n, device="cuda").t()]
            release[0] = True
        if params[0].grad is not None:
            freed[0] = params[0].grad.data_ptr()
        for p, q, g in zip(params, refs, grads):
            p.grad = g
            q.grad = None if g is None else g.cpu()
        del grads, g
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, refs)):
            assert torch.equal(p.detach().cpu(), q.detach()), (step, i)
    assert torch.cuda.memory_stats()["num_device_free"] > frees
    opt.close()
    ref.close()
    print("release in copy: 6 steps equal to the CPU reference")


def release_on_a_side_stream(gpu_address, cpu_address, seed, unheld=False):
    """A release torch makes on another stream (its unmap synchronizes
    that stream only) while the daemon is steps behind: the trainer's
    stream sleeps before its first step's ready flag, so the daemon's
    device worker waits for a step record with later steps queued behind
    it. Each release makes the client forget every chunk and send each
    step's gradient by ids of a new descriptor connection; the retired
    connection must stay open until the steps that name its ids are
    answered. `unheld`: the client closes it at once (as it did before),
    which must fail."""
    torch.manual_seed(seed)
    n = 1024  # 4 MiB: torch's large pool
    p = torch.nn.Parameter(torch.randn(n, n, device="cuda"))
    q = torch.nn.Parameter(p.detach().cpu())
    opt = AdamW([p], lr=1e-3, address=gpu_address, job_id="side-release-gpu")
    ref = AdamW([q], lr=1e-3, address=cpu_address, job_id="side-release-cpu")
    if unheld:
        take = VmmSharer.take_retired

        def closing_at_once(sharer):
            close_channels(take(sharer))
            return []

        VmmSharer.take_retired = closing_at_once
    steps = 16  # twice the daemon's step records
    grads = [torch.randn(n, n, device="cuda") for _ in range(steps)]
    cpu_grads = [g.cpu() for g in grads]
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no free chunk on the trainer's stream
    frees = torch.cuda.memory_stats()["num_device_free"]
    torch.cuda._sleep(4_000_000_000)  # about 2 s of the trainer's stream
    for step in range(steps):
        p.grad = grads[step]
        q.grad = cpu_grads[step]
        with torch.cuda.stream(side):
            scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del scratch
        torch.cuda.empty_cache()  # unmaps the side stream's chunks
        opt.step()
        ref.step()
    opt.synchronize()
    assert torch.equal(p.detach().cpu(), q.detach()), "differs"
    assert torch.cuda.memory_stats()["num_device_free"] >= frees + steps
    opt.close()
    ref.close()
    print("side-stream releases: %d steps equal to the CPU reference"
          % steps)


def out_of_memory(gpu_address, cpu_address, seed, release=True):
    """Gradients set to None, whose chunks torch unmaps as it retries before
    an out-of-memory error: the daemon holds their descriptors and
    mappings, so that memory stays allocated unless the client's
    out-of-memory observer has the daemon let go (optimd/_oom_release.py).
    Prints whether an allocation of 400 MiB more than was free before the
    error then succeeds (the driver's free-memory count shows memory freed
    by the daemon's process only later); the steps before and after equal
    the CPU reference. `release` False: the control, whose observer does
    nothing."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
              for _ in range(8)]  # 512 MiB of gradients
    refs = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    opt = AdamW(params, lr=1e-3, address=gpu_address, job_id="oom-gpu")
    ref = AdamW(refs, lr=1e-3, address=cpu_address, job_id="oom-cpu")
    if not release:
        opt.release_freed_gradients = lambda: None

    def step(n):
        for p, q in zip(params, refs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.cpu()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, refs)):
            assert torch.equal(p.detach().cpu(), q.detach()), (n, i)
        opt.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)

    step(0)
    step(1)
    torch.cuda.synchronize()
    before, total = torch.cuda.mem_get_info()
    try:
        torch.empty(total, dtype=torch.uint8, device="cuda")
        raise AssertionError("an allocation of the whole device succeeded")
    except torch.cuda.OutOfMemoryError:
        pass
    try:
        retry = torch.empty(before + (400 << 20), dtype=torch.uint8,
                            device="cuda")
        del retry
        outcome = "ok"
    except torch.cuda.OutOfMemoryError:
        outcome = "failed"
    step(2)
    opt.close()
    ref.close()
    print("out of memory: a retry of 400 MiB past the memory free before "
          "%s; 3 steps equal to the CPU reference" % outcome)


if __name__ == "__main__":
    mode = sys.argv[4] if len(sys.argv) > 4 else None
    if mode is None:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    elif mode.startswith("release-in-copy"):
        release_in_copy(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                        one_pass=mode.endswith("one-pass"))
    elif mode.startswith("side-release"):
        release_on_a_side_stream(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                 unheld=mode.endswith("unheld"))
    elif mode.startswith("oom-release"):
        out_of_memory(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                      release=not mode.endswith("held"))
    else:
        sys.exit("unknown mode %r" % mode)
