"""A real training loop through optimd.torch.SGD, Adam and Lion on the CPU
backend against torch's own optimizers in the same run: a small MLP
regression, full batch, clip_grad_norm_(1.0) in the trainer, the same seed
for both. Prints each run's first and last loss and where the two loss
curves first differ by more than 1e-5 (relative).

    bazel build //server:optimd && tools/gen_python_proto.sh
    OPTIMD_BINARY=bazel-bin/server/optimd PYTHONPATH=client/python \\
        python3 bench/optimizers_e2e.py
"""
import torch

import optimd.torch as ot
from optimd.testing import Daemon


def train(make_opt, steps=300):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    opt = make_opt(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    if hasattr(opt, "close"):
        opt.close()
    return losses


def first_difference(a, b):
    for i, (p, q) in enumerate(zip(a, b)):
        if abs(p - q) > 1e-5 * max(abs(q), 1e-3):
            return i
    return None


def main():
    with Daemon() as d:
        runs = [
            ("SGD momentum 0.9 nesterov",
             lambda m: ot.SGD(m.parameters(), lr=0.05, momentum=0.9,
                              nesterov=True, weight_decay=1e-4,
                              address=d.address),
             lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                       nesterov=True, weight_decay=1e-4)),
            ("Adam lr 1e-2",
             lambda m: ot.Adam(m.parameters(), lr=1e-2, address=d.address),
             lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)),
        ]
        for name, ours, theirs in runs:
            a, b = train(ours), train(theirs)
            print("%-26s optimd %.6f -> %.6f  torch %.6f -> %.6f  first "
                  "difference > 1e-5 at step %s" %
                  (name, a[0], a[-1], b[0], b[-1], first_difference(a, b)))
        lion = train(lambda m: ot.Lion(m.parameters(), lr=1e-3,
                                       weight_decay=0.1, address=d.address))
        print("%-26s optimd %.6f -> %.6f  (torch has no Lion)" %
              ("Lion lr 1e-3 wd 0.1", lion[0], lion[-1]))


if __name__ == "__main__":
    main()
