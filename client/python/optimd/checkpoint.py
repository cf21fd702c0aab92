"""Daemon checkpoints (SaveState files) as torch.optim state dicts.

The mapping, for a file rank-<r>.safetensors (<job>.rank-<r>.safetensors
from earlier versions):
  * param_groups[i]: the saved group i's hyperparameters as its torch
    optimizer names them (AdamW: lr, betas, eps, weight_decay, amsgrad,
    maximize; SGD: lr, momentum, dampening, weight_decay, nesterov,
    maximize; Lion: lr, betas, weight_decay, maximize) and `params`: the
    indices of its tensors, numbered across groups in order, as torch
    numbers them.
  * state[index]: for each tensor with optimizer state (stepped at least
    once: a tensor that never had a gradient has no entry, as in torch),
    its optimizer's state slots (AdamW: `step`, the tensor's own step count
    (the group's less the steps it missed without a gradient) as a float
    tensor, torch's convention, `exp_avg`, `exp_avg_sq` and, with amsgrad,
    `max_exp_avg_sq`; SGD: `momentum_buffer`; Lion: `exp_avg`), shaped as
    the parameter (the file keeps each tensor's shape; packed files, for
    sessions of very many tensors, keep those of more than one dimension in
    their metadata; files from before that keep them 1-D: pass `shapes` for
    those).
  * Parameters themselves are returned separately (`<name>` tensors), with
    fp32 masters as `<name>.master` where the layout keeps one (remainder
    layouts: the master rebuilt from the bf16 parameter and its int16
    remainder).
  * A weight tied between modules is stored once, under the name it was
    registered with; its other names (aliases, optimd/_names.py) are listed
    in the metadata (a group's "aliases": [tensor index, [alias, ...]]
    pairs; `aliases(meta)` reads them) and the parameters and masters
    returned hold it under each alias too (the same tensor), so that
    model.load_state_dict(params, strict=True) loads a tied model.
    safetensors.torch.load_file shows it under its registered name only
    (safetensors stores one tensor per name).
The other way needs no conversion: the optimd.torch optimizers'
load_state_dict takes torch's format directly.
"""
import json
import mmap
import os
import struct

import torch

from optimd._layout import from_memory_shape

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "I16": torch.int16}


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16",
                       "float16": "F16"}

