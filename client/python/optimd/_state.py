"""optimizer.state of the optimd.torch optimizers, and the SetState
requests that write torch-format state into the daemon.

The state lives in the daemon. `DaemonState` fetches it on first access
after a step, as torch-format entries ({"step", "exp_avg", ...} per
parameter), and notices writes into what it handed out: an entry's tensor
changed in place (its version counter moved), replaced, added or removed,
or the whole state cleared. The optimizer writes such changes back before
its next step (`written()`), so `opt.state[p]["exp_avg"].zero_()` or
`opt.state.clear()` act as they do in torch.
"""
import torch

from optimd._layout import memory_order
from optimd.v1 import optimd_pb2 as pb

# torch dtype -> API dtype, for every dtype the API carries.
DTYPES = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
}


class DaemonState(dict):
    def __init__(self, fetch):
        super().__init__()
        self._fetch = fetch
        self._fresh = False
        self._seen = None  # what was handed out, to notice writes
        self._dirty = False

    def invalidate(self):
        self._fresh = False

    def _refresh(self):
        if not self._fresh:
            dict.clear(self)
            dict.update(self, self._fetch())
            self._seen = self._fingerprint()
            self._dirty = False
            self._fresh = True

    def _fingerprint(self):
        # Empty entries are what reading a parameter without state leaves.
        return {id(p): (p, id(e), {k: (id(t), getattr(t, "_version", None))
                                   for k, t in e.items()})
                for p, e in dict.items(self) if e}

    def written(self):
        """The state as written since it was fetched, or None when nothing
        was."""
        if not self._fresh:
            return None
        if not self._dirty and self._fingerprint() == self._seen:
            return None
        return dict(dict.items(self))

    # Reading, as from torch's defaultdict(dict).
    def __getitem__(self, p):
        self._refresh()
        if not dict.__contains__(self, p):
            dict.__setitem__(self, p, {})
        return dict.__getitem__(self, p)

    def __contains__(self, p):
        self._refresh()
        return dict.__contains__(self, p)

    def __iter__(self):
        self._refresh()
        return dict.__iter__(self)

    def __len__(self):
        self._refresh()
        return dict.__len__(self)

    def items(self):
        self._refresh()
        return dict.items(self)

    def keys(self):
        self._refresh()
        return dict.keys(self)

    def values(self):
        self._refresh()
        return dict.values(self)

    def get(self, p, default=None):
        self._refresh()
        return dict.get(self, p, default)

    # Writing.
    def __setitem__(self, p, entry):
        self._refresh()
        dict.__setitem__(self, p, entry)
        self._dirty = True

    def __delitem__(self, p):
        self._refresh()
        dict.__delitem__(self, p)
        self._dirty = True

    def pop(self, p, *default):
        self._refresh()
        self._dirty = True
        return dict.pop(self, p, *default)

    def clear(self):
        self._refresh()
        dict.clear(self)
        self._dirty = True

    def update(self, *args, **kw):
        self._refresh()
        dict.update(self, *args, **kw)
        self._dirty = True


def set_state_request(group_id, tensors, entries, slot_names):
    """A SetStateRequest giving the group's steppable tensors the
    torch-format `entries` (one per tensor, None or {} for a parameter
    without state: its state slots `slot_names` zero, its step 0, as torch
    starts one). Entries without "step" (torch's SGD keeps none) count one
    step when they hold a state slot, none otherwise: SGD's first step
    starts the momentum buffer from the gradient."""
    request = pb.SetStateRequest(group_id=group_id)
    own_steps = {}
    for s, entry in zip(tensors, entries):
        if s.frozen:
            continue
        entry = {k: v for k, v in (entry or {}).items() if v is not None}
        if "step" in entry:
            own_steps[s.name] = int(float(entry["step"]))
        else:
            own_steps[s.name] = int(any(k in entry for k in slot_names))
        for kind in tuple(slot_names) + ("master",):
            if kind in entry:
                add_blob(request, s.name, kind,
                         memory_order(entry[kind].detach().cpu(), s.param))
            elif kind != "master":
                add_blob(request, s.name, kind, torch.zeros(s.numel))
    request.step = max(own_steps.values(), default=0)
    for name, own in own_steps.items():
        if own != request.step:
            request.tensor_steps.add(tensor=name, step=own)
    return request


def add_blob(request, name, kind, value):
    value = value.detach().to("cpu").contiguous().reshape(-1)
    if value.dtype not in DTYPES:
        value = value.to(torch.float32)
    request.tensors.add(tensor=name, kind=kind, dtype=DTYPES[value.dtype],
                        numel=value.numel(),
                        data=value.view(torch.uint8).numpy().tobytes()
                        if value.numel() else b"")
