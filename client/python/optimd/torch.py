"""optimd.torch.AdamW, Adam, SGD and Lion: drop-in torch optimizers whose
step runs in the optimd daemon.

    from optimd.torch import AdamW
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    # or SGD(model.parameters(), lr=0.1, momentum=0.9), Lion(...)

Parameters are re-homed into memory the daemon can reach (POSIX shared
memory on the CPU, one CUDA allocation per group shared by CUDA IPC): each
parameter keeps its identity for the model, only its storage moves, and the
daemon writes new values there with no copy. Gradients stay where autograd
puts them: zero_grad() sets them to None as torch's does, backward writes
fresh ones, and each step tells the daemon only which moved or went away
(see optimd/_grads.py); a parameter whose `.grad` is None is not stepped.
The optimizer state (moments, master weights, step counters) lives in the
daemon; `state_dict()` and `optimizer.state[p]` fetch it on demand.

Followed as torch follows them: zero_grad both ways; edits of
param_groups (hyperparameters, amsgrad and maximize, parameters added,
removed or unfrozen: a parameter taken out keeps its state for a return);
lazy parameters once materialized; writes to optimizer.state, and state
tensors held across steps (updated in place); parameters moved to another
device or converted to bf16, fp16 or float64 after construction; float64
parameters (stepped in float64 with float64 state, as torch steps them;
exp_avg_dtype and state_dtype apply to the other dtypes); channels_last and
other dense layouts (kept); sparse gradients (torch's RuntimeError);
inf and NaN gradients, which reach the weights as in torch's step (with
max_grad_norm, as after torch's clip_grad_norm_: a NaN norm makes every
stepped parameter NaN, an infinite one clips by 0); skip_nonfinite=True
skips such a step instead (opt.skipped), as a GradScaler would.
Turning amsgrad on
after steps raises KeyError (optimd.MissingStateError) at the next step, as
torch's step does.

Differences from torch.optim.AdamW, all deliberate (README, "Deliberate
differences"):
  * After model.double() the state is carried over cast to float64 (as
    torch's load_state_dict casts it), so the moments are float64 from
    then on; torch's own step would go on with float32 moments.
  * A parameter listed twice in a group raises (torch steps it twice per
    step; the daemon keeps one state per tensor), unless under two names:
    a tied weight, registered once with the second name as its alias
    (optimd/_names.py).
  * Parameters on several devices (CPU and CUDA, cuda:0 and cuda:1), which
    torch's optimizers take, raise ValueError naming each device's
    parameters: at construction (nothing is left in the daemon), at
    add_param_group (param_groups stay as they were) or at the step after
    a parameter moved. An optimizer's session lives on one device, where
    the daemon keeps its state and writes the updated parameters; make one
    optimizer per device instead.
  * A parameter not dense in memory (a view with gaps, base[:, ::2], or an
    expanded tensor) raises ValueError: the daemon steps each parameter as
    one run of memory; make it contiguous.
  * max_grad_norm (optimd's own) clips by the norm of this rank's
    gradients, or of the job's with gradient_sharding.
"""
import collections
import inspect
import operator
import os
import secrets
import socket
import sys
import warnings
import weakref

import torch

from optimd import errors
from optimd._grads import GradRouter
from optimd._layout import is_dense, memory_shape, view_like
from optimd._names import ParamNames
# Public as optimd.torch.tied_named_parameters(model).
from optimd._names import tied_named_parameters  # noqa: F401
from optimd._state import DTYPES, DaemonState, set_state_request
from optimd import _secrets, _zero_state
from optimd._overlap import Overlap, assign_stages
from optimd._step_flags import StepFlags
from optimd.client import Client
from optimd.shm import SharedSegment, align
from optimd.v1 import optimd_pb2 as pb

_TORCH_DTYPES = {v: k for k, v in DTYPES.items()}

# AdamW's exp_avg_dtype for blockwise 8-bit moments: 2 bytes per parameter
# for both instead of 8 (fp32) or 4 (bf16); one fp32 scale per 256
# elements (docs/block8_moments.md). Its state dicts hold fp32 moments.
BLOCK8 = "block8"
_MOMENT_DTYPES = {torch.float32: pb.DTYPE_FLOAT32,
                  torch.bfloat16: pb.DTYPE_BFLOAT16,
                  BLOCK8: pb.DTYPE_BLOCK8}
# gradient_sharding= -> the API's GradientSharding.
_SHARDING = {None: pb.GRADIENT_SHARDING_UNSPECIFIED,
             "replicated": pb.GRADIENT_SHARDING_REPLICATED,
             "sharded": pb.GRADIENT_SHARDING_SHARDED}


# torch's switches between implementations of one step; optimd has its own.
_IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def _torch_defaults(cls):
    """The keyword defaults of the installed torch optimizer `cls`, so that
    our param_groups carry every key torch expects (state dicts move both
    ways)."""
    sig = inspect.signature(cls.__init__)
    out = {}
    for name, p in sig.parameters.items():
        if name in ("self", "params") or p.default is inspect.Parameter.empty:
            continue
        out[name] = p.default
    return out


# The keywords every optimd.torch optimizer takes for the daemon's session
# and step (not torch's hyperparameters): each constructor lists them in
# its own signature and hands them on with _service_options(locals()).
_SERVICE_OPTIONS = ("address", "job_id", "rank", "world_size", "resume",
                    "max_grad_norm", "grad_scale", "skip_nonfinite",
                    "keep_fp32", "overlap", "resume_secret", "timeout",
                    "gradient_sharding", "shard_state")


def _service_options(arguments):
    """The service keywords among a constructor's `arguments` (locals())."""
    return {k: arguments[k] for k in _SERVICE_OPTIONS}


class _TensorEntry:
    """Where one parameter lives in the group's shared segments."""

    __slots__ = ("param", "name", "numel", "pview", "gview", "frozen",
                 "group_id", "sent_ptr", "stage", "pflat")


