"""optimd.torch.AdamW: a drop-in torch.optim.AdamW whose step runs in the
optimd daemon.

    from optimd.torch import AdamW
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)

CPU parameters and gradients are re-homed into POSIX shared memory: each
parameter keeps its identity for the model (only its storage moves), and its
gradient becomes a tensor on shared pages that backward accumulates into and
zero_grad zeroes in place. The daemon reads the gradients and writes the new
parameters into those pages, with no copy. The optimizer state (moments,
master weights, step counters) lives in the daemon; `state_dict()` and
`optimizer.state[p]` fetch it on demand.

Differences from torch.optim.AdamW, all deliberate:
  * zero_grad() always zeroes gradients in place (set_to_none is accepted and
    ignored): the daemon keeps reading the same buffers. A parameter whose
    .grad was set to None is stepped with a zero gradient, as after
    torch's zero_grad(set_to_none=False).
  * Only lr may change after construction (schedulers do that); changing
    betas, eps or weight_decay of a live group raises ValueError.
  * A step whose gradients hold inf or NaN is skipped entirely (nothing
    changes); `opt.skipped` says so and `opt.grad_norm` is the gradient norm.
"""
import inspect
import operator
import os
import socket
import warnings

import torch

from optimd import errors
from optimd.client import Client
from optimd.shm import SharedSegment, align
from optimd.v1 import optimd_pb2 as pb

_DTYPES = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float16: pb.DTYPE_FLOAT16,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}
# Schedulers may change lr, betas, eps and weight_decay: each step sends
# them. These define the state's shape and cannot change.
_IMMUTABLE_KEYS = ("amsgrad", "maximize")
_REGISTERED_KEYS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


def _torch_adamw_defaults():
    """The keyword defaults of the installed torch.optim.AdamW, so that our
    param_groups carry every key torch expects (state dicts move both
    ways)."""
    sig = inspect.signature(torch.optim.AdamW.__init__)
    out = {}
    for name, p in sig.parameters.items():
        if name in ("self", "params") or p.default is inspect.Parameter.empty:
            continue
        out[name] = p.default
    return out


class _DaemonState(dict):
    """optimizer.state: fetched from the daemon on first access after a step.

    Reading works as with torch (state[p]['exp_avg'], ...); the tensors are
    copies, so writing into them changes nothing in the daemon (use
    load_state_dict for that).
    """

    def __init__(self, opt):
        super().__init__()
        self._opt = opt
        self._fresh = False

    def invalidate(self):
        self._fresh = False

    def _refresh(self):
        if not self._fresh:
            dict.clear(self)
            dict.update(self, self._opt._fetch_state())
            self._fresh = True

    def __getitem__(self, p):
        self._refresh()
        return dict.get(self, p, {})

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


