"""Losses of train_bench's small30m trained by peers side by side, eager
and with forward and backward as CUDA graphs (train_bench --graphed): two
torch.optim.AdamW(fused=True) copies and one optimd.torch.AdamW, each
trained for a few iterations in turn (train_bench's warm-up order), then
the three again one iteration at a time. Equal training gives equal losses
to four or five digits. Run 105 (bench/RESULTS.md) found why graphed
train_bench rows' peers differed: the graphs kept the shared first batch
as their static input and copied later batches into it, so each peer after
the first trained on other data; Trainer.graph now captures on a copy.

    LD_LIBRARY_PATH=.gpu/lib OPTIMD_BINARY=.gpu/optimd \\
        PYTHONPATH=client/python:bench python3 bench/graphed_loss_check.py
"""
import copy

import torch

from optimd.testing import Daemon
from train_bench import (GPT, MODELS, Trainer, batches, optimd_adamw,
                         torch_adamw)

ITERS = 4


def peers(base, data, daemon, job):
    return {"torch A": Trainer(copy.deepcopy(base), torch_adamw, None, data),
            "torch B": Trainer(copy.deepcopy(base), torch_adamw, None, data),
            "optimd": Trainer(copy.deepcopy(base),
                              optimd_adamw(daemon, job), None, data)}


def main():
    cfg = MODELS["small30m"][0]
    torch.manual_seed(0)
    base = GPT(seq=256, **cfg).cuda()
    data = batches(cfg, 1, 256)
    with Daemon(backend="cuda") as daemon:
        for graphed in (False, True):
            for order in ("in turn", "interleaved"):
                job = "check-%s-%s" % (graphed, order.replace(" ", "-"))
                ps = peers(base, data, daemon, job)
                if graphed:
                    for t in ps.values():
                        t.graph()
                losses = {k: [] for k in ps}
                if order == "in turn":
                    for k, t in ps.items():
                        for _ in range(ITERS):
                            losses[k].append(t.iterate()["loss"].item())
                else:
                    for _ in range(ITERS):
                        for k, t in ps.items():
                            losses[k].append(t.iterate()["loss"].item())
                for k, ls in losses.items():
                    print("%-8s %-11s %-7s %s" % (
                        "graphed" if graphed else "eager", order, k,
                        " ".join("%.5f" % x for x in ls)), flush=True)
                ps["optimd"].opt.close()
                del ps
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