class _DaemonOptimizer(torch.optim.Optimizer):
    """What every optimd.torch optimizer shares: the daemon session, the
    parameters re-homed into memory it reaches, gradients, steps, state and
    checkpoints. A subclass (AdamW, SGD, Lion) gives its optimizer's
    hyperparameters:
      _kind: the API's OptimizerKind.
      _fill_hyper(h, group): a group's hyperparameters into the request.
      _override_values(group): {field: value} a scheduler may change, sent
        with the step when they do (GroupOverride fields).
      _layout_of(group): what else a group registers with; a change
        registers the group anew, keeping its state.
      _slot_names(group): its state slots, in the daemon's order.
      _state_has_step: whether torch's state entries carry "step".
      _state_dtype_key: the group key of the state's dtype.
      _torch_class: torch's optimizer of the same math, whose keyword
        arguments (and their defaults in param_groups) are also taken;
        None where torch has none.
    """

    _state_has_step = True
    _state_dtype_key = "exp_avg_dtype"
    _torch_class = None

    def _start(self, params, defaults, *, address, job_id, rank, world_size,
               resume, max_grad_norm, grad_scale, skip_nonfinite, keep_fp32,
               overlap, resume_secret, timeout, gradient_sharding,
               shard_state):
        """The shared part of construction, once the subclass has checked
        its arguments and made `defaults`."""
        self._names = ParamNames()
        params = self._strip_names(params)
        self._ready = False
        self._sent_hyper = None  # the hyperparameters the daemon has
        self._groups = []  # per group: dict(id, tensors, segments, snapshot)
        # State of parameters taken out of their group, for their return,
        # and of lazy ones loaded before they are materialized:
        # id(param) -> (weak reference to it, its state).
        self._retired = {}
        torch.optim.Optimizer.__init__(self, params, defaults)
        self.state = DaemonState(self._fetch_daemon_state,
                                 self._retired_state)
        self.max_grad_norm = max_grad_norm
        self._warned_rank_norm = False
        self.grad_scale = grad_scale
        self.skip_nonfinite = skip_nonfinite
        self._keep_fp32 = {id(p) for p in keep_fp32}
        self.skipped = False
        self.grad_norm = None
        # CUDA: wait for each step on the daemon to report its own norm and
        # skipped flag (a host sync); otherwise they are of the last
        # completed step.
        self.wait_for_step = False
        self._device = self._check_devices()
        self._sharded = any(_is_dtensor(p) for g in self.param_groups
                            for p in g["params"])
        # One session per optimizer object: two optimizers of one process
        # (a GAN, a notebook cell run twice) never collide. resume=True
        # needs the job id of the session to take over.
        if gradient_sharding not in _SHARDING:
            raise ValueError("gradient_sharding must be None, 'replicated' or "
                             "'sharded', not %r" % (gradient_sharding,))
        rank, world_size = _dist_identity(rank, world_size)
        self._world_size = world_size
        gradient_sharding = _zero_sharding(shard_state, gradient_sharding,
                                           world_size)
        self._shard_state = bool(shard_state)
        # shard_state: the whole state put together on this rank by
        # consolidate_state_dict, which state_dict() returns.
        self._consolidated = None
        if shard_state and overlap:
            raise ValueError(
                "optimd.torch: overlap=True releases parameters stage by "
                "stage, before a step with shard_state=True has gathered "
                "the other ranks' parts; use one or the other")
        if job_id is None and gradient_sharding and world_size > 1:
            job_id = _shared_job_id()
        job = job_id or "%s-%d-%s" % (socket.gethostname(), os.getpid(),
                                      secrets.token_hex(4))
        if gradient_sharding is not None:
            # A step may wait for the other ranks up to the daemon's
            # --rank_timeout_s (600 s by default): the call must outlast it.
            timeout = max(timeout, 900.0)
        self._identity = dict(address=address, timeout=timeout, job=job,
                              rank=rank, world_size=world_size,
                              overlap=overlap,
                              sharding=_SHARDING[gradient_sharding],
                              shard_state=self._shard_state)
        self._open(resume, resume_secret)

    # Whether the optimizer's state may be block8 (AdamW only).
    _takes_block8 = False
    # Whether it steps float64 parameters (the daemon's kernels for it take
    # the float64 layout; a subclass whose kernels do not leaves it False,
    # and float64 parameters raise TypeError before the daemon is asked).
    _takes_float64 = False

    @classmethod
    def _check_options(cls, torch_options, state_dtype):
        if isinstance(state_dtype, str) and state_dtype == BLOCK8:
            if not cls._takes_block8:
                raise ValueError(
                    "optimd.torch.%s: block8 state is for AdamW/Adam "
                    "moments only; use torch.float32 or torch.bfloat16"
                    % cls.__name__)
        elif state_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError("the state dtype must be torch.float32 or "
                            "torch.bfloat16%s, not %s" %
                            (" or optimd.torch.BLOCK8"
                             if cls._takes_block8 else "", state_dtype))
        if "assume_finite" in torch_options:
            raise TypeError(
                "optimd.torch.%s: assume_finite is gone; non-finite "
                "gradients now reach the weights as in torch's step by "
                "default, and skip_nonfinite=True skips such steps" %
                cls.__name__)
        # Only what torch's own class takes: a misspelt keyword is an
        # error, as in torch, never an ignored group key.
        known = set(_IMPLEMENTATION_OPTIONS)
        if cls._torch_class is not None:
            known |= set(_torch_defaults(cls._torch_class))
        for k in sorted(set(torch_options) - known):
            raise TypeError("%s.__init__() got an unexpected keyword "
                            "argument %r" % (cls.__name__, k))
        for k, v in torch_options.items():
            if k in _IMPLEMENTATION_OPTIONS and v:
                raise ValueError("optimd.torch.%s runs its own fused step; "
                                 "%s=%r is not supported" %
                                 (cls.__name__, k, v))

    def _open(self, resume, resume_secret):
        """Opens (or resumes) the session on self._device and registers
        every group."""
        ident = self._identity
        job, rank = ident["job"], ident["rank"]
        self._client = Client(ident["address"], timeout=ident["timeout"])
        # CUDA: the trainer's stream and the daemon's are ordered by step
        # flags (_step_flags.py), so step() never waits for the daemon.
        self._flags = None
        self._overlap = None
        self._pending = collections.deque()  # replies not yet looked at
        if self._device.type == "cuda":
            self._flags = StepFlags(self._device)
            if ident["overlap"]:
                self._overlap = Overlap(self, self._flags)
            # Weakly: the client must not keep the optimizer alive (its
            # session closes when the optimizer is collected).
            method = weakref.WeakMethod(self._on_stream_broken)
            self._client.on_stream_broken = \
                lambda *a: method() is not None and method()(*a)
        if resume and resume_secret is None:
            resume_secret = _secrets.load(job, rank)
        # A CUDA job's ranks form one NCCL communicator: rank 0's daemon
        # makes its id, the trainers' process group carries it.
        nccl_job = (self._device.type == "cuda" and ident["sharding"] and
                    ident["world_size"] > 1)
        nccl_id = _shared_nccl_id(None) if nccl_job and rank != 0 else b""
        reply = self._client.create_session(
            job, rank=rank, world_size=ident["world_size"],
            device=-1 if self._device.type == "cpu" else self._device.index,
            resume=bool(resume), resume_secret=resume_secret or "",
            gradient_sharding=ident["sharding"], nccl_unique_id=nccl_id,
            shard_state=ident["shard_state"])
        if nccl_job and rank == 0:
            _shared_nccl_id(reply.nccl_unique_id)
        self.resumed = reply.resumed
        # What a restarted trainer must present to resume this session.
        self.resume_secret = reply.resume_secret
        _secrets.store(job, rank, reply.resume_secret)
        self._closer = weakref.finalize(self, _close_session, self._client,
                                        job, rank)
        registered = set(reply.group_ids)
        self._ready = True
        try:
            for gi, group in enumerate(self.param_groups):
                self._register_group(gi, group,
                                     existing=str(gi) in registered)
            if self.resumed:
                self._restore_after_resume()
            elif reply.saved_state_dir:
                # The daemon restarted and kept this session's state.
                self._client.load_state(reply.saved_state_dir)
                self._after_load()
                self.resumed = True
            elif resume and resume != "if_any":
                raise errors.NotFoundError(
                    "resume=True but the daemon at %s holds no session of "
                    "job '%s' rank %d, live or saved at its last stop; pass "
                    "resume='if_any' to start afresh when there is none" %
                    (self._client.address, job, rank))
        except BaseException:
            # A constructor that fails leaves nothing in the daemon (a
            # resumed session keeps the state it came for).
            if self.resumed:
                self._closer.detach()
                self._client.close()
            else:
                self._closer()
            raise

    # Construction helpers.
    def _strip_names(self, params):
        """`params` without names (optimd/_names.py keeps them, and the
        aliases of tied weights)."""
        if isinstance(params, torch.Tensor):
            raise TypeError("params argument given to the optimizer should be "
                            "an iterable of Tensors or dicts, but got " +
                            torch.typename(params))
        return self._names.strip(params)

    def _check_devices(self):
        """The one device of every parameter; raises ValueError naming the
        parameters of each device when they are on several."""
        by_device = {}
        for gi, g in enumerate(self.param_groups):
            for pi, p in enumerate(g["params"]):
                by_device.setdefault(p.device, []).append(
                    self._names.get(id(p), "%d.%d" % (gi, pi)))
        if len(by_device) > 1:
            raise _several_devices_error(type(self).__name__, by_device)
        device = next(iter(by_device), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise ValueError("optimd.torch supports CPU and CUDA "
                             "parameters, not %s" % device)
        return device

    def add_param_group(self, param_group):
        if isinstance(param_group.get("params"), (list, tuple)):
            param_group = dict(param_group)
            param_group["params"] = self._strip_names(param_group["params"])
        super().add_param_group(param_group)
        if self._ready:
            gi = len(self.param_groups) - 1
            try:
                self._check_devices()
                self._register_group(gi, self.param_groups[gi],
                                     existing=False)
            except BaseException:
                # Refused: the optimizer stays as it was, no group half
                # added (one in param_groups that the daemon never steps).
                self.param_groups.pop()
                raise

    def _group_request(self, gi, group, tensors, seg_p):
        request = pb.RegisterGroupRequest(group_id=str(gi))
        h = request.hyperparameters
        h.optimizer = self._kind
        self._fill_hyper(h, group)
        mw = group.get("master_weights")
        if group.get("store_param_remainders"):
            request.layout.master_weights = pb.MASTER_WEIGHTS_REMAINDER
        elif mw is True:
            request.layout.master_weights = pb.MASTER_WEIGHTS_FP32
        elif mw is False:
            request.layout.master_weights = pb.MASTER_WEIGHTS_NONE
        state_dtype = group.get(self._state_dtype_key, torch.float32)
        # float32 (the default) is left unspecified: the daemon then keeps
        # a float64 parameter's moments in float64, as torch does.
        request.layout.moment_dtype = (
            pb.DTYPE_UNSPECIFIED if state_dtype is torch.float32
            else _MOMENT_DTYPES[state_dtype])
        assign_stages([s for s, _ in tensors])
        if self._overlap is not None:
            self._overlap.set_stages([s for s, _ in tensors])
        for s, p_off in tensors:
            t = request.tensors.add(name=s.name, numel=s.numel,
                                    param_dtype=DTYPES[s.param.dtype],
                                    keep_fp32=id(s.param) in self._keep_fp32,
                                    frozen=s.frozen,
                                    shape=memory_shape(s.param),
                                    stage=s.stage,
                                    aliases=self._names.aliases_of(s.param))
            if not s.frozen:
                # Steps tell the daemon where gradients are (_grads.py).
                t.grad_dtype = DTYPES[s.param.dtype]
                t.grad_absent = True
            if s.numel:
                nbytes = s.numel * s.param.element_size()
                t.param.CopyFrom(seg_p.handle(p_off, nbytes))
        return request

    def _register_group(self, gi, group, existing, replace=False):
        self._check_group(gi, group)
        tensors = []
        p_bytes = 0
        for pi, p in enumerate(group["params"]):
            if _is_lazy(p):
                # Not materialized yet (a lazy module before its first
                # forward): absent, without state, as torch has it, until
                # _sync_structure finds it materialized.
                continue
            s = _TensorEntry()
            s.param = p
            s.name = self._names.get(id(p), "group%d.param%d" % (gi, pi))
            s.numel = p.numel()
            s.frozen = not p.requires_grad
            s.group_id = str(gi)
            s.gview = None
            s.sent_ptr = 0
            tensors.append((s, p_bytes))
            p_bytes += align(s.numel * p.element_size())
        if self._device.type == "cuda":
            seg_p = _CudaSegment(max(p_bytes, 64), self._device)
        else:
            seg_p = SharedSegment(max(p_bytes, 64))
        for s, p_off in tensors:
            p = s.param
            s.pflat = seg_p.tensor(p_off, s.numel, p.dtype)
            s.pview = view_like(s.pflat, p)
            s.pview.copy_(p.detach())
            p.data = s.pview
        request = self._group_request(gi, group, tensors, seg_p)
        if existing:
            update = pb.UpdateBuffersRequest(group_id=str(gi))
            for t in request.tensors:
                if t.numel:
                    update.tensors.add(name=t.name, param=t.param,
                                       grad_absent=not t.frozen)
            self._client.update_buffers(update)
        else:
            self._client.register_group(request)
        g = dict(id=str(gi), tensors=[s for s, _ in tensors],
                 segments=[seg_p, None],
                 snapshot=self._layout_of(group),
                 request=request,
                 # What _sync_structure compares the group with each step.
                 param_ids=[id(p) for p in group["params"]],
                 frozen=[s.param for s, _ in tensors if s.frozen],
                 lazy=[p for p in group["params"] if _is_lazy(p)])
        if replace:
            self._groups[gi] = g
        else:
            self._groups.append(g)
        if self._device.type == "cpu":
            self._flat_grads(g["id"])  # the daemon reads shared memory only
        self._index_buffers()

    def _check_group(self, gi, group):
        """Raises for a group the daemon cannot step, before anything of it
        is registered."""
        if len({id(p) for p in group["params"]}) != len(group["params"]):
            raise ValueError(
                "parameter group %d holds a parameter twice; torch steps it "
                "twice per step, optimd.torch refuses: list each "
                "parameter once" % gi)
        for pi, p in enumerate(group["params"]):
            if _is_lazy(p):
                continue
            name = self._names.get(id(p), "%d.%d" % (gi, pi))
            if p.dtype not in DTYPES:
                raise TypeError(
                    "optimd.torch supports float32, bfloat16, float16 and "
                    "float64 parameters; parameter %s is %s" %
                    (name, p.dtype))
            if p.dtype == torch.float64 and not self._takes_float64:
                raise TypeError(
                    "optimd.torch.%s steps float32, bfloat16 and float16 "
                    "parameters; parameter %s is float64" %
                    (type(self).__name__, name))
            if p.is_sparse:
                raise TypeError("optimd.torch does not support sparse "
                                "parameters")
            if p.numel() and not is_dense(p):
                raise _not_dense_error(name, p)

    def _flat_grads(self, group_id):
        """The group's flat gradient segment, made on first use, with a
        view per steppable tensor (CPU: where gradients are copied for the
        daemon; both: where zero_grad(set_to_none=False) puts them)."""
        g = self._groups[int(group_id)]
        if g["segments"][1] is not None:
            return g["segments"][1]
        offsets, g_bytes = [], 0
        for s in g["tensors"]:
            offsets.append(g_bytes)
            if not s.frozen:
                g_bytes += align(s.numel * s.param.element_size())
        if self._device.type == "cuda":
            seg_g = _CudaSegment(max(g_bytes, 64), self._device)
        else:
            seg_g = SharedSegment(max(g_bytes, 64))
        for s, off in zip(g["tensors"], offsets):
            if not s.frozen:
                s.gview = view_like(
                    seg_g.tensor(off, s.numel, s.param.dtype), s.param)
        g["segments"][1] = seg_g
        return seg_g

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
                             for s in g["tensors"] if s.numel]
        self._pptrs_flat = [s.pview.data_ptr() for g in self._groups
                            for s in g["tensors"] if s.numel]
        self._router = GradRouter(
            [s for g in self._groups for s in g["tensors"]], self._device,
            self._flat_grads)

    def _sync_structure(self):
        """A group whose parameters were added or removed since it was
        registered (param_groups[i]["params"] edited), or which has a
        parameter frozen then and trained now, or a lazy one materialized
        since, is registered anew over its current parameters, keeping the
        state of those it had (torch picks such changes up at its next
        step)."""
        for gi, (g, group) in enumerate(zip(self._groups, self.param_groups)):
            same = list(map(id, group["params"])) == g["param_ids"]
            unfrozen = any(map(_requires_grad, g["frozen"])) and any(
                p.requires_grad and p.grad is not None for p in g["frozen"])
            materialized = g["lazy"] and not all(map(_is_lazy, g["lazy"]))
            if same and not unfrozen and not materialized:
                continue
            self._check_group(gi, group)  # before it is unregistered
            state = self._fetch_state()
            # A parameter taken out keeps its state for a return, as in
            # torch (whose state is keyed by the parameter).
            kept = {id(p) for p in group["params"]}
            for s in g["tensors"]:
                if id(s.param) not in kept and s.param in state:
                    self._retired[id(s.param)] = (weakref.ref(s.param),
                                                  state[s.param])
            self._client.unregister_group(g["id"])
            self._register_group(gi, group, existing=False, replace=True)
            new = self._groups[gi]
            self._client.set_state(set_state_request(
                new["id"], new["tensors"],
                [state.get(s.param, self._take_retired(s.param))
                 for s in new["tensors"]],
                slot_names=self._slot_names(group)))
            self._sent_hyper = None
            self.state.invalidate()

    def _sync_params(self):
        for gi, (g, group) in enumerate(zip(self._groups,
                                            self.param_groups)):
            if self._layout_of(group) != g["snapshot"]:
                self._follow_layout_keys(gi, group, g)
        # map() keeps this at well under a microsecond per parameter.
        if list(map(torch.Tensor.data_ptr, self._params_flat)) == \
                self._pptrs_flat:
            return
        devices = {p.device for p in self._params_flat}
        if devices and devices != {self._device}:
            self._reopen(devices)
            return
        moved = [s for g in self._groups for s in g["tensors"]
                 if s.numel and s.param.data_ptr() != s.pview.data_ptr()]
        if any(s.param.dtype != s.pview.dtype and s.param.dtype in DTYPES and
               s.param.shape == s.pview.shape for s in moved):
            # model.half(), .bfloat16() or .double() after construction:
            # followed (registered anew in the new dtype, the state carried
            # over and cast to it, as torch's load_state_dict casts state).
            for gi, group in enumerate(self.param_groups):
                self._check_group(gi, group)  # before the session closes
            self._reopen({self._device})
            return
        for g in self._groups:
            for s in g["tensors"]:
                p = s.param
                if p.data_ptr() != s.pview.data_ptr() and s.numel:
                    if p.dtype != s.pview.dtype or p.shape != s.pview.shape:
                        # A dtype the daemon does not step, or a new
                        # shape: we cannot go on silently.
                        raise TypeError(
                            "parameter %s is now %s %s; it was registered "
                            "as %s %s. Convert the model before creating "
                            "the optimizer (or create a new one)" %
                            (s.name, p.dtype, tuple(p.shape),
                             s.pview.dtype, tuple(s.pview.shape)))
                    if not is_dense(p):  # p.data = a view with gaps
                        raise _not_dense_error(s.name, p)
                    s.pview.copy_(p.detach())
                    p.data = s.pview

    def _reopen(self, devices):
        """The parameters moved (model.to(), accelerate's prepare() of a
        model still on the CPU) or changed dtype (model.half()): a session
        lives on one device with one layout per tensor, so the optimizer
        opens one where the parameters are now, registers them as they
        are, and carries the state over (as torch's optimizer would go on
        with the changed parameters)."""
        if len(devices) > 1:
            by_device = {}
            for g in self._groups:
                for s in g["tensors"]:
                    by_device.setdefault(s.param.device, []).append(s.name)
            raise _several_devices_error(type(self).__name__, by_device,
                                         now=True)
        device = devices.pop()
        if device.type not in ("cpu", "cuda"):
            raise ValueError("the parameters moved to %s; optimd.torch "
                             "supports CPU and CUDA parameters" % device)
        self._finish_overlap()
        self._look_at_replies(block=True)
        saved = self._state_dict()
        resumed = self.resumed
        if self._overlap is not None:
            self._overlap.close()
        self._closer()
        self._groups = []
        self._sent_hyper = None
        self._device = device
        self._open(resume=False, resume_secret=None)
        self.resumed = resumed
        if saved["state"]:
            self.load_state_dict(saved)

    def _overrides(self):
        """Hyperparameters of the groups whose values changed since the
        daemon last got them (schedulers); None when none did."""
        current = [self._override_values(group) for group in self.param_groups]
        if current == self._sent_hyper:
            return None
        out = {}
        for g, values, sent in zip(self._groups, current,
                                   self._sent_hyper or [None] * len(current)):
            if values != sent:
                out[g["id"]] = values
        return out, current

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_overlap()
        self._sync_structure()
        self._sync_params()
        self._write_back_state()
        updates = self._router.updates()
        overrides = self._overrides()
        if (self.max_grad_norm and self._sharded
                and not self._identity["sharding"]
                and not self._warned_rank_norm):
            self._warned_rank_norm = True
            # Replicated gradients (DDP) have the same norm on every rank;
            # sharded ones (DTensor, FSDP2) do not.
            _warn_in_user_code(
                "optimd.torch: max_grad_norm clips by the norm of this "
                "rank's gradient shards only; ranks do not agree on it. Pass "
                "gradient_sharding='sharded' so that the ranks clip by the "
                "job's norm (or clip with torch.nn.utils.clip_grad_norm_ "
                "before step() and leave max_grad_norm at 0).")
        request = dict(
            lr_overrides=overrides[0] if overrides else None,
            grad_scale=float(self.grad_scale or 0.0),
            max_grad_norm=float(self.max_grad_norm or 0.0),
            wait=self.wait_for_step,
            # Torch's semantics unless skipping is asked for: the daemon
            # neither checks nor skips (proto: StepRequest.assume_finite).
            assume_finite=not self.skip_nonfinite,
            buffer_updates=updates)
        if self._flags is None:
            self._take_reply(self._client.step(**request))
        else:
            self._step_with_flags(request)
        if overrides:
            self._sent_hyper = overrides[1]
        self.state.invalidate()
        self.state.follow()  # state tensors the trainer holds, as in torch
        return loss

    def _step_with_flags(self, request):
        """CUDA: mark the gradients ready on our stream, send the step, make
        our stream wait for its done flag; look at replies as they come
        (their outcome: skipped, grad_norm) and raise a failed step's error
        at the latest one step later."""
        self._look_at_replies(block=False)
        stream = torch.cuda.current_stream(self._device)
        flags, sequence = self._flags.next_step(self._client.steps_streamed)
        staged = self._overlap is not None
        self._flags.mark_ready(stream, staged=staged)
        future = self._client.step_async(step_flags=flags, sequence=sequence,
                                         staged=staged, **request)
        if staged:
            self._overlap.started()  # forwards wait, stage by stage
        else:
            self._flags.wait_done(stream)
        self._pending.append(future)
        # wait_for_step: this step's own outcome; otherwise at most two
        # steps in flight before the host waits (bounded host lead).
        self._look_at_replies(block=self.wait_for_step,
                              keep=0 if self.wait_for_step else 2)

    def _look_at_replies(self, block, keep=0):
        """Takes the replies that have come; with `block`, first waits until
        at most `keep` steps are unanswered."""
        while self._pending:
            if not self._pending[0].done() and not (
                    block and len(self._pending) > keep):
                break
            self._take_reply(self._pending.popleft().result())

    def _take_reply(self, reply):
        if reply.known:
            self.skipped = reply.skipped
            self.grad_norm = reply.grad_norm

    def _on_stream_broken(self, first_index, replies_ok, error):
        """On the step stream's reader thread: the daemon will not release
        the unanswered steps; keep our stream from waiting forever."""
        failed = first_index + replies_ok - self._flags.first_index + 1
        self._flags.release_after_break(failed)

    def synchronize(self):
        """Waits for every step sent; raises a failed step's error. With
        overlap, the current stream then also waits for the last step."""
        self._finish_overlap()
        self._look_at_replies(block=True)

    def _finish_overlap(self):
        if self._overlap is not None:
            self._overlap.finish()

    def zero_grad(self, set_to_none=True):
        """As torch's: set_to_none=True (the default) sets every `.grad` to
        None, so the next backward writes fresh gradients once;
        set_to_none=False zeroes the existing gradients (in the group's flat
        gradient buffer, one launch per group; with overlap, after the last
        step is done with them)."""
        if set_to_none:
            if self._overlap is not None:
                self._overlap.keep(self._router.grads())
            self._router.set_to_none()
        else:
            self._finish_overlap()
            self._router.zero_()

    # State.
    def _fetch_state(self):
        """The state in torch's format: the daemon's, and that of
        parameters taken out of their group."""
        out = self._fetch_daemon_state()
        out.update(self._retired_state())
        return out

    def _fetch_daemon_state(self):
        if self._shard_state:
            raise NotImplementedError(
                "optimd.torch: with shard_state=True each rank's daemon "
                "session holds only its part of the optimizer state, so "
                "optimizer.state is not available; for the whole state call "
                "consolidate_state_dict(to=0) on every rank, then "
                "state_dict() on rank 0 (as with torch's "
                "ZeroRedundancyOptimizer), or save_checkpoint(directory) on "
                "every rank")
        by_group = self._daemon_group_states()
        out = {}
        for g in self._groups:
            gs = by_group[g["id"]]
            if gs.step == 0:
                continue
            blobs = {}
            for t in gs.tensors:
                blobs.setdefault(t.tensor, {})[t.kind] = t
            for s in g["tensors"]:
                if s.frozen:
                    continue
                mine = blobs.get(s.name, {})
                own = next(iter(mine.values())).step if mine else gs.step
                entry = self._state_entry(s, own, {
                    kind: _blob_tensor(t) for kind, t in mine.items()})
                if entry is not None:
                    out[s.param] = entry
        return out

    def _daemon_group_states(self):
        """{group id: GroupState} of every group, with the state of each
        tensor that is not frozen, fetched tensor by tensor in batches so
        that no reply nears the daemon's per-reply limit."""
        names = [s.name for g in self._groups for s in g["tensors"]
                 if not s.frozen]
        by_group = {gs.group_id: gs for gs in
                    self._client.get_state(metadata_only=True).groups}
        budget, batch, batches = 256 << 20, [], []
        size = 0
        # A master and up to three state slots, of 4 bytes per element (8
        # for float64 parameters).
        sizes = {s.name: s.numel * 4 * max(4, s.param.element_size())
                 for g in self._groups for s in g["tensors"]}
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
        return by_group

    def _state_entry(self, s, own, flats):
        """Tensor `s`'s torch-format entry from its own step count and its
        state buffers ({kind: 1-D in memory order}); None when it was never
        stepped (torch has no state for it then)."""
        if own == 0 and s.numel:
            return None
        entry = {"step": torch.tensor(float(own))} \
            if self._state_has_step else {}
        for kind, flat in flats.items():
            # fp32 and float64 parameters need no master in torch's format.
            if kind == "master" and s.param.dtype in (torch.float32,
                                                      torch.float64):
                continue
            entry[kind] = view_like(flat, s.param).to(s.param.device)
        return entry

    def consolidate_state_dict(self, to=0):
        """shard_state=True: puts the whole optimizer state together on rank
        `to`, whose state_dict() then returns it, as torch's
        ZeroRedundancyOptimizer.consolidate_state_dict does. A collective:
        every rank of the job calls it (through torch.distributed). Without
        shard_state there is nothing to put together: state_dict() gives
        the whole state on every rank."""
        self._consolidated = None
        if not self._shard_state:
            return
        dist = self._distributed("consolidate_state_dict")
        self._sync_params()
        parts = _zero_state.local_parts(
            self._groups, self._daemon_group_states(), _blob_tensor)
        rank = self._identity["rank"]
        gathered = [None] * self._world_size if rank == to else None
        dist.gather_object(parts, gathered, dst=to)
        if rank == to:
            state = _zero_state.assemble(self._groups, gathered,
                                         self._world_size, self._state_entry)
            self._consolidated = self._pack_state_dict(state)

    def _distributed(self, what):
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "optimd.torch: with shard_state=True %s needs the ranks to "
                "exchange their parts of the state through "
                "torch.distributed, which is not initialized" % what)
        return dist

    def _ranges(self, g):
        """shard_state: this rank's part of each of group g's tensors."""
        return _zero_state.part_ranges(g["tensors"], self._identity["rank"],
                                       self._world_size)

    def _retired_state(self):
        """{param: entry} of the parameters taken out of their group, kept
        for a return."""
        out = {}
        for key, (ref, entry) in list(self._retired.items()):
            p = ref()
            if p is None:
                del self._retired[key]
            else:
                out[p] = entry
        return out

    def _take_retired(self, p):
        ref, entry = self._retired.pop(id(p), (None, None))
        return entry if ref is not None and ref() is p else None

    def state_dict(self):
        if self._shard_state:
            # As torch's ZeroRedundancyOptimizer: the last whole state put
            # together on this rank.
            if self._consolidated is None:
                raise RuntimeError(
                    "optimd.torch: with shard_state=True the optimizer "
                    "state is not put together on this rank (rank %d); call "
                    "consolidate_state_dict(to=%d) on every rank first if "
                    "you meant to save the whole state" % (
                        self._identity["rank"], self._identity["rank"]))
            return self._consolidated
        self._sync_params()
        return self._state_dict()

    def _state_dict(self):
        return self._pack_state_dict(self._fetch_state())

    def _pack_state_dict(self, state):
        """torch's state-dict format of {param: entry}: parameters by their
        index across param_groups."""
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
        # Parameters edited or materialized (a lazy module's, by the
        # model's own load_state_dict) are registered before their state.
        self._sync_structure()
        self._sync_params()
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
        masters = False
        for gi, (g, sg, mine) in enumerate(zip(groups, saved, self._groups)):
            for k, v in sg.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v
            if self._layout_of(g) != mine["snapshot"]:
                self._reregister(gi, g, mine)
            entries = {id(p): saved_state.get(pid)
                       for p, pid in zip(g["params"], sg["params"])}
            for p in mine["lazy"]:
                # Kept until the parameter is materialized and registered.
                if entries.get(id(p)):
                    self._retired[id(p)] = (weakref.ref(p), entries[id(p)])
            self._client.set_state(set_state_request(
                mine["id"], mine["tensors"],
                [entries.get(id(s.param)) for s in mine["tensors"]],
                slot_names=self._slot_names(g),
                ranges=self._ranges(mine) if self._shard_state else None))
            masters |= any("master" in (e or {}) for e in entries.values())
        if masters:
            # shard_state: each rank's masters set only its part of the
            # parameters; the ranks exchange the parts.
            self._share_parts()
        self._sent_hyper = None  # the next step sends them all again
        # New state, as torch's load makes new tensors: what was handed out
        # before is let go.
        self.state.invalidate(follow=False)

    def _reregister(self, gi, group, mine):
        """New hyperparameters that steps do not carry (_layout_of): the
        group is registered afresh over the same buffers (its state is the
        caller's to write)."""
        self._client.unregister_group(mine["id"])
        seg_p = mine["segments"][0]
        tensors = list(zip(mine["tensors"], _param_offsets(mine)))
        request = self._group_request(gi, group, tensors, seg_p)
        self._client.register_group(request)
        mine["snapshot"] = self._layout_of(group)
        mine["request"] = request
        # Registered afresh: every gradient is absent to the daemon.
        for s in mine["tensors"]:
            s.sent_ptr = 0
        self._index_buffers()

    def _follow_layout_keys(self, gi, group, mine):
        """Hyperparameters that steps do not carry (_layout_of) edited in
        param_groups: followed as torch does, keeping the state."""
        state = self._fetch_state()
        tensors_state = [state.get(s.param) for s in mine["tensors"]]
        self._check_layout_change(gi, group, mine["snapshot"], tensors_state)
        self._reregister(gi, group, mine)
        self._client.set_state(set_state_request(
            mine["id"], mine["tensors"], tensors_state,
            slot_names=self._slot_names(group)))
        self._sent_hyper = None
        self.state.invalidate()

    def _write_back_state(self):
        """Writes to optimizer.state since it was fetched (an entry zeroed,
        replaced or removed, state.clear()) reach the daemon before a step,
        as they would take effect in torch."""
        written = self.state.written()
        if written is None:
            return
        for g, group in zip(self._groups, self.param_groups):
            self._client.set_state(set_state_request(
                g["id"], g["tensors"], [written.get(s.param) for s in
                                      g["tensors"]],
                slot_names=self._slot_names(group)))
        self.state.invalidate()

    # Checkpoints written by the daemon.
    def save_checkpoint(self, directory, background=False):
        """The daemon writes this trainer's optimizer state and parameters to
        <directory>/rank-<rank>.safetensors (atomically; the job id is in
        its metadata, so a new process finds it by rank). With
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
        self._share_parts()
        groups = self.client.get_state(metadata_only=True).groups
        for group, g in zip(self.param_groups, groups):
            group["lr"] = g.hyperparameters.lr
        self._sent_hyper = None  # the next step sends them all again
        self.state.invalidate(follow=False)

    def _share_parts(self):
        """shard_state: a load wrote only this rank's part of each
        parameter (its checkpoint holds that part); every rank's part is
        broadcast to the others through torch.distributed, so that the
        ranks' parameters agree before the next forward. The partition is
        the daemon's (CreateSessionRequest.shard_state)."""
        if not self._shard_state:
            return
        dist = self._distributed("a load")
        if self._flags is not None:
            torch.cuda.synchronize(self._device)
        for g in self._groups:
            for r in range(self._world_size):
                ranges = _zero_state.part_ranges(g["tensors"], r,
                                                 self._world_size)
                for s, (b, e) in zip(g["tensors"], ranges):
                    if b < e:
                        dist.broadcast(s.pflat[b:e], src=r)

    # Daemon access.
    @property
    def client(self):
        return self._client

    def close(self):
        """Closes the session: the daemon frees this trainer's state. Done
        by itself when the optimizer is collected or the process exits
        normally (a killed trainer's session stays for resume=True)."""
        if self._overlap is not None:
            self._finish_overlap()
            self._overlap.close()
            self._overlap = None
        self._closer()

    def __getstate__(self):
        raise TypeError("optimd.torch holds a daemon session and "
                        "cannot be pickled; save state_dict() instead")


