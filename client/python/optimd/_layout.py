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


def keeps_layout(t):
    """True when `t`'s own strides are kept (a dense non-contiguous
    tensor); otherwise it is stored contiguously."""
    return t.dim() > 1 and not t.is_contiguous() and is_dense(t)


def view_like(flat, p):
    """The 1-D `flat` (p.numel() elements) with p's shape, and p's strides
    when p keeps its layout."""
    if keeps_layout(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


def memory_order(value, p):
    """`value` (p's shape) as 1-D in the order p's buffer keeps it."""
    if not keeps_layout(p):
        return value.contiguous().reshape(-1)
    out = torch.empty_like(p, dtype=value.dtype, device="cpu")
    out.copy_(value)
    return out.as_strided((out.numel(),), (1,))
