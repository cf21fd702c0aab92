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
    `max_exp_avg_sq`; SGD: `momentum_buffer`; Lion: `exp_avg`; block8
    moments dequantized to fp32 with their `<name>.moment_scales`), shaped as
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
  * A shard of a larger tensor (FSDP2's DTensor parameters) lists its
    place in the metadata (a group's "shards": [tensor index, whole shape,
    offset] triples); `merge_shards(directory)` puts every rank's shards
    together.
The other way needs no conversion: the optimd.torch optimizers'
load_state_dict takes torch's format directly.
"""
import json
import mmap
import os
import re
import struct

import torch

from optimd._layout import from_memory_shape
from optimd._state import step_tensor

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "F64": torch.float64, "I16": torch.int16,
           "U8": torch.uint8,
           # FP8 parameters: torch's float8 dtypes where torch has them,
           # else their bytes (torch before 2.1).
           "F8_E4M3": getattr(torch, "float8_e4m3fn", torch.uint8),
           "F8_E5M2": getattr(torch, "float8_e5m2", torch.uint8)}


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16",
                       "float16": "F16", "float64": "F64", "block8": "U8",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}

# FP8 recipes' scaling units (core/fp8_recipe.h): rows x columns of a
# block, None standing for the tensor's own extent.
_FP8_BLOCKS = {"tensor": (None, None), "block_1x128": (1, 128),
               "block_128x128": (128, 128), "mxfp8": (1, 32)}


def fp8_scale_shape(recipe, numel, shape):
    """[unit rows, unit columns] of an FP8 parameter's scale inverses under
    `recipe`, its 2-D view being [numel / shape[-1], shape[-1]]."""
    cols = shape[-1] if shape else numel
    if numel == 0 or cols == 0:
        return [0, 0]
    rows = numel // cols
    block_rows, block_cols = _FP8_BLOCKS[recipe]
    block_rows, block_cols = block_rows or rows, block_cols or cols
    return [-(-rows // block_rows), -(-cols // block_cols)]

# block8 moments (core/block8.h): elements per scale.
_BLOCK8_ELEMENTS = 256

# The state slots of the optimizers of files that do not name them (written
# before the layouts listed "slot_names"), in the daemon's order.
_OLD_FILE_SLOTS = {"adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                   "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}


def _slots(layout):
    """The state slots a tensor of `layout` holds: as the file names them;
    files written before name none, and those written before other
    optimizers than AdamW neither optimizer nor slot count."""
    if "slot_names" in layout:
        names = tuple(layout["slot_names"])
        if len(names) != layout.get("state_slots", len(names)):
            raise ValueError("a layout names %d state slots but holds %d: "
                             "the checkpoint's metadata is damaged" %
                             (len(names), layout["state_slots"]))
        return names
    if "optimizer" not in layout:
        return _OLD_FILE_SLOTS["adamw"][:3 if layout["amsgrad"] else 2]
    return _OLD_FILE_SLOTS[layout["optimizer"]][:layout["state_slots"]]


def _pieces(layout, frozen, numel, shape):
    """(kind, key suffix, dtype, elements) of a tensor's pieces of state, in
    file order within its group (checkpoint/header.cc, Entries)."""
    out = [("param", "", _SAFETENSORS_DTYPES[layout["param_dtype"]], numel)]
    recipe = layout.get("fp8_recipe")
    if recipe is not None and numel > 0:
        rows, cols = fp8_scale_shape(recipe, numel, shape)
        out.append(("scale_inv", ".scale_inv",
                    "U8" if recipe == "mxfp8" else "F32", rows * cols))
    if layout["master"] == "fp32":
        out.append(("master", ".master", "F32", numel))
    elif layout["master"] == "remainder":
        out.append(("remainder", ".remainder", "I16", numel))
    if not frozen:
        md = _SAFETENSORS_DTYPES[layout["moment_dtype"]]
        slots = _slots(layout)
        out += [(k, "." + k, md, numel) for k in slots]
        if layout["moment_dtype"] == "block8" and numel > 0:
            blocks = -(-numel // _BLOCK8_ELEMENTS)
            out.append(("moment_scales", ".moment_scales", "F32",
                        blocks * len(slots)))
    return out


def _block8_table(signed):
    """The value of each 8-bit code before scaling (core/block8.h): sign
    and 4 exponent bits, or 5 exponent bits; 3 mantissa bits."""
    exp_bits = 4 if signed else 5
    max_exp = (1 << exp_bits) - 1
    values = []
    for c in range(256):
        mag = c & 0x7F if signed else c
        e, m = mag >> 3, mag & 7
        v = 2.0 ** (e - max_exp) * (1 + m / 8) if e else \
            m * 2.0 ** (1 - max_exp - 3)
        values.append(-v if signed and c & 0x80 else v)
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


def block8_values(codes, scales, signed):
    """fp32 values of a block8 state slot: `codes` (uint8, one per element)
    and `scales` (fp32, one per 256 elements), each the code's value times
    its block's scale: the same bits as the daemon reads."""
    codes = codes.reshape(-1)
    if codes.numel() == 0:
        return torch.empty(0, dtype=torch.float32)
    # Codes no encoder writes (magnitudes past 1.0), which the daemon's
    # load refuses too.
    bad = ((codes & 0x7F) > 0x78) if signed else (codes > 0xF8)
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise ValueError(
            "8-bit moment code 0x%02x at element %d is not one the daemon "
            "writes (%s codes have magnitudes up to 0x%s)" % (
                int(codes[at]), at, "exp_avg" if signed else "exp_avg_sq",
                "78" if signed else "f8"))
    block = torch.arange(codes.numel()) // _BLOCK8_ELEMENTS
    return _block8_table(signed)[codes.long()] * scales.reshape(-1)[block]


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
            pieces = _pieces(layout, frozen, numel,
                             shape[0] if shape else [numel])
            for kind, suffix, dtype, count in pieces:
                key = "g%d.%s.%s" % (gi, kind, dtype)
                start = taken.get(key, 0)
                piece = tensors[key][start:start + count]
                out[name + suffix] = piece.reshape(shape[0]) \
                    if shape and count == numel else piece
                taken[key] = start + count
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
                entry = {"step": step_tensor(own)} \
                    if kind == "adamw" else {}
                for k, value in _slot_values(name, t, tensors):
                    entry[k] = _shaped(value, shape, like)
                if entry:
                    state[index] = entry
            ids.append(index)
            index += 1
        groups.append(dict(_torch_hyperparameters(h), params=ids))
    return {"state": state, "param_groups": groups}, params, masters


