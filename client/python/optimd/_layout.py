"""Parameters that are dense but not contiguous (channels_last weights): the
daemon steps each tensor as flat memory, element by element, so a
parameter keeps its strides in its shared buffer, its gradient must have
the same strides, and state travels in that memory order.
"""
import torch


def is_dense(t):
    """Every element stored once, without gaps, in some order of the
    dimensions (contiguous, channels_last, a transpose, ...)."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def overlaps_itself(t):
    """Whether two of `t`'s elements may share memory (an expanded tensor,
    a stride of 0): each dimension, by stride, must step past the extent
    of those before it."""
    extent = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) == 1:
            continue
        if t.stride(d) < extent:
            return True
        extent = t.stride(d) * t.size(d)
    return False


def keeps_layout(t):
    """True when `t`'s own strides are kept (a dense non-contiguous
    tensor); otherwise it is stored contiguously."""
    return t.dim() > 1 and not t.is_contiguous() and is_dense(t)


def dim_order(p):
    """p's dimensions from outermost to innermost in its memory."""
    return sorted(range(p.dim()), key=lambda d: (p.stride(d), p.size(d)),
                  reverse=True)


def memory_shape(p):
    """p's shape with its dimensions in the order its buffer keeps them
    (channels_last: N, H, W, C): the bytes the daemon holds and checkpoints
    have this shape."""
    if not keeps_layout(p):
        return tuple(p.shape)
    return tuple(p.size(d) for d in dim_order(p))


def from_memory_shape(value, p):
    """`value` in memory_shape(p) as a tensor of p's shape and strides (a
    view)."""
    if not keeps_layout(p) or tuple(value.shape) != memory_shape(p):
        return value
    order = dim_order(p)
    return value.permute([order.index(d) for d in range(p.dim())])


def view_like(flat, p):
    """The 1-D `flat` (p.numel() elements) with p's shape, and p's strides
    when p keeps its layout."""
    if keeps_layout(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


def alias_like(flat, p):
    """view_like(flat, p) as a tensor of its own over the same memory, not
    an autograd view of `flat`: what becomes a parameter's `.data` or its
    `.grad` behaves as a tensor torch would have made (`grad.detach_()`,
    which torch refuses on views, works)."""
    shaped = view_like(flat, p)
    storage = (shaped.untyped_storage() if hasattr(shaped, "untyped_storage")
               else shaped.storage())
    return torch.empty(0, dtype=shaped.dtype, device=shaped.device).set_(
        storage, shaped.storage_offset(), shaped.shape, shaped.stride())


def memory_order(value, p):
    """`value` (p's shape) as 1-D in the order p's buffer keeps it."""
    if not keeps_layout(p):
        return value.contiguous().reshape(-1)
    out = torch.empty_like(p, dtype=value.dtype, device="cpu")
    out.copy_(value)
    return out.as_strided((out.numel(),), (1,))
