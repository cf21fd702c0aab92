"""One accelerate run with FSDP (version 2 unless told) on one GPU, for
test_frameworks.py:

    accelerate_fsdp_run.py KIND OUT ADDRESS --state_dir DIR
                           [--fsdp_version 1|2] [--use_orig_params 0|1]

KIND is torch or optimd (torch.optim.AdamW or optimd.torch.AdamW, made
over the model before prepare(), as accelerate's users do with FSDP2;
with FSDP1, over the prepared model's parameters, as accelerate's FSDP1
guide says; --use_orig_params is FSDP1's, 1 by default as accelerate
has it: the model's parameters stay, views of the flat buffers, where 0
gives them as FlatParameters). prepare()
shards the model with fully_shard and puts the new DTensor parameters into
the optimizer's param_groups in place of the old ones; the run then trains
the steps of test_frameworks.py with clipping, three of them after a round
trip through accelerate's save_state and load_state (--state_dir; the
optimizer's state must come back as saved, or the run fails), and writes
the final weights to OUT.
A process of its own: accelerate's state is per process, and this one
starts a torch.distributed group of one rank.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_frameworks import STEPS, _gpt2, _loader  # noqa: E402


def _optimizer_state(opt):
    """The optimizer's state_dict() tensors by (parameter index, key), on
    the CPU."""
    return {(i, k): v.detach().cpu().clone()
            for i, st in opt.state_dict()["state"].items()
            for k, v in st.items() if torch.is_tensor(v)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("torch", "optimd"))
    ap.add_argument("out")
    ap.add_argument("address")
    ap.add_argument("--fsdp_version", type=int, default=2)
    ap.add_argument("--use_orig_params", type=int, default=1)
    ap.add_argument("--state_dir", required=True,
                    help="where accelerator.save_state writes mid-run")
    args = ap.parse_args()
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    options = dict(fsdp_version=args.fsdp_version)
    if args.fsdp_version == 1:
        options["use_orig_params"] = bool(args.use_orig_params)
    plugin = FullyShardedDataParallelPlugin(**options)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = _gpt2()
    if args.fsdp_version == 1:
        # FSDP1 replaces the parameters at prepare(): accelerate's FSDP1
        # guide makes the optimizer over the prepared model's.
        model = accelerator.prepare(model)
        from torch.distributed.fsdp._flat_param import FlatParameter
        flat = {isinstance(p, FlatParameter) for p in model.parameters()}
        if flat != {not args.use_orig_params}:
            sys.exit("FSDP1 did not take use_orig_params=%d" %
                     args.use_orig_params)
    params = model.parameters()
    if args.kind == "torch":
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    else:
        from optimd.torch import AdamW
        opt = AdamW(params, lr=1e-3, weight_decay=0.01,
                    address=args.address,
                    job_id="fsdp-" + args.kind)
    if args.fsdp_version == 1:
        opt, loader = accelerator.prepare(opt, _loader())
    else:
        model, opt, loader = accelerator.prepare(model, opt, _loader())
    batches = iter(loader)

    def train(steps):
        for _ in range(steps):
            loss = model(**next(batches)).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    train(STEPS - 3)
    # accelerate's own checkpoint: saved, a step taken past it, loaded
    # back (the optimizer's state must be the saved one again), trained on.
    accelerator.save_state(args.state_dir)
    saved = _optimizer_state(opt)
    train(1)
    accelerator.load_state(args.state_dir)
    loaded = _optimizer_state(opt)
    if saved.keys() != loaded.keys() or not all(
            torch.equal(saved[k], loaded[k]) for k in saved):
        sys.exit("the optimizer's state after load_state is not the saved "
                 "one: %s" % sorted(k for k in saved if k not in loaded or
                                   not torch.equal(saved[k], loaded[k]))[:5])
    train(2)
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        torch.save({k: v.detach().float().cpu() for k, v in full.items()},
                   args.out)
    if args.kind == "optimd":
        opt.optimizer.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
