"""One optimd.torch optimizer over parameters on several devices (CPU and
CUDA, cuda:0 and cuda:1), as torch's optimizers take them.

A daemon session lives on one device: it keeps its state there and writes
the updated parameters into that device's memory. An optimizer whose
parameters are on several devices keeps one *part* per device, an
optimizer of its own class over that device's parameters with a session
of its own (job id "<job>.<device>", e.g. "run7.cuda0"), and is itself what
the trainer sees: param_groups, optimizer.state, state dicts, hooks and
checkpoints over all of them, in torch's format. Every part has every
group, holding that group's parameters on its device (maybe none); the
groups' options (a scheduler's lr) and membership are passed on to the
parts before each step.

Clipping (max_grad_norm) and skipping (skip_nonfinite) take the norm of
every device's gradients together, as torch's clip_grad_norm_ does: the
norm is computed here (one reduction per gradient on its device, then one
host read per device), the parts step with the clip folded into their
gradient scale, and a non-finite norm skips every part. A parameter moved
to another device, or a group on a new one, is followed: the parts are
made anew over the devices as they are, the state carried over.

Taken as with one device: everything but overlap, shard_state and
gradient_sharding (one job of several ranks, each on one device), which
raise NotImplementedError, and DTensor (FSDP2) or FSDP1 parameters, which
FSDP keeps on one device per rank anyway.
"""
import math
import os
import secrets
import socket
import weakref

import torch

from optimd._dtensor import is_dtensor
from optimd._aliased import is_fsdp1
from optimd._state_dicts import _check_state_shapes, _unplain

# The fp32 range the daemon takes a gradient scale in (its reciprocal
# multiplies gradients in fp32: server/convert.cc CheckStepOptions).
_FP32_TINY = 1.1754943508222875e-38
_FP32_MAX = 3.4028234663852886e+38


def keys_of(opt):
    """The part keys (_part_key: devices) of opt's parameters, in a fixed
    order."""
    keys = {opt._part_key(p) for g in opt.param_groups for p in g["params"]}
    return sorted(keys, key=str)


def check_several(opt, service, keys):
    """Raises for what parts on several devices do not take, naming the
    devices (`keys`: the parts' keys, _part_key)."""
    where = ", ".join(str(d) for d in sorted(keys, key=str))
    cls_name = type(opt).__name__
    for option in ("overlap", "shard_state", "gradient_sharding"):
        if service[option]:
            raise NotImplementedError(
                "optimd.torch.%s: %s=%r needs the parameters on one device; "
                "they are on %s. Make one optimizer per device, or move the "
                "model to one device" % (cls_name, option, service[option],
                                         where))
    for g in opt.param_groups:
        for p in g["params"]:
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError("optimd.torch supports CPU and CUDA "
                                 "parameters, not %s" % p.device)
            if is_dtensor(p) or is_fsdp1(p):
                raise NotImplementedError(
                    "optimd.torch.%s: FSDP's parameters are on one device "
                    "per rank; these are on %s" % (cls_name, where))
    secret = service["resume_secret"]
    if secret is not None and not isinstance(secret, dict):
        raise ValueError(
            "optimd.torch: an optimizer over several devices has a session "
            "per device; pass resume_secret as {device label: secret} "
            "(its resume_secret attribute), labels such as 'cpu', 'cuda0'")


_CLASSES = {}