# Each optimizer's state slots in the daemon's order (core/optimizer.cc).
_SLOTS = {"adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
          "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}


def _slots(layout):
    """The state slots a tensor of `layout` holds. Files written before
    other optimizers than AdamW name neither optimizer nor slot count."""
    if "optimizer" not in layout:
        return _SLOTS["adamw"][:3 if layout["amsgrad"] else 2]
    return _SLOTS[layout["optimizer"]][:layout["state_slots"]]


def _pieces(layout, frozen):
    """(kind, key suffix, dtype) of a tensor's pieces of state, in file order
    within its group (core/checkpoint.cc, Entries)."""
    out = [("param", "", _SAFETENSORS_DTYPES[layout["param_dtype"]])]
    if layout["master"] == "fp32":
        out.append(("master", ".master", "F32"))
    elif layout["master"] == "remainder":
        out.append(("remainder", ".remainder", "I16"))
    if not frozen:
        md = _SAFETENSORS_DTYPES[layout["moment_dtype"]]
        out += [(k, "." + k, md) for k in _slots(layout)]
    return out


def _unpack(meta, tensors):
    """Format 2 (packed: one safetensors tensor per kind and dtype of a
    group, "g<group>.<kind>.<dtype>") as format 1: metadata with one object
    per tensor, and one 1-D tensor per piece, "<name><suffix>"."""
    layouts = meta.pop("layouts")
    out = {}
    for gi, g in enumerate(meta["groups"]):
        taken = {}  # packed key -> elements used so far
        unpacked = []
        for name, numel, layout_index, flags, *shape in g["tensors"]:
            layout = layouts[layout_index]
            frozen = bool(flags & 1)
            unpacked.append(dict(name=name, numel=numel, frozen=frozen,
                                 keep_fp32=bool(flags & 2), layout=layout))
            for kind, suffix, dtype in _pieces(layout, frozen):
                key = "g%d.%s.%s" % (gi, kind, dtype)
                start = taken.get(key, 0)
                piece = tensors[key][start:start + numel]
                out[name + suffix] = piece.reshape(shape[0]) if shape \
                    else piece
                taken[key] = start + numel
        g["tensors"] = unpacked
    return out


def read_checkpoint(path):
    """(metadata dict, {name: 1-D tensor}) of a daemon checkpoint, either
    format; the metadata is always in format 1's shape.

    The tensors are views of a private (copy-on-write) memory map of the
    file: nothing is read until used, and what is read stays in the page
    cache, so converting a checkpoint takes about no memory of its own."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
        body = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) \
            if size > 0 else None
    start = 8 + n
    meta = json.loads(header.pop("__metadata__")["optimd"])
    tensors = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        count = (b - a) // torch.empty((), dtype=dtype).element_size()
        tensors[name] = (torch.frombuffer(body, dtype=dtype, count=count,
                                          offset=start + a)
                         if b > a else torch.empty(0, dtype=dtype)).reshape(
                             info["shape"])
    if meta["format_version"] == 2:
        tensors = _unpack(meta, tensors)
    return meta, tensors


def aliases(meta):
    """{alias: the name the tensor is stored under} of a checkpoint's
    metadata (read_checkpoint's first value, or json.loads of
    safe_open(path, "pt").metadata()["optimd"]); empty for files without
    aliases (every file written before they existed)."""
    out = {}
    for g in meta["groups"]:
        for index, names in g.get("aliases", ()):
            for alias in names:
                out[alias] = _name_of(g["tensors"][index])
    return out


def _name_of(t):
    """A tensor's name in format 1 (an object) or 2 (an array) metadata."""
    return t["name"] if isinstance(t, dict) else t[0]


def _master(name, tensors):
    if name + ".master" in tensors:
        return tensors[name + ".master"]
    if name + ".remainder" in tensors:
        hi = tensors[name].view(torch.int16).to(torch.int32) & 0xFFFF
        rem = tensors[name + ".remainder"].to(torch.int32)
        hi = (hi - (rem < 0).to(torch.int32)) & 0xFFFF
        bits = (hi << 16) | (rem & 0xFFFF)
        return bits.view(torch.float32)
    return None


def to_torch_state_dict(path, shapes=None, params=None):
    """A daemon checkpoint as (optimizer state_dict in torch's format,
    {parameter name: tensor}, {parameter name: fp32 master}); a tied
    weight is in both dicts under its registered name and each alias.

    `shapes`: optional {parameter name: shape} to reshape state tensors.
    A parameter that keeps a non-contiguous dense layout (channels_last) is
    stored in its memory order (N, H, W, C); `params` ({parameter name:
    the parameter, or a tensor of its shape and strides}) gives such
    tensors back in the parameter's shape and strides, as torch's state
    has them (without it they keep the file's memory-order shape)."""
    meta, tensors = read_checkpoint(path)
    params_like = params
    state, groups, params, masters = {}, [], {}, {}
    index = 0
    for g in meta["groups"]:
        h = g["hyperparameters"]
        kind = h.get("optimizer", "adamw")
        ids = []
        missed = _missed_steps(g)
        tied = {int(i): names for i, names in g.get("aliases", ())}
        for ti, t in enumerate(g["tensors"]):
            name = t["name"]
            # The file's own shape (per-tensor format), else `shapes`, else
            # 1-D (packed format).
            shape = (shapes or {}).get(name, tuple(tensors[name].shape))
            like = (params_like or {}).get(name)
            params[name] = _shaped(tensors[name], shape, like)
            m = _master(name, tensors)
            if m is not None:
                masters[name] = _shaped(m, shape, like)
            # A tied weight under each of its other names too, as the
            # model's state_dict() has it.
            for alias in tied.get(ti, ()):
                params[alias] = params[name]
                if m is not None:
                    masters[alias] = masters[name]
            # The tensor's own step, as torch counts it: the group's less
            # the steps it missed without a gradient. Never stepped: torch
            # has no state entry for it.
            own = g["step"] - missed.get(ti, 0)
            if not t["frozen"] and own > 0:
                entry = {"step": torch.tensor(float(own))} \
                    if kind == "adamw" else {}
                for k in _slots(t["layout"]):
                    entry[k] = _shaped(tensors[name + "." + k], shape, like)
                if entry:
                    state[index] = entry
            ids.append(index)
            index += 1
        groups.append(dict(_torch_hyperparameters(h), params=ids))
    return {"state": state, "param_groups": groups}, params, masters


def _shaped(x, shape, like):
    """`x` reshaped to the file's `shape`, then, given the parameter
    (`like`), in its shape and strides."""
    x = x.reshape(shape)
    return x if like is None else from_memory_shape(x, like)


def _missed_steps(group):
    """{tensor index in the group: steps it missed without a gradient}, from
    the group's optional [index, missed] pairs (core/checkpoint_header.cc)."""
    return {int(i): int(n) for i, n in group.get("missed_steps", ())}


def _torch_hyperparameters(h):
    """A group's saved hyperparameters as its torch optimizer names them."""
    kind = h.get("optimizer", "adamw")
    if kind == "sgd":
        return dict(lr=h["lr"], momentum=h["momentum"],
                    dampening=h["dampening"], weight_decay=h["weight_decay"],
                    nesterov=h["nesterov"], maximize=h["maximize"])
    if kind == "lion":
        return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                    weight_decay=h["weight_decay"], maximize=h["maximize"])
    return dict(lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                weight_decay=h["weight_decay"], amsgrad=h["amsgrad"],
                maximize=h["maximize"])
