"""optimizer.state of the optimd.torch optimizers, and the SetState
requests that write torch-format state into the daemon.

The state lives in the daemon. `DaemonState` fetches it on first access
after a step, as torch-format entries ({"step", "exp_avg", ...} per
parameter), and notices writes into what it handed out: an entry's tensor
changed in place (its version counter moved), replaced, added or removed,
or the whole state cleared. The optimizer writes such changes back before
its next step (`written()`), so `opt.state[p]["exp_avg"].zero_()` or
`opt.state.clear()` act as they do in torch.

What it hands out stays the state, as torch's tensors do: an entry or a
tensor still held by the trainer after a step (`ref =
opt.state[p]["exp_avg"]`) takes the new values in place (`follow()`), so
it reads them and a write into it reaches the next step. Only what is held
is followed: the optimizer keeps weak references to what it handed out,
and a step fetches the state again only while one of them is alive.
"""
import weakref

import torch
from torch.optim import optimizer as _torch_optimizer

from optimd._dtensor import local_of
from optimd._layout import memory_order
from optimd.v1 import optimd_pb2 as pb

# torch dtype -> API dtype, for every dtype the API carries.
DTYPES = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
}


# The keys of an entry the daemon keeps (every optimizer's state slots,
# the step and a master); any other key is the trainer's own (an extra).
DAEMON_KEYS = frozenset(("step", "master", "exp_avg", "exp_avg_sq",
                         "max_exp_avg_sq", "momentum_buffer"))


class _Entry(dict):
    """A parameter's state entry: a dict, as torch's, that can be referenced
    weakly (so that one held by the trainer is followed)."""

    __slots__ = ("__weakref__",)


class DaemonState(dict):
    """optimizer.state. `fetch()` gives the daemon's state ({param: entry});
    `local()` the entries the optimizer keeps itself (parameters taken out
    of their group), handed out as they are and never followed.

    Invariant: while fresh, the dict holds what the last fetch gave
    (changed only by the trainer's writes); while not, it is empty and
    `_held` weakly references what was handed out before."""

    def __init__(self, fetch, local=dict):
        super().__init__()
        self._fetch = fetch
        self._local = local
        self._fresh = False
        self._seen = None  # what was handed out, to notice writes
        self._dirty = False
        # id(param) -> (weak param, weak entry or None, {key: weak tensor}).
        self._held = {}
        self._local_ids = set()
        # Keys the trainer put into entries that the daemon does not keep
        # (a library's own counters): id(param) -> (weak param, {key:
        # value}), merged into every fetch as torch's state keeps them.
        self._extras = {}
        self._fetched_keys = {}  # id(param) -> the keys the fetch gave

    def invalidate(self, follow=True):
        """The daemon's state changed. With `follow`, what was handed out
        is remembered weakly, to take the new values if it is still held
        (follow()); without (a load: torch's load_state_dict makes new
        tensors), it is let go."""
        if self._fresh:
            self._keep_extras()
        if not follow:
            self._held = {}
        elif self._fresh:
            self._remember()
        dict.clear(self)
        self._seen = None
        self._dirty = False
        self._fresh = False

    def follow(self):
        """After a step: fetches the state now if an entry or tensor handed
        out is still held, so that it holds the new values before the
        trainer reads or writes it (as torch's step updates it in place)."""
        self._held = {k: h for k, h in self._held.items() if _alive(h)}
        if self._held:
            self._refresh()

    def _keep_extras(self):
        self._extras = {}
        for p, e in dict.items(self):
            # The optimizer's own entries (parameters out of their group)
            # carry the daemon's keys too.
            known = DAEMON_KEYS if id(p) in self._local_ids else \
                self._fetched_keys.get(id(p), ())
            extra = {k: v for k, v in e.items() if k not in known}
            # An empty entry (read before the parameter's first step)
            # stays too, as in torch's defaultdict and its state_dict.
            if extra or not e:
                self._extras[id(p)] = (_key_ref(p), extra)

    def set_extras(self, entries):
        """{param: {key: value}}: keys of a loaded state dict's entries
        that the daemon does not keep, kept in optimizer.state."""
        self._extras = {id(p): (_key_ref(p), extra)
                        for p, extra in entries.items() if extra}

    def move_extras(self, entries, taken):
        """{param: {key: value}}: keys the daemon no longer keeps (slots of
        a group registered anew without them), kept here as the trainer's
        own keys are; the keys `taken` it keeps again leave every entry."""
        for ref, extra in self._extras.values():
            for k in taken:
                extra.pop(k, None)
        for p, extra in entries.items():
            if extra:
                kept = self._extras.setdefault(id(p), (_key_ref(p), {}))
                kept[1].update(extra)

    def with_extras(self, state):
        """`state` ({param: entry} from the daemon) with the trainer's own
        keys of each entry, as torch's state and state_dict carry them (a
        key the daemon's entry has as None, no state, takes the kept
        value: SGD's momentum_buffer without momentum)."""
        if self._fresh:
            # The dict holds them now (an entry read since the last fetch
            # leaves {} there, as torch's defaultdict does).
            self._keep_extras()
        for ref, extra in self._extras.values():
            p = ref()
            if p is None:
                continue
            entry = state.setdefault(p, {})
            for k, v in extra.items():
                if entry.get(k) is None:
                    entry[k] = v
        return state

    def _remember(self):
        for p, e in dict.items(self):
            if id(p) in self._local_ids or not isinstance(p, torch.Tensor):
                # The optimizer's own objects (always current), and entries
                # under keys that are no parameters (kept whole as extras).
                continue
            try:
                entry_ref = weakref.ref(e)
            except TypeError:  # a plain dict the trainer put there
                entry_ref = None
            self._held[id(p)] = (weakref.ref(p), entry_ref, {
                k: weakref.ref(t) for k, t in e.items()
                if isinstance(t, torch.Tensor)})

    def _refresh(self):
        if self._fresh:
            return
        fetched, local = self._fetch(), self._local()
        held, self._held = self._held, {}
        dict.clear(self)
        # A None is no state (SGD's momentum_buffer without momentum): a
        # kept value of that key stays the trainer's (with_extras).
        self._fetched_keys = {id(p): {k for k, v in e.items() if v is not None}
                              for p, e in fetched.items()}
        for p, entry in self.with_extras(fetched).items():
            dict.__setitem__(self, p, _into_held(held.get(id(p)), p, entry))
        dict.update(self, local)
        self._local_ids = {id(p) for p in local}
        self._seen = self._fingerprint()
        self._dirty = False
        self._fresh = True

    def _fingerprint(self):
        # Empty entries are what reading a parameter without state leaves;
        # the trainer's own keys need no write to the daemon (they are kept
        # here: _keep_extras).
        return {id(p): (p, id(e), {k: (id(t), getattr(t, "_version", None))
                                   for k, t in e.items() if k in DAEMON_KEYS})
                for p, e in dict.items(self)
                if any(k in DAEMON_KEYS for k in e)}

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
            dict.__setitem__(self, p, _Entry())
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

    def setdefault(self, p, default=None):
        self._refresh()
        if not dict.__contains__(self, p):
            dict.__setitem__(self, p, default)
            self._dirty = True
        return dict.__getitem__(self, p)

    def copy(self):
        self._refresh()
        return dict(dict.items(self))


