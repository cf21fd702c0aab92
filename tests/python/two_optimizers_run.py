"""Two optimizers of one trainer on one GPU, the first one's step request
reaching the daemon after the second one's: at the last step, the first
optimizer's request is held back 0.5 s on a thread of its own, as a
descheduled writer thread on either side would hold it. Run by
test_cuda_e2e.py:

    python3 tests/python/two_optimizers_run.py GPU_ADDRESS [unordered]

Prints "steps done" once both optimizers' steps have finished on the
trainer's stream and their parameters agree with torch's fused AdamW.
`unordered` takes out the client's wait for the other optimizer's reply
(optimd/_step_order.py): the daemon then queues the second step first,
behind its wait for a ready flag that the trainer's stream writes only
after the first step is done, and both processes wait for each other
(the caller's timeout ends it).
"""
import concurrent.futures
import sys
import threading
import time

import torch

import optimd._step_order
from optimd.torch import AdamW


def held_back(send, seconds):
    """`send` (a client's step_async) run `seconds` later on a thread."""
    def send_later(**request):
        reply = concurrent.futures.Future()

        def go():
            time.sleep(seconds)
            try:
                reply.set_result(send(**request).result())
            except BaseException as e:  # the step's own error, for its owner
                reply.set_exception(e)
        threading.Thread(target=go, daemon=True).start()
        return reply
    return send_later


def main(address, unordered):
    if unordered:
        optimd._step_order.wait_for_others = lambda *args: None
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(4096, device="cuda"))
            for _ in range(2)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opts = [AdamW([p], lr=1e-2, address=address, job_id="order-%d" % i)
            for i, p in enumerate(ours)]
    refs = [torch.optim.AdamW([p], lr=1e-2, fused=True) for p in theirs]
    for step in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        if step == 2:
            opts[0]._client.step_async = held_back(
                opts[0]._client.step_async, 0.5)
        for opt, ref in zip(opts, refs):
            opt.step()
            ref.step()
    torch.cuda.synchronize()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6,
                                   atol=1e-6)
    print("steps done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "unordered")
