"""FP8 parameters stepped by the daemon (docs/fp8_parameters.md).

`Fp8Parameter` is one FP8 weight as a model computes with it: `data` (the
codes, [rows, cols]), `scale_inv` (the scale inverses of the recipe's units,
[unit rows, unit columns]: fp32, or e8m0 bytes for MXFP8) and `grad` (bf16 or
fp32, the shape of `data`), which the model's backward fills. All three live
in one buffer shared with the daemon (shared memory on the CPU, a CUDA IPC
allocation on a GPU). `Fp8AdamW` registers a list of them as one AdamW group:
the daemon keeps each weight's fp32 master and moments, and each `step()`
writes the requantized codes and scale inverses back into the buffers.

On torch with float8 dtypes (2.1 and later) `data` is a torch.float8_e4m3fn
/ float8_e5m2 tensor and `scaled_mm_operands()` gives what
torch._scaled_mm takes; on older torch (1.13 on the build machines) `data`
holds the same bytes as uint8, and `dequantize()` works everywhere.

    w = Fp8Parameter.from_float(linear.weight, fmt="e4m3", recipe="tensor")
    opt = Fp8AdamW([w], lr=1e-3, job_id="fp8")
    loss.backward()            # a custom autograd function fills w.grad
    opt.step()                 # w.data and w.scale_inv are new
"""
import itertools
import os

import torch

from optimd.checkpoint import fp8_scale_shape
from optimd.client import Client
from optimd.shm import SharedSegment
from optimd.v1 import optimd_pb2 as pb

# (proto dtype, exponent bits, mantissa bits, bias, no infinities, torch
# dtype name) of each format.
FORMATS = {"e4m3": (pb.DTYPE_FLOAT8_E4M3FN, 4, 3, 7, True, "float8_e4m3fn"),
           "e5m2": (pb.DTYPE_FLOAT8_E5M2, 5, 2, 15, False, "float8_e5m2")}
RECIPES = {"tensor": pb.FP8_RECIPE_TENSOR,
           "block_1x128": pb.FP8_RECIPE_BLOCK_1X128,
           "block_128x128": pb.FP8_RECIPE_BLOCK_128X128,
           "mxfp8": pb.FP8_RECIPE_MXFP8}
_GRAD_DTYPES = {torch.float32: pb.DTYPE_FLOAT32,
                torch.bfloat16: pb.DTYPE_BFLOAT16}
_BLOCKS = {"tensor": (None, None), "block_1x128": (1, 128),
           "block_128x128": (128, 128), "mxfp8": (1, 32)}
_ALIGN = 256


def code_values(fmt):
    """The fp32 value of each of the 256 codes of `fmt` (NaN codes NaN)."""
    _, exp_bits, man_bits, bias, fn, _ = FORMATS[fmt]
    emax = (1 << exp_bits) - 1
    values = []
    for c in range(256):
        e, m = (c >> man_bits) & emax, c & ((1 << man_bits) - 1)
        if fn and e == emax and m == (1 << man_bits) - 1:
            v = float("nan")
        elif not fn and e == emax:
            v = float("inf") if m == 0 else float("nan")
        elif e == 0:
            v = m * 2.0 ** (1 - bias - man_bits)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        values.append(-v if c & 0x80 else v)
    return torch.tensor(values, dtype=torch.float32)