class _Slot:
    """Where one parameter lives in the group's shared segments."""

    __slots__ = ("param", "name", "numel", "pview", "gview", "frozen")


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW with the step in the optimd daemon.

    Besides torch's arguments:
      address: the daemon (default: its default socket, or $OPTIMD_ADDRESS).
      job_id, rank, world_size: the session's identity (default job id: host
        and process id); resume=True takes over the session of a restarted
        trainer with the same job id and rank, and restores its weights.
      master_weights: None (an fp32 master exactly for non-fp32 parameters),
        True (always, so a crashed trainer can get fp32 weights back), False.
      store_param_remainders: bf16 parameters keep an int16 remainder instead
        of an fp32 master (exact; 4 bytes less per parameter).
      exp_avg_dtype: torch.float32 or torch.bfloat16 moments.
      max_grad_norm: clip by the norm of this rank's gradients (0: off).
        Ranks do not agree on it: with world_size > 1 and gradients sharded
        across ranks (FSDP2, ZeRO), clip with
        torch.nn.utils.clip_grad_norm_ instead (it reduces across ranks);
        a step warns once when both are set.
      grad_scale: divide gradients by this (loss scaling) before use.
      assume_finite: the gradients are known finite (e.g. a GradScaler
        checked them): without max_grad_norm the daemon skips its gradient
        statistics pass (the fastest step; grad_norm is then NaN). A
        non-finite gradient then corrupts the state instead of skipping the
        step.
      keep_fp32: parameters to update in fp32 in place (norms, router biases).
      adam_w_mode: False for Adam's L2 regularization instead of decoupled
        decay; bias_correction: False to skip (1 - beta^t).
    Parameters may be given as (name, tensor) pairs to name their state.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False,
                 address=None, job_id=None, rank=0, world_size=1,
                 resume=False, master_weights=None,
                 store_param_remainders=False, exp_avg_dtype=torch.float32,
                 max_grad_norm=0.0, grad_scale=None, assume_finite=False,
                 keep_fp32=(),
                 adam_w_mode=True, bias_correction=True, timeout=60.0,
                 **torch_options):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise ValueError(
                "Invalid weight_decay value: {}".format(weight_decay))
        if exp_avg_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError("exp_avg_dtype must be torch.float32 or "
                            "torch.bfloat16, not %s" % exp_avg_dtype)
        for k, v in torch_options.items():
            if k in ("foreach", "fused", "capturable", "differentiable") and v:
                raise ValueError("optimd.torch.AdamW runs its own fused step; "
                                 "%s=%r is not supported" % (k, v))
        self._names = {}
        params = self._strip_names(params)
        defaults = _torch_adamw_defaults()
        defaults.update(torch_options)
        defaults.update(dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, master_weights=master_weights,
            store_param_remainders=store_param_remainders,
            exp_avg_dtype=exp_avg_dtype, adam_w_mode=adam_w_mode,
            bias_correction=bias_correction))
        self._ready = False
        self._groups = []  # per group: dict(id, slots, segments, snapshot)
        super().__init__(params, defaults)
        self.state = _DaemonState(self)
        self.max_grad_norm = max_grad_norm
        self._world_size = world_size
        self._warned_rank_norm = False
        self.grad_scale = grad_scale
        self.assume_finite = assume_finite
        self._keep_fp32 = {id(p) for p in keep_fp32}
        self.skipped = False
        self.grad_norm = None
        # CUDA: wait for each step on the daemon to report its own norm and
        # skipped flag (a host sync); otherwise they are of the last
        # completed step.
        self.wait_for_step = False
        self._device = self._check_devices()
        self._client = Client(address, timeout=timeout)
        job = job_id or "%s-%d" % (socket.gethostname(), os.getpid())
        self._ready_event = self._done_event = None
        ready_handle = b""
        if self._device.type == "cuda":
            # The trainer records `ready` after backward; the daemon's stream
            # waits on it. The daemon records `done` after the step; our
            # stream waits on it before the next forward. No host sync.
            with torch.cuda.device(self._device):
                self._ready_event = torch.cuda.Event(interprocess=True)
                self._ready_event.record()
                ready_handle = bytes(self._ready_event.ipc_handle())
        reply = self._client.create_session(
            job, rank=rank, world_size=world_size,
            device=-1 if self._device.type == "cpu" else self._device.index,
            resume=resume, ready_event=ready_handle)
        if reply.done_event:
            self._done_event = torch.cuda.Event.from_ipc_handle(
                self._device, reply.done_event)
        self.resumed = reply.resumed
        registered = set(reply.group_ids)
        self._ready = True
        for gi, group in enumerate(self.param_groups):
            self._register_group(gi, group, existing=str(gi) in registered)
        if self.resumed:
            self._restore_after_resume()

    # Construction helpers.
    def _strip_names(self, params):
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be "
                            "an iterable of Tensors or dicts, but got " +
                            torch.typename(params))
        params = list(params)
        out = []
        for item in params:
            if isinstance(item, dict):
                group = dict(item)
                group["params"] = self._strip_names(group["params"])
                out.append(group)
            elif isinstance(item, (tuple, list)) and len(item) == 2 and \
                    isinstance(item[0], str):
                self._names[id(item[1])] = item[0]
                out.append(item[1])
            else:
                out.append(item)
        return out

    def _check_devices(self):
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError("optimd.torch.AdamW: all parameters must be on "
                             "one device, got %s" %
                             ", ".join(sorted(str(d) for d in devices)))
        device = devices.pop() if devices else torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError("optimd.torch.AdamW supports CPU and CUDA "
                             "parameters, not %s" % device)
        return device

    def add_param_group(self, param_group):
        if isinstance(param_group.get("params"), (list, tuple)):
            param_group = dict(param_group)
            param_group["params"] = self._strip_names(param_group["params"])
        super().add_param_group(param_group)
        if self._ready:
            self._check_devices()
            gi = len(self.param_groups) - 1
            self._register_group(gi, self.param_groups[gi], existing=False)

    def _group_request(self, gi, group, slots, seg_p, seg_g):
        request = pb.RegisterGroupRequest(group_id=str(gi))
        h = request.hyperparameters
        h.lr = float(group["lr"])
        h.beta1, h.beta2 = (float(b) for b in group["betas"])
        h.eps = float(group["eps"])
        h.weight_decay = float(group["weight_decay"])
        h.mode = pb.ADAM_MODE_ADAMW if group.get("adam_w_mode", True) \
            else pb.ADAM_MODE_ADAM
        h.bias_correction = bool(group.get("bias_correction", True))
        h.maximize = bool(group["maximize"])
        h.amsgrad = bool(group["amsgrad"])
        mw = group.get("master_weights")
        if group.get("store_param_remainders"):
            request.layout.master_weights = pb.MASTER_WEIGHTS_REMAINDER
        elif mw is True:
            request.layout.master_weights = pb.MASTER_WEIGHTS_FP32
        elif mw is False:
            request.layout.master_weights = pb.MASTER_WEIGHTS_NONE
        request.layout.moment_dtype = _DTYPES[group.get("exp_avg_dtype",
                                                        torch.float32)]
        for s, (p_off, g_off) in slots:
            t = request.tensors.add(name=s.name, numel=s.numel,
                                    param_dtype=_DTYPES[s.param.dtype],
                                    keep_fp32=id(s.param) in self._keep_fp32,
                                    frozen=s.frozen)
            if not s.frozen:
                t.grad_dtype = _DTYPES[s.param.dtype]
            if s.numel:
                nbytes = s.numel * s.param.element_size()
                t.param.CopyFrom(seg_p.handle(p_off, nbytes))
                if not s.frozen:
                    t.grad.CopyFrom(seg_g.handle(g_off, nbytes))
        return request

    def _register_group(self, gi, group, existing):
        slots = []
        p_bytes = g_bytes = 0
        for pi, p in enumerate(group["params"]):
            if p.dtype not in _DTYPES:
                raise TypeError(
                    "optimd.torch.AdamW supports float32, bfloat16 and "
                    "float16 parameters; parameter %s is %s" %
                    (self._names.get(id(p), "%d.%d" % (gi, pi)), p.dtype))
            if p.is_sparse:
                raise TypeError("optimd.torch.AdamW does not support sparse "
                                "parameters")
            s = _Slot()
            s.param = p
            s.name = self._names.get(id(p), "group%d.param%d" % (gi, pi))
            s.numel = p.numel()
            s.frozen = not p.requires_grad
            offsets = (p_bytes, g_bytes)
            nbytes = align(s.numel * p.element_size())
            p_bytes += nbytes
            if not s.frozen:
                g_bytes += nbytes
            slots.append((s, offsets))
        if self._device.type == "cuda":
            seg_p = _CudaSegment(max(p_bytes, 64), self._device)
            seg_g = _CudaSegment(max(g_bytes, 64), self._device)
        else:
            seg_p = SharedSegment(max(p_bytes, 64))
            seg_g = SharedSegment(max(g_bytes, 64))
        for s, (p_off, g_off) in slots:
            p = s.param
            s.pview = seg_p.tensor(p_off, s.numel, p.dtype).view(p.shape)
            s.pview.copy_(p.detach())
            p.data = s.pview
            s.gview = None
            if not s.frozen:
                s.gview = seg_g.tensor(g_off, s.numel, p.dtype).view(p.shape)
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TypeError("optimd.torch.AdamW does not support "
                                        "sparse gradients")
                    s.gview.copy_(p.grad)
                else:
                    s.gview.zero_()
                p.grad = s.gview
        request = self._group_request(gi, group, slots, seg_p, seg_g)
        if existing:
            update = pb.UpdateBuffersRequest(group_id=str(gi))
            for t in request.tensors:
                if t.numel:
                    update.tensors.add(name=t.name, param=t.param, grad=t.grad)
            self._client.update_buffers(update)
        else:
            self._client.register_group(request)
        self._groups.append(dict(
            id=str(gi), slots=[s for s, _ in slots], segments=(seg_p, seg_g),
            snapshot={k: group[k] for k in _IMMUTABLE_KEYS}, request=request))
        self._index_buffers()

    def _restore_after_resume(self):
        """A restarted trainer: write the daemon's weights into our buffers."""
        try:
            self._client.get_params()
        except errors.FailedPreconditionError:
            # Remainder layouts: the bf16 half lived in the dead trainer.
            pass

    # The step.
    def _index_buffers(self):
        """Flat lists for the per-step check that nothing moved."""
        self._params_flat = [s.param for g in self._groups
                             for s in g["slots"] if s.numel]
        self._pptrs_flat = [s.pview.data_ptr() for g in self._groups
                            for s in g["slots"] if s.numel]
        self._steppable_flat = [s.param for g in self._groups
                                for s in g["slots"] if not s.frozen]
        self._gviews_flat = [s.gview for g in self._groups
                             for s in g["slots"] if not s.frozen]

    def _buffers_in_place(self):
        # map() keeps this at well under a microsecond per parameter.
        if list(map(torch.Tensor.data_ptr, self._params_flat)) != \
                self._pptrs_flat:
            return False
        return all(map(operator.is_,
                       map(operator.attrgetter("grad"), self._steppable_flat),
                       self._gviews_flat))

    def _sync_buffers(self):
        for g, group in zip(self._groups, self.param_groups):
            for k in _IMMUTABLE_KEYS:
                if group[k] != g["snapshot"][k]:
                    raise ValueError(
                        "param_groups[%s]['%s'] changed from %r to %r; "
                        "optimd.torch.AdamW cannot change it after "
                        "construction (it decides the state's layout)" %
                        (g["id"], k, g["snapshot"][k],
                                          group[k]))
        if self._buffers_in_place():
            return
        for g in self._groups:
            for s in g["slots"]:
                p = s.param
                if p.data_ptr() != s.pview.data_ptr() and s.numel:
                    s.pview.copy_(p.detach())
                    p.data = s.pview
                if s.frozen:
                    continue
                grad = p.grad
                if grad is None:
                    s.gview.zero_()
                    p.grad = s.gview
                elif grad.is_sparse:
                    raise TypeError(
                        "optimd.torch.AdamW does not support sparse "
                        "gradients (parameter %s); use a dense gradient "
                        "(e.g. nn.Embedding(sparse=False))" % s.name)
                elif grad.data_ptr() != s.gview.data_ptr() and s.numel:
                    s.gview.copy_(grad)
                    p.grad = s.gview

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_buffers()
        overrides = {
            g["id"]: dict(lr=float(group["lr"]),
                          beta1=float(group["betas"][0]),
                          beta2=float(group["betas"][1]),
                          eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]))
            for g, group in zip(self._groups, self.param_groups)}
        if (self.max_grad_norm and self._world_size > 1
                and not self._warned_rank_norm):
            self._warned_rank_norm = True
            warnings.warn(
                "optimd.torch.AdamW: max_grad_norm clips by the norm of this "
                "rank's gradients only (world_size=%d); ranks do not agree "
                "on it. With gradients sharded across ranks, clip with "
                "torch.nn.utils.clip_grad_norm_ before step() and leave "
                "max_grad_norm at 0." % self._world_size, stacklevel=3)
        if self._ready_event is not None:
            self._ready_event.record()
        reply = self._client.step(
            lr_overrides=overrides,
            grad_scale=float(self.grad_scale or 0.0),
            max_grad_norm=float(self.max_grad_norm or 0.0),
            wait=self.wait_for_step,
            assume_finite=bool(self.assume_finite))
        if self._done_event is not None:
            self._done_event.wait()
        self.skipped = reply.skipped
        self.grad_norm = reply.grad_norm
        self.state.invalidate()
        return loss

    def zero_grad(self, set_to_none=None):
        for g in self._groups:
            for s in g["slots"]:
                if s.gview is None:
                    continue
                s.gview.zero_()
                s.param.grad = s.gview

    # State.
    def _fetch_state(self):
        # Tensor by tensor in batches, so that no reply nears the daemon's
        # per-reply limit.
        names = [s.name for g in self._groups for s in g["slots"]
                 if not s.frozen]
        by_group = {gs.group_id: gs for gs in
                    self._client.get_state(metadata_only=True).groups}
        budget, batch, batches = 256 << 20, [], []
        size = 0
        sizes = {s.name: s.numel * 16 for g in self._groups
                 for s in g["slots"]}
        for n in names:
            if batch and size + sizes[n] > budget:
                batches.append(batch)
                batch, size = [], 0
            batch.append(n)
            size += sizes[n]
        if batch:
            batches.append(batch)
        for b in batches:
            for gs in self._client.get_state(tensor_names=b).groups:
                by_group[gs.group_id].tensors.extend(gs.tensors)
        out = {}
        for g in self._groups:
            gs = by_group[g["id"]]
            if gs.step == 0:
                continue
            blobs = {}
            for t in gs.tensors:
                blobs.setdefault(t.tensor, {})[t.kind] = t
            for s in g["slots"]:
                if s.frozen:
                    continue
                entry = {"step": torch.tensor(float(gs.step))}
                for kind, t in blobs.get(s.name, {}).items():
                    value = _blob_tensor(t).view(s.param.shape).to(
                        s.param.device)
                    if kind == "master":
                        # fp32 parameters need no master in torch's format.
                        if s.param.dtype == torch.float32:
                            continue
                    entry[kind] = value
                out[s.param] = entry
        return out

    def state_dict(self):
        state = self._fetch_state()
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            packed["params"] = ids
            groups.append(packed)
        packed_state = {index[id(p)]: v for p, v in state.items()}
        return {"state": packed_state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        groups = self.param_groups
        saved = state_dict["param_groups"]
        if len(groups) != len(saved):
            raise ValueError("loaded state dict has a different number of "
                             "parameter groups")
        for g, sg in zip(groups, saved):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("loaded state dict contains a parameter "
                                 "group that doesn't match the size of "
                                 "optimizer's group")
        saved_state = state_dict["state"]
        for gi, (g, sg, mine) in enumerate(zip(groups, saved, self._groups)):
            old = {k: g[k] for k in _REGISTERED_KEYS}
            for k, v in sg.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
            if any(g[k] != old[k] for k in _IMMUTABLE_KEYS):
                # New hyperparameters: register the group afresh over the
                # same buffers, then write its state.
                self._client.unregister_group(mine["id"])
                slots = list(zip(mine["slots"], _offsets(mine)))
                request = self._group_request(gi, g, slots,
                                              *mine["segments"])
                self._client.register_group(request)
                mine["snapshot"] = {k: g[k] for k in _IMMUTABLE_KEYS}
                mine["request"] = request
            step = 0
            request = pb.SetStateRequest(group_id=mine["id"])
            for s, pid in zip(mine["slots"], sg["params"]):
                st = saved_state.get(pid)
                if not st or s.frozen:
                    continue
                if "step" in st:
                    step = max(step, int(float(st["step"])))
                for kind in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                             "master"):
                    if kind in st:
                        _add_blob(request, s.name, kind, st[kind])
            request.step = step
            self._client.set_state(request)
        self.state.invalidate()

    # Checkpoints written by the daemon.
    def save_checkpoint(self, directory, background=False):
        """The daemon writes this trainer's optimizer state and parameters to
        <directory>/<job>.rank-<rank>.safetensors (atomically). With
        background=True it returns once a consistent copy is taken and writes
        it while training goes on; see save_status()."""
        return self._client.save_state(directory, background=background)

    def state_bytes(self, chunk_bytes=4 << 20):
        """Yields the bytes of a checkpoint of this trainer's state (exactly
        what save_checkpoint would write), for a checkpoint store of your
        own. The state is copied at a step boundary when iteration starts."""
        for chunk in self._client.save_state_stream(chunk_bytes):
            yield chunk.data

    def load_state_bytes(self, chunks):
        """Loads a checkpoint from an iterable of byte strings (as yielded by
        state_bytes, or read back from your store). The total size is taken
        from the checkpoint's own header."""
        import struct as _struct

        def messages():
            offset = total = 0
            pending = b""
            for data in chunks:
                if total == 0:
                    pending += data
                    if len(pending) < 8:
                        continue
                    (hl,) = _struct.unpack("<Q", pending[:8])
                    header = pending[8:8 + hl]
                    if len(header) < hl:
                        continue
                    import json as _json
                    h = _json.loads(header)
                    end = max([v["data_offsets"][1] for k, v in h.items()
                               if k != "__metadata__"] + [0])
                    total = 8 + hl + end
                    data, pending = pending, b""
                yield pb.StateChunk(offset=offset, total_bytes=total,
                                    data=data)
                offset += len(data)
            if total == 0:
                raise ValueError("the checkpoint bytes end inside its header")
        reply = self._client.load_state_stream(messages())
        self._after_load()
        return reply

    def save_status(self):
        """Progress of the last background save: state, bytes_written,
        total_bytes, error."""
        return self._client.save_status()

    def wait_for_save(self, poll_s=0.05):
        """Blocks until the last background save finished; raises
        optimd.OptimdError if it failed."""
        import time as _time
        while True:
            st = self._client.save_status()
            if st.state != pb.SAVE_STATE_RUNNING:
                if st.state == pb.SAVE_STATE_FAILED:
                    raise errors.OptimdError("background save failed: " +
                                             st.error)
                return st
            _time.sleep(poll_s)

    def load_checkpoint(self, directory):
        """The daemon loads state and parameters from a save_checkpoint
        directory, in place. The groups must be registered as when saved."""
        reply = self._client.load_state(directory)
        self._after_load()
        return reply

    def _after_load(self):
        """A load set the daemon's state: take its learning rates, forget
        fetched state."""
        groups = self.client.get_state(metadata_only=True).groups
        for group, g in zip(self.param_groups, groups):
            group["lr"] = g.hyperparameters.lr
        self.state.invalidate()

    # Daemon access.
    @property
    def client(self):
        return self._client

    def close(self):
        """Closes the session: the daemon frees this trainer's state."""
        if self._client is not None and self._client.token:
            self._client.close_session()

    def __getstate__(self):
        raise TypeError("optimd.torch.AdamW holds a daemon session and "
                        "cannot be pickled; save state_dict() instead")