def step_tensor(count, device=None, dtype=None):
    """A state entry's "step" as the installed torch makes it: a 0-d tensor
    of torch's scalar dtype (from torch 2.0: float32, float64 under a
    float64 default dtype, whatever else the default is), or of the default
    dtype on torch before it. With `device` (the parameter's, for a group
    with fused=True), as torch's fused optimizers keep it: float32 on the
    parameter's device, whatever the default dtype. With `dtype` (a loaded
    step's), of that dtype."""
    if device is not None:
        return torch.tensor(float(count), dtype=torch.float32, device=device)
    if dtype is not None:
        return torch.tensor(
            float(count) if dtype.is_floating_point else int(count),
            dtype=dtype)
    scalar_dtype = getattr(_torch_optimizer, "_get_scalar_dtype", None)
    dtype = scalar_dtype() if scalar_dtype is not None else None
    return torch.tensor(float(count), dtype=dtype)


def _key_ref(key):
    """A weak reference to a parameter, as extras hold them; a key that is
    no parameter (torch's state takes any: a loaded entry of an index no
    group holds, a library's own key) is held as it is."""
    try:
        return weakref.ref(key)
    except TypeError:
        return lambda: key


def _alive(held):
    p, entry, tensors = held
    return p() is not None and (
        (entry is not None and entry() is not None) or
        any(t() is not None for t in tensors.values()))


def _into_held(held, p, new):
    """The fetched entry `new` of `p`, in the objects handed out for p
    before where they are still alive: the same entry dict, and tensors of
    the same shape, dtype and device taking the new values in place."""
    new = dict(new)
    if held is None or held[0]() is not p:
        return _Entry(new)
    _, entry_ref, tensors = held
    with torch.no_grad():
        for k, v in new.items():
            old = tensors[k]() if k in tensors else None
            if old is not None and old is not v and _same_kind(old, v):
                old.copy_(v)
                new[k] = old
    entry = entry_ref() if entry_ref is not None else None
    if entry is None:
        return _Entry(new)
    dict.clear(entry)
    dict.update(entry, new)
    return entry


def _same_kind(a, b):
    return isinstance(b, torch.Tensor) and a.shape == b.shape and \
        a.dtype == b.dtype and a.device == b.device


def set_state_request(group_id, tensors, entries, slot_names, ranges=None):
    """A SetStateRequest giving the group's steppable tensors the
    torch-format `entries` (one per tensor, None or {} for a parameter
    without state: its state slots `slot_names` zero, its step 0, as torch
    starts one). Entries without "step" (torch's SGD keeps none) count one
    step when they hold a state slot, none otherwise: SGD's first step
    starts the momentum buffer from the gradient. Without state slots (SGD
    without momentum) any entry counts one, {"momentum_buffer": None} too:
    torch keeps one only for a parameter it stepped. `ranges` (shard_state:
    optimd._zero_state.part_ranges) gives each tensor only elements
    [begin, end) of its memory order, the part its session keeps."""
    request = pb.SetStateRequest(group_id=group_id)
    own_steps = {}
    if ranges is None:
        ranges = [(0, s.numel) for s in tensors]
    for s, entry, (begin, end) in zip(tensors, entries, ranges):
        if s.frozen:
            continue
        stepped = bool(entry) and not slot_names
        entry = {k: v for k, v in (entry or {}).items() if v is not None}
        if "step" in entry:
            own_steps[s.name] = int(float(entry["step"]))
        else:
            own_steps[s.name] = int(stepped or
                                    any(k in entry for k in slot_names))
        for kind in tuple(slot_names) + ("master",):
            if kind in entry:
                add_blob(request, s.name, kind, memory_order(
                    local_of(entry[kind]).detach().cpu(), s.mem)[begin:end])
            elif kind != "master":
                add_blob(request, s.name, kind, torch.zeros(end - begin))
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