class AdamW(_DaemonOptimizer):
    """torch.optim.AdamW with the step in the optimd daemon.

    Besides torch's arguments:
      address: the daemon (default: its default socket, or $OPTIMD_ADDRESS).
      job_id, rank, world_size: the session's identity (default: a job id
        of this optimizer's own, or with gradient_sharding one rank 0 makes
        and torch.distributed carries to the others; rank and world size
        from torch.distributed when it is initialized, else 0 and 1);
        resume=True takes over the session of the
        same job id and rank (a restarted trainer's, kept by the daemon, or
        one the daemon saved when it stopped, with its --save_dir), restores
        its weights and state, and raises optimd.NotFoundError when there is
        none; resume="if_any" starts afresh then. A resume presents the
        session's secret (optimd._secrets: kept in a file of this user's
        by job id and rank, found by a trainer restarted on the same node;
        elsewhere pass resume_secret=, the old optimizer's
        `opt.resume_secret`); a wrong or missing one raises
        optimd.PermissionDeniedError.
      master_weights: None (an fp32 master exactly for non-fp32 parameters),
        True (always, so a crashed trainer can get fp32 weights back), False.
      store_param_remainders: bf16 parameters keep an int16 remainder instead
        of an fp32 master (exact; 4 bytes less per parameter).
      exp_avg_dtype: torch.float32 or torch.bfloat16 moments, or
        optimd.torch.BLOCK8: both moments in 8 bits with one fp32 scale per
        256 elements (2 bytes per parameter; not with amsgrad). State dicts
        hold them as fp32, as torch's AdamW does. float64 parameters keep
        float64 moments whatever the default float32 says, and refuse the
        others.
      max_grad_norm: clip by the gradient norm (0: off): this rank's, or
        the job's with gradient_sharding.
      gradient_sharding: with world_size > 1, how the job's gradients lie
        across its ranks: "replicated" (DDP: each rank holds the whole
        gradient) or "sharded" (FSDP2, ZeRO: each rank a shard). The
        ranks' sessions then agree on every step: the job's gradient norm
        (the square root of the sum over the shards' sums of squares),
        clipping by it, and the skip when any rank's gradients hold inf or
        NaN; each step waits for the same step of every rank (the daemon's
        --rank_timeout_s; calls then wait up to at least 900 s). On CUDA
        the ranks form one NCCL communicator (its id travels through
        torch.distributed, which must be initialized) and agree on the
        device inside each step. Without gradient_sharding a step warns
        once when max_grad_norm is set with sharded parameters.
      shard_state: ZeRO for DDP (world_size > 1; implies
        gradient_sharding="replicated"). Every rank registers its whole
        parameters and all-reduced gradients as usual, but its daemon
        session keeps moments and master weights only for its 1/N of each
        group (the group's tensors laid end to end, split into N
        contiguous ranges, tensors cut at the boundaries), updates that
        part, and writes every rank's updated part into every rank's
        parameters before step() returns (CUDA: before the trainer's
        stream goes on), through NCCL on CUDA. Clipping uses the whole
        gradient's norm. As with torch's ZeroRedundancyOptimizer,
        consolidate_state_dict(to=0) on every rank puts the whole state
        together on rank 0 for its state_dict(), and load_state_dict(whole)
        on every rank takes each rank's part; optimizer.state is not
        available (each rank holds a part). save_checkpoint and
        load_checkpoint on every rank keep the parts, for the same world
        size.
      grad_scale: divide gradients by this (loss scaling) before use.
      skip_nonfinite: False (torch's semantics, the default): the daemon
        neither checks nor skips; an inf or NaN gradient reaches the update
        as in torch's step, and with max_grad_norm a non-finite norm clips
        as torch.nn.utils.clip_grad_norm_ does (NaN norm: every stepped
        parameter becomes NaN; infinite norm: gradients times 0, inf
        elements NaN). Without max_grad_norm no statistics pass runs (the
        fastest step) and opt.grad_norm is NaN. True: the daemon sums the
        gradients' squares and skips a step with inf or NaN entirely
        (nothing changes, opt.skipped is True; for loss scaling with
        grad_scale, as a GradScaler skips). With gradient_sharding the
        ranks always skip such a step together.
      keep_fp32: parameters to update in fp32 in place (norms, router biases).
      adam_w_mode: False for Adam's L2 regularization instead of decoupled
        decay; bias_correction: False to skip (1 - beta^t).
      overlap: CUDA: the update of step n runs while the trainer goes on
        into iteration n + 1; each module's forward waits only for its own
        parameters (_overlap.py). A parameter is then current in the
        forward of the module that holds it, or after synchronize(): call
        synchronize() before reading parameters anywhere else (another
        module's weight used functionally, model.state_dict()). Same
        results as without. No effect on CPU parameters (the CPU step
        completes before step() returns).
    Parameters may be given as (name, tensor) pairs to name their state;
    a tied weight given under each of its names (tied_named_parameters(
    model), or torch 2.x's named_parameters(remove_duplicate=False)) is
    registered once, its other names kept as aliases that checkpoints list
    and exports load by (optimd/_names.py).

    float64 parameters are stepped in float64 with float64 moments, as
    torch steps them (a group may mix them with float32 ones);
    exp_avg_dtype applies to float32, bf16 and fp16 parameters.

    Where it differs from torch.optim.AdamW (README, "Deliberate
    differences"): a parameter listed twice in a group, parameters on
    several devices (one optimizer per device instead) and parameters not
    dense in memory raise; after model.double() the moments are cast to
    float64 and training goes on (torch's own step fails there).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, amsgrad=False, *, maximize=False,
                 address=None, job_id=None, rank=None, world_size=None,
                 resume=False, master_weights=None,
                 store_param_remainders=False, exp_avg_dtype=torch.float32,
                 max_grad_norm=0.0, grad_scale=None, skip_nonfinite=False,
                 keep_fp32=(), overlap=False, resume_secret=None,
                 adam_w_mode=True, bias_correction=True, timeout=60.0,
                 gradient_sharding=None, shard_state=False, **torch_options):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= eps:
            raise ValueError("Invalid epsilon value: {}".format(eps))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise ValueError(
                "Invalid weight_decay value: {}".format(weight_decay))
        self._check_options(torch_options, exp_avg_dtype)
        if amsgrad and isinstance(exp_avg_dtype, str):
            raise ValueError("amsgrad needs torch.float32 or torch.bfloat16 "
                             "moments, not block8 (its running maximum has "
                             "no 8-bit form)")
        defaults = _torch_defaults(self._torch_class)
        defaults.update(torch_options)
        defaults.update(dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            amsgrad=amsgrad, maximize=maximize, master_weights=master_weights,
            store_param_remainders=store_param_remainders,
            exp_avg_dtype=exp_avg_dtype, adam_w_mode=adam_w_mode,
            bias_correction=bias_correction))
        self._start(params, defaults, **_service_options(locals()))

    _kind = pb.OPTIMIZER_KIND_ADAMW
    _takes_block8 = True
    _takes_float64 = True
    # Whose keyword defaults the param_groups carry.
    _torch_class = torch.optim.AdamW

    def _fill_hyper(self, h, group):
        h.lr = float(group["lr"])
        h.beta1, h.beta2 = (float(b) for b in group["betas"])
        h.eps = float(group["eps"])
        h.weight_decay = float(group["weight_decay"])
        h.mode = pb.ADAM_MODE_ADAMW if _decoupled(group) \
            else pb.ADAM_MODE_ADAM
        h.bias_correction = bool(group.get("bias_correction", True))
        h.maximize = bool(group["maximize"])
        h.amsgrad = bool(group["amsgrad"])

    def _override_values(self, group):
        return dict(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                    beta2=float(group["betas"][1]), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]))

    def _layout_of(self, group):
        return dict(amsgrad=group["amsgrad"], maximize=group["maximize"],
                    decoupled=_decoupled(group))

    def _slot_names(self, group):
        return ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _check_layout_change(self, gi, group, snapshot, tensors_state):
        # Turning amsgrad on once the group has state fails in torch too
        # (its step finds no max_exp_avg_sq: KeyError).
        if group["amsgrad"] and not snapshot["amsgrad"] and any(tensors_state):
            raise errors.MissingStateError(
                "param_groups[%d]['amsgrad'] was turned on after steps: the "
                "state has no max_exp_avg_sq (torch.optim.AdamW's step "
                "raises KeyError too); set amsgrad before the first step" %
                gi)


def _decoupled(group):
    """Whether a group's weight decay is AdamW's: optimd's adam_w_mode, or
    torch.optim.Adam's decoupled_weight_decay (torch 2.6 and later), which
    makes Adam AdamW."""
    return bool(group.get("adam_w_mode", True) or
                group.get("decoupled_weight_decay", False))


class Adam(AdamW):
    """torch.optim.Adam with the step in the optimd daemon: AdamW with
    Adam's L2 weight decay (folded into the gradient) and torch.optim.Adam's
    defaults (weight_decay=0), so that a torch.optim.Adam user changes only
    the import. The optimd arguments are those of optimd.torch.AdamW."""

    _torch_class = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, **kwargs):
        if "adam_w_mode" in kwargs:
            raise TypeError("optimd.torch.Adam is Adam (L2 decay); use "
                            "optimd.torch.AdamW for decoupled decay")
        super().__init__(params, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad,
                         adam_w_mode=False, **kwargs)


class SGD(_DaemonOptimizer):
    """torch.optim.SGD with the step in the optimd daemon: momentum,
    dampening, nesterov, weight_decay and maximize as torch has them (a
    tensor's first step starts its momentum buffer from the gradient);
    optimizer.state holds torch's "momentum_buffer" (none without
    momentum). Momentum may change between steps (schedulers cycle it);
    turning it on or off, or changing dampening, nesterov or maximize,
    registers the group anew, keeping its state.

    Besides torch's arguments:
      address, job_id, rank, world_size, resume, resume_secret,
        master_weights, store_param_remainders, max_grad_norm,
        gradient_sharding, grad_scale, skip_nonfinite, keep_fp32, overlap,
        timeout: as optimd.torch.AdamW has them.
      state_dtype: torch.float32 or torch.bfloat16 momentum buffers.
    Parameters may be given as (name, tensor) pairs to name their state;
    a tied weight given under each of its names (tied_named_parameters(
    model), or torch 2.x's named_parameters(remove_duplicate=False)) is
    registered once, its other names kept as aliases that checkpoints list
    and exports load by (optimd/_names.py).

    float64 parameters are stepped in float64 with float64 momentum
    buffers, as torch steps them (a group may mix them with float32 ones;
    state_dtype applies to float32, bf16 and fp16 parameters), and
    model.double() after construction is followed as AdamW follows it.
    """

    _kind = pb.OPTIMIZER_KIND_SGD
    _torch_class = torch.optim.SGD
    _state_has_step = False
    _state_dtype_key = "state_dtype"
    _takes_float64 = True

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0,
                 weight_decay=0.0, nesterov=False, *, maximize=False,
                 address=None, job_id=None, rank=None, world_size=None,
                 resume=False, master_weights=None,
                 store_param_remainders=False, state_dtype=torch.float32,
                 max_grad_norm=0.0, grad_scale=None, skip_nonfinite=False,
                 keep_fp32=(), overlap=False, resume_secret=None,
                 timeout=60.0, gradient_sharding=None, shard_state=False,
                 **torch_options):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if momentum < 0.0:
            raise ValueError("Invalid momentum value: {}".format(momentum))
        if weight_decay < 0.0:
            raise ValueError(
                "Invalid weight_decay value: {}".format(weight_decay))
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(
                "Nesterov momentum requires a momentum and zero dampening")
        self._check_options(torch_options, state_dtype)
        defaults = _torch_defaults(self._torch_class)
        defaults.update(torch_options)
        defaults.update(dict(
            lr=lr, momentum=momentum, dampening=dampening,
            weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
            master_weights=master_weights,
            store_param_remainders=store_param_remainders,
            state_dtype=state_dtype))
        self._start(params, defaults, **_service_options(locals()))

    def _fill_hyper(self, h, group):
        h.lr = float(group["lr"])
        h.momentum = float(group["momentum"])
        h.dampening = float(group["dampening"])
        h.weight_decay = float(group["weight_decay"])
        h.nesterov = bool(group["nesterov"])
        h.maximize = bool(group["maximize"])

    def _override_values(self, group):
        return dict(lr=float(group["lr"]),
                    weight_decay=float(group["weight_decay"]),
                    momentum=float(group["momentum"]))

    def _layout_of(self, group):
        return dict(momentum_on=group["momentum"] != 0,
                    dampening=group["dampening"], nesterov=group["nesterov"],
                    maximize=group["maximize"])

    def _slot_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _check_layout_change(self, gi, group, snapshot, tensors_state):
        pass


class Lion(_DaemonOptimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization
    Algorithms") with the step in the optimd daemon: per element,
    p = p*(1 - lr*wd) - lr*sign(beta1*m + (1-beta1)*g), then
    m = beta2*m + (1-beta2)*g. optimizer.state holds "exp_avg" (m), as the
    widely used lion-pytorch package names it. Use a learning rate 3-10x
    smaller and a weight decay 3-10x larger than with AdamW (the paper's
    advice).

    Besides lr, betas, weight_decay and maximize:
      address, job_id, rank, world_size, resume, resume_secret,
        master_weights, store_param_remainders, max_grad_norm,
        gradient_sharding, grad_scale, skip_nonfinite, keep_fp32, overlap,
        timeout: as optimd.torch.AdamW has them.
      state_dtype: torch.float32 or torch.bfloat16 momentum.
    Parameters may be given as (name, tensor) pairs to name their state;
    a tied weight given under each of its names (tied_named_parameters(
    model), or torch 2.x's named_parameters(remove_duplicate=False)) is
    registered once, its other names kept as aliases that checkpoints list
    and exports load by (optimd/_names.py).

    float64 parameters are stepped in float64 with a float64 exp_avg (a
    group may mix them with float32 ones; state_dtype applies to float32,
    bf16 and fp16 parameters), and model.double() after construction is
    followed as AdamW follows it.
    """

    _kind = pb.OPTIMIZER_KIND_LION
    _state_has_step = False
    _state_dtype_key = "state_dtype"
    _takes_float64 = True

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0,
                 *, maximize=False,
                 address=None, job_id=None, rank=None, world_size=None,
                 resume=False, master_weights=None,
                 store_param_remainders=False, state_dtype=torch.float32,
                 max_grad_norm=0.0, grad_scale=None, skip_nonfinite=False,
                 keep_fp32=(), overlap=False, resume_secret=None,
                 timeout=60.0, gradient_sharding=None, shard_state=False,
                 **torch_options):
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameters: {}".format(betas))
        if not 0.0 <= weight_decay:
            raise ValueError(
                "Invalid weight_decay value: {}".format(weight_decay))
        self._check_options(torch_options, state_dtype)
        defaults = dict(torch_options)
        defaults.update(dict(
            lr=lr, betas=tuple(betas), weight_decay=weight_decay,
            maximize=maximize, master_weights=master_weights,
            store_param_remainders=store_param_remainders,
            state_dtype=state_dtype))
        self._start(params, defaults, **_service_options(locals()))

    def _fill_hyper(self, h, group):
        h.lr = float(group["lr"])
        h.beta1, h.beta2 = (float(b) for b in group["betas"])
        h.weight_decay = float(group["weight_decay"])
        h.maximize = bool(group["maximize"])

    def _override_values(self, group):
        return dict(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                    beta2=float(group["betas"][1]),
                    weight_decay=float(group["weight_decay"]))

    def _layout_of(self, group):
        return dict(maximize=group["maximize"])

    def _slot_names(self, group):
        return ("exp_avg",)

    def _check_layout_change(self, gi, group, snapshot, tensors_state):
        pass