def _round_up(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Fp8Parameter:
    """One FP8 weight of shape [rows, cols] in a buffer shared with the
    daemon: `data` (codes), `scale_inv`, `grad`. Not thread-safe."""

    def __init__(self, shape, fmt="e4m3", recipe="tensor",
                 grad_dtype=torch.float32, device="cpu"):
        if fmt not in FORMATS or recipe not in RECIPES:
            raise ValueError("fmt is one of %s and recipe one of %s" %
                             (sorted(FORMATS), sorted(RECIPES)))
        if grad_dtype not in _GRAD_DTYPES:
            raise TypeError("FP8 gradients are float32 or bfloat16")
        self.shape = tuple(int(d) for d in shape)
        self.fmt, self.recipe, self.device = fmt, recipe, torch.device(device)
        numel = 1
        for d in self.shape:
            numel *= d
        self.numel = numel
        self.scale_shape = tuple(fp8_scale_shape(recipe, numel,
                                                 list(self.shape)))
        units = self.scale_shape[0] * self.scale_shape[1]
        scale_dtype = torch.uint8 if recipe == "mxfp8" else torch.float32
        scale_bytes = units * (1 if recipe == "mxfp8" else 4)
        grad_bytes = numel * (4 if grad_dtype == torch.float32 else 2)
        self._offsets = (0, _round_up(numel),
                         _round_up(numel) + _round_up(scale_bytes))
        nbytes = self._offsets[2] + grad_bytes
        if self.device.type == "cuda":
            from optimd._cuda_segment import CudaSegment
            self._segment = CudaSegment(max(nbytes, 64), self.device)
        else:
            self._segment = SharedSegment(max(nbytes, 64))
        seg = self._segment
        codes = seg.tensor(0, numel, torch.uint8)
        torch_dtype = getattr(torch, FORMATS[fmt][5], None)
        self.data = (codes.view(torch_dtype) if torch_dtype is not None
                     else codes).view(self.shape)
        self.codes = codes.view(self.shape)  # the same bytes as uint8
        self.scale_inv = seg.tensor(self._offsets[1], units,
                                    scale_dtype).view(self.scale_shape)
        self.grad = seg.tensor(self._offsets[2], numel,
                               grad_dtype).view(self.shape)
        self.scale_inv.fill_(1)
        self.grad.zero_()
        self._initial = None

    @classmethod
    def from_float(cls, weight, fmt="e4m3", recipe="tensor",
                   grad_dtype=torch.float32):
        """An FP8 parameter for `weight` (2-D). Its codes are written by the
        daemon when an Fp8AdamW registers it, from `weight` as the fp32
        master (the daemon's quantization rules)."""
        p = cls(weight.shape, fmt, recipe, grad_dtype, weight.device)
        p._initial = weight.detach().float().contiguous().cpu()
        return p

    def _expand(self, scale):
        rows = self.numel // self.shape[-1]
        cols = self.shape[-1]
        br, bc = _BLOCKS[self.recipe]
        br, bc = br or rows, bc or cols
        s = scale.reshape(self.scale_shape)
        return s.repeat_interleave(br, 0)[:rows].repeat_interleave(
            bc, 1)[:, :cols].reshape(self.shape)

    def scale_inv_values(self):
        """The scale inverses as fp32 (MXFP8: 2^(code - 127))."""
        if self.recipe == "mxfp8":
            return torch.pow(2.0, self.scale_inv.float() - 127)
        return self.scale_inv.float()

    def dequantize(self, dtype=torch.float32):
        """The weight's values: code value times its unit's scale inverse."""
        table = code_values(self.fmt).to(self.codes.device)
        values = table[self.codes.long()]
        return (values * self._expand(self.scale_inv_values())).to(dtype)

    def scaled_mm_operands(self):
        """(data transposed, scale_inv) as torch._scaled_mm's second operand
        and its scale for y = x @ W^T: the per-tensor recipe only (a block
        recipe's scales are not one number: reshape raises)."""
        return self.data.t(), self.scale_inv.reshape(())

    def spec(self, name):
        """The TensorSpec that registers this weight as `name`."""
        seg, (p_off, s_off, g_off) = self._segment, self._offsets
        units = self.scale_shape[0] * self.scale_shape[1]
        t = pb.TensorSpec(name=name, numel=self.numel,
                          param_dtype=FORMATS[self.fmt][0],
                          grad_dtype=_GRAD_DTYPES[self.grad.dtype],
                          shape=list(self.shape),
                          fp8_recipe=RECIPES[self.recipe])
        t.param.CopyFrom(seg.handle(p_off, self.numel))
        t.scale_inv.CopyFrom(seg.handle(
            s_off, units * (1 if self.recipe == "mxfp8" else 4)))
        t.grad.CopyFrom(seg.handle(g_off, self.grad.numel() *
                                   self.grad.element_size()))
        return t


class Fp8AdamW:
    """AdamW over FP8 parameters, stepped by the daemon: one session, one
    group. step() hands the gradients to the daemon and returns once the
    new codes and scale inverses are in the parameters' buffers; a step
    with an inf or NaN gradient is skipped whole (its reply's `skipped`),
    unlike optimd.torch's default. Not thread-safe."""

    _sessions = itertools.count()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, moment_dtype=torch.float32, address=None,
                 job_id=None):
        self.params = list(params)
        if not self.params:
            raise ValueError("Fp8AdamW needs at least one Fp8Parameter")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError("Fp8AdamW's parameters share one device")
        self.device = devices.pop()
        self._client = Client(address)
        job = job_id or "fp8-%d-%d" % (os.getpid(), next(self._sessions))
        self._client.create_session(
            job, device=self.device.index or 0
            if self.device.type == "cuda" else -1)
        request = pb.RegisterGroupRequest(group_id="fp8")
        h = request.hyperparameters
        h.optimizer = pb.OPTIMIZER_KIND_ADAMW
        h.lr, h.beta1, h.beta2 = lr, betas[0], betas[1]
        h.eps, h.weight_decay, h.mode = eps, weight_decay, pb.ADAM_MODE_ADAMW
        request.layout.moment_dtype = (pb.DTYPE_BFLOAT16
                                       if moment_dtype == torch.bfloat16
                                       else pb.DTYPE_FLOAT32)
        self.names = ["fp8.%d" % i for i in range(len(self.params))]
        for name, p in zip(self.names, self.params):
            request.tensors.append(p.spec(name))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._client.register_group(request)
        masters = pb.SetStateRequest(group_id="fp8", step=0)
        for name, p in zip(self.names, self.params):
            if p._initial is not None:
                masters.tensors.add(tensor=name, kind="master",
                                    dtype=pb.DTYPE_FLOAT32, numel=p.numel,
                                    data=p._initial.numpy().tobytes())
                p._initial = None
        if masters.tensors:
            self._client.set_state(masters)

    def zero_grad(self):
        for p in self.params:
            p.grad.zero_()

    def step(self):
        """One AdamW step of every parameter; returns the daemon's reply
        (grad_norm, skipped)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._client.step(wait=True)

    def save_checkpoint(self, directory):
        return self._client.save_state(directory)

    def load_checkpoint(self, directory):
        """The daemon rewrites the FP8 codes and scales from the loaded
        masters: work queued on them before (a forward) finishes first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._client.load_state(directory)

    def close(self):
        if self._client is not None:
            self._client.close_session()
            self._client.close()
            self._client = None
