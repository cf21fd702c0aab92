"""Parameters whose memory other tensors share.

On the CPU, the optimd.torch optimizers copy each parameter into a segment
the daemon maps and point the parameter at it (`p.data = ...`). That cuts
the parameter off from every other tensor over its memory: a flat buffer
the parameters are views of, a weight tied by `v.data = w.data`, tensors
of a `state_dict()` taken before, and other processes that see the memory
after `model.share_memory()` (Hogwild). Such a parameter is registered
where it is instead, so everything that shares its memory sees each step,
as with torch (on CUDA every parameter is registered where it is, by a
CUDA IPC handle of its allocation; overlapping() still matters there):
* CPU: its storage is moved into a named shared-memory file with torch's
  own `_share_filename_cpu_` (all tensors over the storage follow, as with
  `share_memory_()`), which the daemon maps by name; memory already in a
  named file under /dev/shm is taken as it is. Memory shared through file
  descriptors (torch's default sharing strategy) has no name the daemon
  could open, so such a parameter raises.
"""
import collections
import os

import torch

from optimd.v1 import optimd_pb2 as pb

_SHM_DIR = "/dev/shm"
# How many tensors use a storage (torch 2; absent from torch 1.13, where
# tensors taken from the parameters before are not seen).
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_of(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") \
        else t.storage()


def _uses(t):
    return _use_count(storage_of(t)._cdata)


def _calibrate():
    """_uses of a parameter nothing else shares."""
    if _use_count is None:
        return None
    return _uses(torch.nn.Parameter(torch.zeros(1)))


_UNSHARED_USES = _calibrate()


def shares_storage(t):
    """Whether (torch 2) tensors other than `t` use its storage; False
    where torch cannot tell (1.13)."""
    return _use_count is not None and _uses(t) > _UNSHARED_USES


def aliased(params):
    """The ids of the parameters among `params` (plain tensors, not
    DTensors) whose memory other tensors share: two parameters over one
    storage, a parameter over part of its storage (a view of a larger
    buffer), a CPU storage in shared memory, (torch 2) a storage other
    tensors use, or a parameter of FSDP version 1 (its flat buffer, which
    torch 1.13 cannot see shared)."""
    params = [p for p in params if p.numel()]
    by_storage = collections.Counter(storage_of(p).data_ptr()
                                     for p in params)
    out = set()
    for p in params:
        st = storage_of(p)
        if (by_storage[st.data_ptr()] > 1 or
                st.nbytes() != p.numel() * p.element_size() or
                (p.device.type == "cpu" and st.is_shared()) or
                shares_storage(p) or is_fsdp1(p)):
            out.add(id(p))
    return out


def overlapping(params):
    """The parameters among `params` whose memory overlaps another's (a
    weight tied by `v.data = w.data`; views of one flat buffer side by side
    do not overlap), in the order given."""
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(),
                    i) for i, p in enumerate(params) if p.numel())
    found = set()
    end, owner = 0, None
    for begin, stop, i in spans:
        if begin < end:
            found.update((i, owner))
        if stop > end:
            end, owner = stop, i
    return [params[i] for i in sorted(found)]


def shm_handle(t, name):
    """A shared-memory handle of CPU tensor `t` where it is: its storage in
    a named shared-memory file (moved there first if it is in private
    memory). `name` names the parameter in errors."""
    st = storage_of(t)
    if not st.is_shared():
        st._share_filename_cpu_()
    found = _named_mapping(t.data_ptr())
    if found is None:
        raise _unreachable(name)
    file_name, file_offset = found
    return pb.BufferHandle(shared_memory=pb.SharedMemoryBuffer(
        segment_name=file_name, offset=file_offset,
        size=t.numel() * t.element_size()))


def _named_mapping(address):
    """(the shm_open name, the offset in that file) of this process's
    mapping of a file under /dev/shm that holds `address`; None when the
    memory there is no such file or the file has no name any more (torch's
    file-descriptor sharing unlinks it at once)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not start <= address < end:
                continue
            path = fields[5].rstrip("\n") if len(fields) == 6 else ""
            if not path.startswith(_SHM_DIR + "/") or \
                    path.endswith(" (deleted)"):
                return None
            return (path[len(_SHM_DIR):],
                    int(fields[2], 16) + address - start)
    return None


def _unreachable(name):
    return RuntimeError(
        "optimd.torch: parameter %s is in shared memory that only file "
        "descriptors reach (torch's default sharing strategy), so the "
        "daemon cannot step it where the other processes see it; call "
        "torch.multiprocessing.set_sharing_strategy('file_system') before "
        "model.share_memory(), or create the optimizer before sharing the "
        "model" % name)


def is_fsdp1(p):
    """Whether FSDP version 1 manages `p`: it marks its FlatParameters and,
    with use_orig_params=True, the original parameters it points into them
    (`_fsdp_flattened`). Their values live in FSDP's flat buffer, which it
    gathers from and reshards into, so the daemon steps them there."""
    return getattr(p, "_fsdp_flattened", False)