class _DeviceBytes:
    """`nbytes` bytes of device memory at `ptr` inside `owner`, offered to
    torch.as_tensor through the CUDA array interface (torch keeps this
    object, hence `owner`, alive as long as the tensor's storage)."""

    def __init__(self, owner, ptr, nbytes):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 2}


class _CudaSegment:
    """A flat CUDA buffer shared with the daemon by CUDA IPC."""

    def __init__(self, nbytes, device):
        from optimd import cuda_ipc
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.ipc_handle, self.base_offset = cuda_ipc.mem_handle(self.buffer)

    def tensor(self, offset, numel, dtype):
        """A 1-D tensor over bytes [offset, +numel elements) whose storage
        is exactly those bytes (not the whole buffer), as a tensor of its
        own allocation would be: libraries that look at storages (e.g.
        safetensors, which saves tied weights only when one name covers
        its whole storage) see each parameter as torch would have made
        it. The flat buffer stays alive as long as any of them."""
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        piece = _DeviceBytes(self.buffer, self.buffer.data_ptr() + offset,
                             nbytes)
        return torch.as_tensor(piece, device=self.device).view(dtype)

    def handle(self, offset, nbytes):
        return pb.BufferHandle(cuda_ipc=pb.CudaIpcBuffer(
            ipc_handle=self.ipc_handle, device=self.device.index or 0,
            offset=self.base_offset + offset, size=nbytes))

    def base_ptr(self):
        return self.buffer.data_ptr()

    def zero_(self):
        self.buffer.zero_()