def merge_shards(directory):
    """The checkpoints of every rank in `directory` (rank-<r>.safetensors,
    one save_checkpoint per rank) put together: tensors registered as
    shards of larger ones (FSDP2's DTensor parameters: a group's "shards",
    [tensor index, whole shape, offset] triples) become whole tensors, so
    that a job can resume at another number of ranks. Returns ({name:
    whole parameter}, {name: {"step", state slots, "master" where the
    layout keeps one}}), state as torch's AdamW keeps it (block8 moments
    dequantized); a tensor that is not a shard comes from the first rank
    that has it. The whole tensors are built in memory, the files read
    through their maps."""
    files = sorted(f for f in os.listdir(directory)
                   if re.fullmatch(r"rank-\d+\.safetensors", f))
    if not files:
        raise FileNotFoundError("no rank-<r>.safetensors in %s" % directory)
    params, state = {}, {}
    for f in files:
        meta, tensors = read_checkpoint(os.path.join(directory, f))
        for g in meta["groups"]:
            places = {int(i): (shape, offset)
                      for i, shape, offset in g.get("shards", ())}
            missed = _missed_steps(g)
            for ti, t in enumerate(g["tensors"]):
                name = t["name"]
                own = g["step"] - missed.get(ti, 0)
                pieces = [(params, name, tensors[name])]
                m = _master(name, tensors)
                entry = state.setdefault(name, {}) if own > 0 and \
                    not t["frozen"] else None
                if entry is not None:
                    entry["step"] = step_tensor(own)
                    if m is not None:
                        pieces.append((entry, "master", m))
                    pieces += [(entry, k, v)
                               for k, v in _slot_values(name, t, tensors)]
                for into, key, value in pieces:
                    _place(into, key, value.reshape(tensors[name].shape),
                           places.get(ti))
    return params, {k: v for k, v in state.items() if v}


def _place(into, key, shard, place):
    """Puts `shard` into into[key]: the whole tensor of `place` (whole
    shape, offset), made on first use, or the shard itself when it is
    whole (place None; the first one found is kept)."""
    if place is None:
        into.setdefault(key, shard.clone())
        return
    shape, offset = place
    whole = into.get(key)
    if whole is None:
        whole = into[key] = torch.zeros(shape, dtype=shard.dtype)
    whole[tuple(slice(o, o + n) for o, n in zip(offset, shard.shape))] = \
        shard


def _slot_values(name, t, tensors):
    """(slot name, values) of tensor `name`'s state slots, block8 codes
    dequantized to fp32 (the dtype torch's AdamW keeps)."""
    slots = _slots(t["layout"])
    if t["layout"]["moment_dtype"] != "block8":
        return [(k, tensors[name + "." + k]) for k in slots]
    scales = tensors[name + ".moment_scales"].reshape(-1, len(slots))
    return [(k, block8_values(tensors[name + "." + k], scales[:, s], s == 0))
            for s, k in enumerate(slots)]


def _shaped(x, shape, like):
    """`x` reshaped to the file's `shape`, then, given the parameter
    (`like`), in its shape and strides."""
    x = x.reshape(shape)
    return x if like is None else from_memory_shape(x, like)


def _missed_steps(group):
    """{tensor index in the group: steps it missed without a gradient}, from
    the group's optional [index, missed] pairs (checkpoint/header.cc)."""
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
