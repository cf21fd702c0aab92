"""Gradients swapped in one thread while another reads them.

One thread sets every parameter's `.grad` to None and then to a fresh
tensor, in a loop; the other, with `--through=torch`, reads `.grad` and
looks at the tensor (what any optimizer's step does), or, with
`--through=optimd`, runs optimd's AdamW step in a loop. Exits with the
process's fate: a crash shows as a signal. bench/RESULTS.md has what
torch 1.13 and 2.11 do.

    python3 bench/grad_thread_race.py --through=torch
    python3 bench/grad_thread_race.py --through=optimd --device=cuda
"""
import argparse
import threading

import torch


def reader_of(params, through, device):
    """The second thread's loop body and what closes it afterwards."""
    if through == "torch":
        def read():
            for p in params:
                g = p.grad
                if g is not None:
                    g.is_sparse, g.data_ptr(), g.stride()
        return read, lambda: None
    import optimd.torch
    from optimd.testing import Daemon
    daemon = Daemon(backend="cuda" if device == "cuda" else "cpu")
    daemon.__enter__()
    opt = optimd.torch.AdamW(params, lr=1e-3, address=daemon.address)

    def close():
        opt.close()
        daemon.__exit__(None, None, None)
    return opt.step, close


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--through", choices=("torch", "optimd"), default="torch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=20000)
    args = ap.parse_args()
    params = list(torch.nn.Linear(256, 256).to(args.device).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    read, close = reader_of(params, args.through, args.device)
    stop = threading.Event()
    errors = []

    def loop():
        while not stop.is_set():
            try:
                read()
            except Exception as err:  # noqa: BLE001 -- counted, reported
                errors.append(type(err).__name__)
    thread = threading.Thread(target=loop)
    thread.start()
    for _ in range(args.rounds):
        for p in params:
            p.grad = None
            p.grad = torch.randn_like(p)
    stop.set()
    thread.join()
    close()
    print(f"{args.through} on {args.device}, torch {torch.__version__}: "
          f"no crash in {args.rounds} rounds; exceptions {sorted(set(errors))}")


if __name__ == "__main__":
    main()