def _several_devices_error(cls_name, by_device, now=False):
    """Parameters on several devices: torch's optimizers take them, an
    optimd optimizer's session lives on one device (the daemon keeps its
    state there and writes the updated parameters into that device's
    memory), so it refuses them, naming a few parameters of each device."""
    def names(ps):
        return ", ".join(ps[:3]) + (" and %d more" % (len(ps) - 3)
                                    if len(ps) > 3 else "")
    where = "; ".join("%s: %s" % (d, names(ps)) for d, ps in
                      sorted(by_device.items(), key=lambda kv: str(kv[0])))
    return ValueError(
        "optimd.torch.%s: the parameters are %son several devices (%s); an "
        "optimizer's daemon session lives on one device, so all parameters "
        "must be on one device. Make one optimizer per device (e.g. "
        "%s(cpu_params) and %s(cuda_params)), or move the model to one "
        "device" % (cls_name, "now " if now else "", where, cls_name,
                    cls_name))


def _not_dense_error(name, p):
    """The daemon steps a tensor as one run of memory: a view with gaps
    (base[:, ::2]) or repeats (expand) would silently lose its strides."""
    return ValueError(
        "parameter %s (shape %s, strides %s) is not dense in memory; "
        "optimd.torch steps each parameter as one run of memory: make it "
        "contiguous, e.g. torch.nn.Parameter(t.contiguous())" %
        (name, tuple(p.shape), p.stride()))