def several_class(cls):
    """The class an optimizer of class `cls` becomes over several devices:
    SeveralDevices before `cls`, with cls's name (isinstance and messages
    stay torch's and ours)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (SeveralDevices, cls),
                             {"__module__": cls.__module__,
                              "__qualname__": cls.__qualname__,
                              "_one_device_class": cls})
    return _CLASSES[cls]


def held_state(state, groups):
    """{param: entry} as what parts are made with: ({id(param): entry} of
    the parameters of `groups`, {param: entry} of the others, kept for
    their return to a group, as torch keeps them)."""
    in_groups = {id(p) for g in groups for p in g["params"]}
    return ({id(p): e for p, e in state.items() if id(p) in in_groups},
            {p: e for p, e in state.items() if id(p) not in in_groups})


def become_several(opt, service, held=None, resume=True):
    """Turns `opt` (its param_groups set, no session open) into an
    optimizer over several devices, one part per device, carrying over
    `held` (held_state()); `resume`: whether the parts resume as
    service["resume"] says (construction) or start afresh (an optimizer
    spreading over devices later)."""
    opt.__class__ = several_class(type(opt))
    # torch wraps each optimizer class's step once, for its step hooks.
    for patch in ("_patch_step_function", "_hook_for_profile"):
        if hasattr(opt, patch):
            getattr(opt, patch)()
            break
    opt._ready = False  # torch's add_param_group only, no session of its own
    opt._shard_state = False
    opt._service = service
    opt._job = service["job_id"] or "%s-%d-%s" % (
        socket.gethostname(), os.getpid(), secrets.token_hex(4))
    opt._parts = {}
    # The state the parts are to hold, until they are made: a failure
    # there keeps it here, and the next call makes them again.
    opt._held = held or ({}, {})
    opt.state = PartsState(opt)
    opt._make_parts(resume=resume)


class SeveralDevices:
    """The optimizer over parameters on several devices (see the module's
    docstring): the attributes of a _DaemonOptimizer that the trainer
    uses, over one part per device."""

    # Set by several_class: the class of each part.
    _one_device_class = None

    def _make_parts(self, resume=False):
        """Makes one part per device of the current param_groups, loading
        the held state into them; on failure lets go of those made (a
        resumed session stays for a retry, a new one is closed) and keeps
        the state held."""
        cls = self._one_device_class
        self._partition = {id(p): self._part_key(p) for g in self.param_groups
                           for p in g["params"]}
        parts = {}
        try:
            for device in keys_of(self):
                part = cls.__new__(cls)
                part._start(self._groups_on(device), self.defaults,
                            names=self._names,
                            **self._part_service(device, resume))
                parts[device] = part
            self._parts = parts
            entries, retired = self._held
            if entries:
                self._load_parts(entries)
            self._give_retired(retired)
        except BaseException:
            self._parts = {}
            _let_go(parts.values())
            raise
        self._held = None
        self.resumed = any(p.resumed for p in self._parts.values())
        self.resume_secret = {self._part_label(d): p.resume_secret
                              for d, p in self._parts.items()}

    def _part_service(self, device, resume):
        """The service options of the part on `device`: its own job id and
        (resume: as given) secret; clipping, skipping and loss scaling are
        done here."""
        service = dict(self._service)
        secrets_given = service["resume_secret"] or {}
        label = self._part_label(device)
        service.update(job_id="%s.%s" % (self._job, label),
                       resume_secret=secrets_given.get(label),
                       max_grad_norm=0.0, skip_nonfinite=False,
                       grad_scale=None)
        if not resume:
            service.update(resume=False, resume_secret=None)
        return service

    def _give_retired(self, retired):
        """The state of parameters out of every group ({param: entry}),
        kept by the part of their device for their return."""
        for p, entry in retired.items():
            part = self._parts.get(self._part_key(p))
            if part is not None:
                part._retired[id(p)] = (weakref.ref(p), entry)

    def _groups_on(self, device):
        """param_groups as the part on `device` has them: every group, with
        its parameters on that device."""
        return [dict(_options(g), params=self._on(g["params"], device))
                for g in self.param_groups]

    def _on(self, params, device):
        """Those of `params` in the part of `device`."""
        return [p for p in params if self._part_key(p) == device]

    def part(self, device):
        """The optimizer of the parameters on `device` (its client, its
        session), e.g. opt.part("cuda:0").client.health()."""
        return self._parts[torch.device(device)]

    # Keeping the parts in step with param_groups.
    def _sync_parts(self):
        """Passes the groups' options and parameters on to the parts; a
        parameter on another device than before (or a new device) makes
        the parts anew, the state carried over."""
        if not self._parts:
            self._make_parts()  # an earlier making failed: the state held
        partition = {id(p): self._part_key(p) for g in self.param_groups
                     for p in g["params"]}
        if any(self._partition.get(i, d) != d for i, d in partition.items()) \
                or set(partition.values()) - set(self._parts):
            self._rebuild()
            return
        self._partition.update(partition)
        for gi, group in enumerate(self.param_groups):
            # One look at each parameter's key (a device check per
            # parameter per step is the host cost of this path).
            by_part = {device: [] for device in self._parts}
            for p in group["params"]:
                by_part[partition[id(p)]].append(p)
            for device, part in self._parts.items():
                self._pass_on(gi, group, by_part[device], part)
        for part in self._parts.values():
            # Groups taken out of param_groups: out of the parts' too.
            del part.param_groups[len(self.param_groups):]

    def _pass_on(self, gi, group, mine, part):
        """Group `gi`'s options and `mine`, its parameters in the part, into
        the part's group; keys the part reconciles (two switches of one
        meaning, _reconcile_group) come back into `group`."""
        options = _options(group)
        if gi == len(part.param_groups):
            part.add_param_group(dict(options, params=mine))
        pg = part.param_groups[gi]
        for k in [k for k in pg if k != "params" and k not in group]:
            del pg[k]
        pg.update(options)
        if gi < len(part._groups):
            part._reconcile_group(gi, pg)
            group.update({k: v for k, v in pg.items()
                          if k != "params" and group.get(k) != v})
        if list(map(id, pg["params"])) != list(map(id, mine)):
            pg["params"] = mine

    def _rebuild(self):
        """The parts made anew over param_groups as they are (parameters on
        other devices, or a change refused), with the state they hold, or
        the state held; the old ones close first, the new ones taking
        their job ids."""
        if self._parts:
            self._held = self._entries()
            self._close_parts()
        self._make_parts()

    def _rebuild_quietly(self):
        """_rebuild() where another error is on its way up: should it fail
        too, the state stays held for the next call."""
        try:
            self._rebuild()
        except Exception:
            pass

    def _close_parts(self):
        parts, self._parts = list(self._parts.values()), {}
        for part in parts:
            part.close()

    def _entries(self):
        """The state of every part, as held_state() holds it."""
        self._write_back_state()
        return held_state(self._whole_state(), self.param_groups)

    # What the shared state-dict code (_state_dicts.py) calls.
    def _write_back_state(self):
        for part in self._parts.values():
            part._write_back_state()

    def _refuse_incomplete_state(self):
        for part in self._parts.values():
            part._refuse_incomplete_state()

    def _follow_written_params(self):
        for part in self._parts.values():
            part._follow_written_params()

    def _sync_params(self, follow_layout=True):
        self._sync_parts()
        for part in self._parts.values():
            part._sync_params(follow_layout)

    def _sync_structure(self):
        self._sync_parts()

    def _fetch_state(self):
        """{param: entry} of every part, as their state dicts have them."""
        out = {}
        for part in self._parts.values():
            out.update(part._whole_state())
        return out

    def _load_parts(self, entries, group_options=None):
        """Loads `entries` ({id(param): entry}) into the parts, each
        through its own load (torch's load_state_dict semantics), with
        `group_options` (one dict per group) as the groups' options or,
        without, the groups' current ones. Options a part's registration
        would refuse raise before any part is loaded."""
        for part in self._parts.values():
            key = part._state_dtype_key
            for gi, g in enumerate(self.param_groups):
                options = dict(_options(group_options[gi] if group_options
                                        else g))
                if key in options:  # a saved state dict's dtype is a name
                    options[key] = _unplain(options[key])
                part._check_storage(gi, options)
        for device, part in self._parts.items():
            state, groups, index = {}, [], 0
            for gi, g in enumerate(self.param_groups):
                ids = []
                for p in g["params"]:
                    if self._part_key(p) != device:
                        continue
                    if entries.get(id(p)) is not None:
                        state[index] = entries[id(p)]
                    ids.append(index)
                    index += 1
                options = group_options[gi] if group_options else g
                groups.append(dict(_options(options), params=ids))
            part._load_state_dict({"state": state, "param_groups": groups})
        # The groups take the options the load gave the parts' groups.
        first = next(iter(self._parts.values()))
        for g, pg in zip(self.param_groups, first.param_groups):
            for k in [k for k in g if k != "params" and k not in pg]:
                del g[k]
            g.update({k: v for k, v in pg.items() if k != "params"})

    # What the trainer calls.
    def add_param_group(self, param_group):
        super().add_param_group(param_group)  # torch's, ours: _ready False
        try:
            self._sync_parts()
        except BaseException:
            # Refused: the optimizer as it was, its state kept.
            self.param_groups.pop()
            self._rebuild_quietly()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_parts()
        # Storage edits a part's registration would refuse raise before
        # any part steps.
        for part in self._parts.values():
            for gi, (g, mine) in enumerate(zip(part.param_groups,
                                               part._groups)):
                if part._layout_of(g) != mine["snapshot"]:
                    part._check_storage(gi, g)
        return self._step_parts(loss)

    def _step_parts(self, loss):
        """The step of every part, after the norm over all of them."""
        scale = float(self.grad_scale or 1.0)
        norm, clip = math.nan, 1.0
        if self.max_grad_norm or self.skip_nonfinite:
            norm = self._grad_norm() / scale
            if self.skip_nonfinite and not math.isfinite(norm):
                self.skipped, self.grad_norm = True, math.nan
                return loss
            if self.max_grad_norm:
                clip = _clip_coefficient(self.max_grad_norm, norm)
        if clip == 1.0:
            part_scale = scale
        elif clip > 0 and _takes_scale(scale / clip):
            part_scale = scale / clip
        else:
            # 0, NaN or extreme: as torch's clip_grad_norm_, in place.
            self._multiply_grads(clip)
            part_scale = scale
        # CUDA parts first: their steps are queued, the CPU's run here.
        for part in sorted(self._parts.values(),
                           key=lambda part: part._device.type == "cpu"):
            part.grad_scale = part_scale
            part.wait_for_step = self.wait_for_step
            _unhooked_step(part)
        self.skipped, self.grad_norm = False, norm
        return loss

    def _gradients(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    yield p.grad

    def _grad_norm(self):
        """The L2 norm of every device's gradients together (as scaled)."""
        by_device = {}
        for grad in self._gradients():
            if grad.is_sparse:
                grad = grad.coalesce()._values()
            dtype = torch.float64 if grad.dtype == torch.float64 \
                else torch.float32
            by_device.setdefault(grad.device, []).append(
                torch.linalg.vector_norm(grad, 2, dtype=dtype))
        total = 0.0
        for norms in by_device.values():
            total += torch.stack([n.double() for n in norms]).square().sum() \
                .item()
        return math.sqrt(total)

    def _multiply_grads(self, clip):
        for grad in self._gradients():
            grad.mul_(clip)

    def zero_grad(self, set_to_none=None):
        if set_to_none is None:
            from optimd._daemon_optimizer import _TORCH_SET_TO_NONE
            set_to_none = _TORCH_SET_TO_NONE
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        self._sync_parts()
        for part in self._parts.values():
            part.zero_grad(set_to_none=False)

    def _load_state_dict(self, state_dict):
        """torch's load_state_dict (hooks: _state_dicts.py) into the parts."""
        self._sync_parts()
        saved = state_dict["param_groups"]
        if len(self.param_groups) != len(saved):
            raise ValueError("loaded state dict has a different number of "
                             "parameter groups")
        for g, sg in zip(self.param_groups, saved):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter "
                                 "group that doesn't match the size of "
                                 "optimizer's group")
        # Checked whole first: a refused load changes no part.
        _check_state_shapes(self.param_groups, saved, state_dict["state"],
                            self._slot_names)
        entries = {id(p): state_dict["state"].get(pid)
                   for g, sg in zip(self.param_groups, saved)
                   for p, pid in zip(g["params"], sg["params"])}
        self._load_parts(entries, saved)

    # Checkpoints: one folder per device.
    def save_checkpoint(self, directory, background=False):
        """Each device's part writes its checkpoint into
        <directory>/<device label>/ (e.g. run/cuda0/rank-0.safetensors)."""
        self._sync_parts()
        replies = []
        for key, part in self._parts.items():
            folder = os.path.join(directory, self._part_label(key))
            os.makedirs(folder, exist_ok=True)
            replies.append(part.save_checkpoint(folder, background=background))
        return replies

    def load_checkpoint(self, directory):
        self._sync_parts()
        replies = [part.load_checkpoint(
            os.path.join(directory, self._part_label(d)))
            for d, part in self._parts.items()]
        first = next(iter(self._parts.values()))
        for g, pg in zip(self.param_groups, first.param_groups):
            g["lr"] = pg["lr"]
        return replies

    def save_status(self):
        return [part.save_status() for part in self._parts.values()]

    def wait_for_save(self, poll_s=0.05):
        return [part.wait_for_save(poll_s) for part in self._parts.values()]

    def state_bytes(self, chunk_bytes=4 << 20):
        raise NotImplementedError(_ONE_STREAM)

    def load_state_bytes(self, chunks):
        raise NotImplementedError(_ONE_STREAM)

    def consolidate_state_dict(self, to=0):
        raise NotImplementedError("optimd.torch: shard_state is for "
                                  "parameters on one device")

    @property
    def client(self):
        raise AttributeError(
            "this optimizer's parameters are on several devices, each with "
            "a session of its own: use opt.part(device).client")

    def synchronize(self):
        for part in self._parts.values():
            part.synchronize()

    def close(self):
        for part in self._parts.values():
            part.close()