class _CudaSegment:
    """A flat CUDA buffer shared with the daemon by CUDA IPC."""

    def __init__(self, nbytes, device):
        from optimd import cuda_ipc
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.ipc_handle, self.base_offset = cuda_ipc.mem_handle(self.buffer)

    def tensor(self, offset, numel, dtype):
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.buffer.narrow(0, offset, nbytes).view(dtype)

    def handle(self, offset, nbytes):
        return pb.BufferHandle(cuda_ipc=pb.CudaIpcBuffer(
            ipc_handle=self.ipc_handle, device=self.device.index or 0,
            offset=self.base_offset + offset, size=nbytes))


def _offsets(group):
    seg_p, seg_g = group["segments"]
    out = []
    for s in group["slots"]:
        p_off = g_off = 0
        if s.numel:
            p_off = s.pview.data_ptr() - seg_p.tensor(0, 1, torch.uint8).data_ptr()
            if s.gview is not None:
                g_off = s.gview.data_ptr() - seg_g.tensor(0, 1, torch.uint8).data_ptr()
        out.append((p_off, g_off))
    return out


def _blob_tensor(t):
    dtype = _TORCH_DTYPES[t.dtype]
    if t.numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).clone()


def _add_blob(request, name, kind, value):
    value = value.detach().to("cpu").contiguous().reshape(-1)
    if value.dtype not in _DTYPES:
        value = value.to(torch.float32)
    request.tensors.add(tensor=name, kind=kind, dtype=_DTYPES[value.dtype],
                        numel=value.numel(),
                        data=value.view(torch.uint8).numpy().tobytes()
                        if value.numel() else b"")