def _param_offsets(group):
    seg_p = group["segments"][0]
    return [s.pview.data_ptr() - seg_p.base_ptr() if s.numel else 0
            for s in group["tensors"]]


def _warn_in_user_code(message):
    """warnings.warn, attributed to the first caller outside torch and
    optimd (step() is wrapped by torch's decorators)."""
    internal = (os.path.dirname(torch.__file__),
                os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 2
    while frame is not None and \
            os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


_requires_grad = operator.attrgetter("requires_grad")
# An UninitializedParameter (a lazy module's before its first forward).
_is_lazy = torch.nn.parameter.is_lazy


def _zero_sharding(shard_state, gradient_sharding, world_size):
    """The gradient_sharding a shard_state=True optimizer runs with:
    replicated (DDP's whole, all-reduced gradients on every rank)."""
    if not shard_state:
        return gradient_sharding
    if world_size < 2:
        raise ValueError(
            "shard_state=True splits the optimizer state across the ranks "
            "of a job: it needs world_size > 1 (torch.distributed "
            "initialized, or world_size=), got %d" % world_size)
    if gradient_sharding not in (None, "replicated"):
        raise ValueError(
            "shard_state=True is for DDP, whose ranks hold whole gradients "
            "(gradient_sharding='replicated'); got gradient_sharding=%r. "
            "FSDP2 shards its parameters itself: use "
            "gradient_sharding='sharded' without shard_state" %
            (gradient_sharding,))
    return "replicated"


def _dist_identity(rank, world_size):
    """rank and world_size as given, else torch.distributed's when it is
    initialized, else 0 and 1."""
    initialized = torch.distributed.is_available() and \
        torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialized else 1
    return rank, world_size


def _shared_job_id():
    """A job id for every rank: rank 0 makes it and the trainers' own
    process group carries it to the others (a collective: every rank
    constructs its optimizer at the same point, as with torch's
    ZeroRedundancyOptimizer)."""
    if not (torch.distributed.is_available() and
            torch.distributed.is_initialized()):
        raise ValueError(
            "gradient_sharding with world_size > 1 needs the job's ranks to "
            "share a job id: pass job_id= (the same on every rank) or "
            "initialize torch.distributed first")
    box = ["%s-%d-%s" % (socket.gethostname(), os.getpid(),
                         secrets.token_hex(4))]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _shared_nccl_id(mine):
    """Rank 0 sends `mine` (its daemon's NCCL unique id for the job); every
    other rank gets it (a collective, at optimizer construction)."""
    if not (torch.distributed.is_available() and
            torch.distributed.is_initialized()):
        raise ValueError(
            "gradient_sharding on CUDA with world_size > 1 needs "
            "torch.distributed initialized: the ranks' daemons join one NCCL "
            "communicator whose id the trainers' process group carries")
    box = [mine]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _close_session(client, job, rank):
    """Closes an optimizer's session and channel, and forgets its resume
    secret once the session is really closed (not when the daemon is gone
    or another trainer has taken the session over: a resume may still need
    it); at interpreter exit a daemon already gone is no error worth
    raising."""
    try:
        if client.token:
            client.close_session()
            _secrets.remove(job, rank)
    except errors.OptimdError:
        pass
    finally:
        client.close()


def _is_dtensor(p):
    return type(p).__name__ == "DTensor" or type(getattr(
        p, "data", None)).__name__ == "DTensor"


def _blob_tensor(t):
    dtype = _TORCH_DTYPES[t.dtype]
    if t.numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).clone()
