"""Trains a small MLP whose linear weights are FP8 parameters (optimd.fp8)
through the optimd daemon: the model computes with the FP8 codes and scale
inverses, the daemon keeps the fp32 masters and AdamW's moments and
requantizes the weights every step.

    PYTHONPATH=client/python /usr/bin/python3 examples/fp8_train.py \\
        --address unix:/path/to/optimd.sock [--device cuda] \\
        [--fmt e4m3] [--recipe tensor]

The task is regression onto a fixed random teacher network. On the CPU
(and on torch without float8 dtypes) the matmuls use the dequantized
weights; on CUDA with the per-tensor recipe and torch's float8 dtypes they
use torch._scaled_mm on the FP8 codes. Exits with status 1 unless the loss
falls to below half its first value.
"""
import argparse
import sys

import torch

from optimd.fp8 import Fp8AdamW, Fp8Parameter


def quantize_per_tensor(x, fp8_dtype, max_value):
    """x as FP8 codes with one scale (current scaling) and its inverse."""
    amax = x.abs().max().float().clamp_min(1e-12)
    scale = max_value / amax
    codes = (x.float() * scale).clamp(-max_value, max_value).to(fp8_dtype)
    return codes, (1.0 / scale).reshape(())


class Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W^T with W an Fp8Parameter: the forward reads its codes and
    scale inverses, the backward adds dL/dW into W.grad (the buffer the
    daemon reads) and returns dL/dx. `anchor` (an empty tensor that
    requires grad) puts the call into autograd's graph even when x does
    not require grad, as the first layer's input does not."""

    @staticmethod
    def forward(ctx, x, anchor, weight):
        ctx.weight = weight
        ctx.save_for_backward(x)
        fp8_dtype = getattr(torch, "float8_e4m3fn", None)
        if (x.is_cuda and fp8_dtype is not None and weight.fmt == "e4m3"
                and weight.recipe == "tensor"):
            x8, x_scale_inv = quantize_per_tensor(x, fp8_dtype, 448.0)
            w8, w_scale_inv = weight.scaled_mm_operands()
            return torch._scaled_mm(x8, w8, scale_a=x_scale_inv,
                                    scale_b=w_scale_inv,
                                    out_dtype=torch.float32)
        return x @ weight.dequantize().t()

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        weight.grad.add_((grad_out.t() @ x).to(weight.grad.dtype))
        return grad_out @ weight.dequantize(grad_out.dtype), None, None


class Fp8Linear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight
        self.anchor = torch.empty(0, requires_grad=True)

    def forward(self, x):
        return Fp8LinearFunction.apply(x, self.anchor, self.weight)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fmt", default="e4m3", choices=["e4m3", "e5m2"])
    parser.add_argument("--recipe", default="tensor",
                        choices=["tensor", "block_1x128", "block_128x128",
                                 "mxfp8"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device(args.device)
    dims = [64, 256, 256, 16]
    teacher = torch.nn.Sequential(
        torch.nn.Linear(dims[0], dims[1]), torch.nn.Tanh(),
        torch.nn.Linear(dims[1], dims[2]), torch.nn.Tanh(),
        torch.nn.Linear(dims[2], dims[3])).to(device)
    weights = [Fp8Parameter.from_float(
        torch.randn(dims[i + 1], dims[i], device=device) / dims[i] ** 0.5,
        args.fmt, args.recipe) for i in range(3)]
    layers = [Fp8Linear(w) for w in weights]
    model = torch.nn.Sequential(layers[0], torch.nn.Tanh(), layers[1],
                                torch.nn.Tanh(), layers[2])
    opt = Fp8AdamW(weights, lr=args.lr, weight_decay=0.0,
                   address=args.address)
    first = last = None
    try:
        for step in range(args.steps):
            x = torch.randn(128, dims[0], device=device)
            with torch.no_grad():
                target = teacher(x)
            loss = torch.nn.functional.mse_loss(model(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            last = loss.item()
            first = last if first is None else first
            if step % 50 == 0 or step == args.steps - 1:
                print("step %4d  loss %.5f" % (step, last), flush=True)
    finally:
        opt.close()
    print("FP8 %s %s on %s: loss %.5f -> %.5f" %
          (args.fmt, args.recipe, device, first, last))
    return 0 if last < 0.5 * first else 1


if __name__ == "__main__":
    sys.exit(main())