_ONE_STREAM = ("optimd.torch: the parameters are on several devices, whose "
               "sessions write a checkpoint each; use save_checkpoint("
               "directory) and load_checkpoint(directory), one folder per "
               "device")


class PartsState(dict):
    """optimizer.state over the parts: each parameter's entry is its
    part's (optimd/_state.py keeps and follows it there)."""

    def __init__(self, opt):
        super().__init__()
        self._opt = weakref.ref(opt)  # `del opt` frees it, as torch's

    def _states(self):
        return [part.state for part in self._opt()._parts.values()]

    def _of(self, p):
        opt = self._opt()
        key = opt._part_key(p) if isinstance(p, torch.Tensor) else None
        part = opt._parts.get(key)
        return part.state if part is not None else self._states()[0]

    def with_extras(self, state):
        """As DaemonState's: the parts' entries carry their extras."""
        return state

    def __getitem__(self, p):
        return self._of(p)[p]

    def __contains__(self, p):
        return p in self._of(p)

    def __iter__(self):
        for s in self._states():
            yield from s

    def __len__(self):
        return sum(map(len, self._states()))

    def __bool__(self):
        return len(self) > 0

    def keys(self):
        return [k for s in self._states() for k in s.keys()]

    def values(self):
        return [v for s in self._states() for v in s.values()]

    def items(self):
        return [kv for s in self._states() for kv in s.items()]

    def get(self, p, default=None):
        return self._of(p).get(p, default)

    def __setitem__(self, p, entry):
        self._of(p)[p] = entry

    def __delitem__(self, p):
        del self._of(p)[p]

    def pop(self, p, *default):
        return self._of(p).pop(p, *default)

    def clear(self):
        for s in self._states():
            s.clear()

    def update(self, *args, **kw):
        for p, entry in dict(*args, **kw).items():
            self[p] = entry

    def setdefault(self, p, default=None):
        return self._of(p).setdefault(p, default)

    def copy(self):
        return dict(self.items())

    def __eq__(self, other):
        return dict(self.items()) == other

    __hash__ = None

    def __repr__(self):
        return repr(dict(self.items()))


def _options(group):
    """A param group's options: all but its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


def _let_go(parts):
    """Parts of a making that failed: a resumed session stays in the
    daemon (for a retry, as a one-device optimizer leaves it), a new one
    is closed."""
    for part in parts:
        if part.resumed:
            part._closer.detach()
            part._client.close()
        else:
            part.close()


def _clip_coefficient(max_norm, norm):
    """torch.nn.utils.clip_grad_norm_'s (and the daemon's) coefficient."""
    coef = max_norm / (norm + 1e-6)
    return 1.0 if coef >= 1.0 else coef


def _takes_scale(scale):
    """Whether the daemon takes `scale` as a gradient scale."""
    return math.isfinite(scale) and scale > 0 and \
        _FP32_TINY <= 1.0 / scale <= _FP32_MAX


def _unhooked_step(part):
    """part.step() without torch's step hooks (the trainer's hooks ran
    around the whole optimizer's step; global ones must not run once per
    part)."""
    step = type(part).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(part)
