"""The machinery behind the optimd.torch optimizers: _DaemonOptimizer, a
torch.optim.Optimizer whose state lives in an optimd daemon session: the
session, the registration of parameter groups in memory the daemon reaches,
and the step. Its state dicts (_state_dicts.py) and checkpoints
(_checkpoints.py) are mixins of their own; the optimizers themselves are in
optimd/torch.py.
"""
import collections
import concurrent.futures
import inspect
import operator
import os
import secrets
import socket
import threading
import warnings
import weakref

import torch

from optimd import _secrets, cuda_ipc, errors
from optimd import _oom_release as oom_release
from optimd import _step_order as step_order
from optimd._aliased import (aliased, is_fsdp1, overlapping,
                             shm_handle)
from optimd._checkpoints import Checkpoints
from optimd._cuda_segment import CudaSegment
from optimd._dtensor import (any_sharded, check_mesh, is_dtensor, local_of,
                             shard_place)
from optimd._grads import (GradRouter, HandleCache, update_of,
                           zero_in_place)
from optimd._jobs import (check_fsdp1_job, close_session, dist_identity,
                          shared_job_id, shared_nccl_id, zero_sharding)
from optimd._layout import (alias_like, is_dense, keeps_layout,
                            memory_shape, overlaps_itself)
from optimd._names import ParamNames
from optimd._overlap import Overlap, assign_stages
from optimd._state import DTYPES, DaemonState, set_state_request
from optimd._state_dicts import StateDicts
from optimd._several_devices import (PartsState, SeveralDevices,
                                     become_several, check_several,
                                     held_state)
from optimd._step_flags import StepFlags
from optimd._vmm import VmmSharer, close_channels
from optimd._written import PendingWrites
from optimd.client import Client
from optimd.shm import SharedSegment, align
from optimd.v1 import optimd_pb2 as pb

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


# torch's switches between implementations of one step; optimd has its own,
# fused, which gives the same math as foreach and fused. Those that promise
# what a step in the daemon cannot do (captured in the trainer's CUDA graph,
# differentiated by autograd) are refused when asked for.
_IMPLEMENTATION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")
_REFUSED_OPTIONS = ("capturable", "differentiable")

# What torch.optim.Optimizer.zero_grad() does by default in the installed
# torch: set_to_none=True from torch 2.0, False before.
_TORCH_SET_TO_NONE = inspect.signature(
    torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default


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


def _nothing():
    pass


def _weakly(method):
    """`method` of an object, called without keeping the object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        if bound is None:
            raise ReferenceError("the optimizer this belonged to is gone")
        return bound(*args, **kwargs)
    return call


# Step replies a CUDA step() leaves unlooked-at; one more waits for the
# oldest (_DaemonOptimizer._look_at_replies).
_MAX_PENDING_REPLIES = 2

# Whether this process was told that torch's CUDA memory cannot be shared
# (_DaemonOptimizer._torch_memory_shareable): once, not per optimizer.
_SAID_UNSHAREABLE = False

_param_version = operator.attrgetter("param._version")


def _shard_of(p):
    """The tensor that holds a sharded parameter's values on this rank
    under a write count of its own: a DTensor's local shard (FSDP2 writes
    into it), FSDP1's local shard of a FlatParameter (its reshard and its
    state-dict loads copy into `_local_shard`, a `.data` alias); None for
    any other parameter."""
    if is_dtensor(p):
        return p._local_tensor
    return getattr(p, "_local_shard", None)


def _write_counts(plain, shards):
    """torch's counts of in-place writes of the entries' parameters: of
    `plain` ones (their views share the count), and of sharded ones, the
    parameter's count plus its shard's (_shard_of; a write through the
    parameter counts on it alone, the sharding's own writes into the shard
    on the shard alone)."""
    return list(map(_param_version, plain)) + [
        s.param._version + _shard_of(s.param)._version for s in shards]


class _TensorEntry:
    """Where one parameter lives in the group's shared segments. `param`
    is the parameter (the key of its state), `mem` the tensor whose memory
    holds its elements here (the parameter itself, or a DTensor's local
    shard: optimd/_dtensor.py); `pview` is what the daemon steps (`mem`'s
    view of the group's segment, or `mem` itself when registered in place)
    and `mirrored` says whether `mem` and `pview` are copied both ways
    around each step (a DTensor shard on the CPU). `in_place`: registered
    in its own memory (every CUDA parameter, or on the CPU memory other
    tensors share: optimd/_aliased.py), not in the group's segment."""

    __slots__ = ("param", "mem", "name", "numel", "pview", "gview",
                 "frozen", "group_id", "sent_ptr", "stage", "pflat",
                 "mirrored", "in_place", "keeps_grads")


def _storage_refusal(group, dtype, state_dtype_key):
    """Why the daemon would refuse a registration of a `dtype` parameter
    with `group`'s storage options (its rules, checked here before a group
    already registered is taken down for them), or None."""
    remainder = bool(group.get("store_param_remainders", False))
    master = group.get("master_weights")
    if remainder and dtype != torch.bfloat16:
        return "is %s: remainders (store_param_remainders) are for " \
            "bfloat16 parameters only" % dtype
    if dtype == torch.float64 and master:
        return "is float64: stepped in float64 in place, it takes no " \
            "master_weights"
    if dtype == torch.float64 and \
            group.get(state_dtype_key, torch.float32) is not torch.float32:
        return "is float64: its state stays float64, as in torch; " \
            "%s applies to other dtypes" % state_dtype_key
    if dtype in (torch.bfloat16, torch.float16) and master is False and \
            not remainder:
        return "is %s: it needs a master (master_weights None or True, " \
            "or store_param_remainders for bfloat16)" % dtype
    return None


class _DaemonOptimizer(StateDicts, Checkpoints, torch.optim.Optimizer):
    """What every optimd.torch optimizer shares: the daemon session, the
    parameters registered where it reaches them, gradients, steps, state and
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
               shard_state, names=None):
        """The shared part of construction, once the subclass has checked
        its arguments and made `defaults`. `names`: the parameters' names
        (ParamNames) when `params` come without them (the parts of an
        optimizer over several devices: _several_devices.py)."""
        keep_fp32 = list(keep_fp32)
        # Held while step() runs after the closure: an out-of-memory error
        # elsewhere releases nothing meanwhile (release_freed_gradients).
        self._step_lock = threading.Lock()
        # As given, for the parts should the parameters spread over devices.
        self._service = _service_options(locals())
        self._names = ParamNames() if names is None else names
        params = self._strip_names(params)
        self._ready = False
        self._sent_hyper = None  # the hyperparameters the daemon has
        self._groups = []  # per group: dict(id, tensors, segments, snapshot)
        # State of parameters taken out of their group, for their return,
        # and of lazy ones loaded before they are materialized:
        # id(param) -> (weak reference to it, its state).
        self._retired = {}
        torch.optim.Optimizer.__init__(self, params, defaults)
        # Weakly, as the stream-broken callback below: `del opt`
        # frees it (and closes its session) at once, as torch's is freed,
        # not at Python's next cyclic collection.
        self.state = DaemonState(_weakly(self._fetch_daemon_state),
                                 _weakly(self._retired_state))
        self.max_grad_norm = max_grad_norm
        self.grad_scale = grad_scale
        self.skip_nonfinite = skip_nonfinite
        self._keep_fp32 = {id(p) for p in keep_fp32}
        self.skipped = False
        self.grad_norm = None
        # CUDA: wait for each step on the daemon to report its own norm and
        # skipped flag (a host sync); otherwise they are of the last
        # completed step.
        self.wait_for_step = False
        keys = self._part_keys()
        if len(keys) > 1:
            # One part per device, each with its session.
            check_several(self, self._service, keys)
            become_several(self, self._service)
            return
        self._device = self._check_devices()
        self._identity = self._job_identity(
            address=address, job_id=job_id, rank=rank, world_size=world_size,
            max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
            overlap=overlap, timeout=timeout,
            gradient_sharding=gradient_sharding, shard_state=shard_state)
        self._open(resume, resume_secret)

    def _job_identity(self, *, address, job_id, rank, world_size,
                      max_grad_norm, skip_nonfinite, overlap, timeout,
                      gradient_sharding, shard_state):
        """The session's identity (address, job, rank, sharding, ...) from
        the constructor's options and the process group, checked."""
        # One session per optimizer object: two optimizers of one process
        # (a GAN, a notebook cell run twice) never collide. resume=True
        # needs the job id of the session to take over.
        if gradient_sharding not in _SHARDING:
            raise ValueError("gradient_sharding must be None, 'replicated' or "
                             "'sharded', not %r" % (gradient_sharding,))
        rank, world_size = dist_identity(rank, world_size)
        self._world_size = world_size
        if gradient_sharding is None and world_size > 1 and any_sharded(
                p for g in self.param_groups for p in g["params"]):
            # FSDP2: each rank holds a shard of every gradient, so the
            # norm to clip by and the skip are the job's.
            gradient_sharding = "sharded"
        gradient_sharding = zero_sharding(shard_state, gradient_sharding,
                                           world_size)
        check_fsdp1_job(any(is_fsdp1(p) for g in self.param_groups
                            for p in g["params"]),
                        world_size, gradient_sharding is not None,
                        bool(max_grad_norm or skip_nonfinite))
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
            job_id = shared_job_id()
        job = job_id or "%s-%d-%s" % (socket.gethostname(), os.getpid(),
                                      secrets.token_hex(4))
        if gradient_sharding is not None:
            # A step may wait for the other ranks up to the daemon's
            # --rank_timeout_s (600 s by default): the call must outlast it.
            timeout = max(timeout, 900.0)
        return dict(address=address, timeout=timeout, job=job,
                    rank=rank, world_size=world_size, overlap=overlap,
                    sharding=_SHARDING[gradient_sharding],
                    shard_state=self._shard_state)

    # Whether sparse gradients are stepped (as their dense equivalent), as
    # torch's SGD steps them; torch's Adam and AdamW raise.
    _takes_sparse_grads = False
    # Whether a registered parameter is FSDP1's (_index_buffers).
    _any_fsdp1 = False
    # Whether the optimizer's state may be block8 (AdamW only).
    _takes_block8 = False
    # Whether a loaded entry with state must hold every slot (torch's Adam
    # and AdamW fail on a missing one; its SGD starts a missing momentum
    # buffer from the gradient).
    _every_slot_needed = True
    # Whether its state entries hold a step count (torch's Adam and AdamW
    # read it at every step; Lion keeps none).
    _counts_steps = True
    # Whether it steps float64 parameters (the daemon's kernels for it take
    # the float64 layout; a subclass whose kernels do not leaves it False,
    # and float64 parameters raise TypeError before the daemon is asked).
    _takes_float64 = False

    @classmethod
    def _check_options(cls, torch_options, state_dtype, amsgrad=False):
        if isinstance(state_dtype, str) and state_dtype == BLOCK8:
            if not cls._takes_block8:
                raise ValueError(
                    "optimd.torch.%s: block8 state is for AdamW/Adam "
                    "moments only; use torch.float32 or torch.bfloat16"
                    % cls.__name__)
            if amsgrad:
                raise ValueError(
                    "amsgrad needs torch.float32 or torch.bfloat16 moments, "
                    "not block8 (its running maximum has no 8-bit form)")
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
        # Only what the installed torch's own class takes: a misspelt
        # keyword, or a switch this torch does not have (SGD's fused on
        # torch 1.13), is a TypeError, as in torch, never an ignored group
        # key. Lion, which torch lacks, takes every switch.
        if cls._torch_class is not None:
            known = set(_torch_defaults(cls._torch_class))
        else:
            known = set(_IMPLEMENTATION_OPTIONS)
        for k in sorted(set(torch_options) - known):
            raise TypeError("%s.__init__() got an unexpected keyword "
                            "argument %r" % (cls.__name__, k))
        for k, v in torch_options.items():
            if k in _REFUSED_OPTIONS and v:
                raise ValueError("optimd.torch.%s runs its own fused step; "
                                 "%s=%r is not supported" %
                                 (cls.__name__, k, v))

    def _storage_of(self, group):
        """A group's storage options, part of _layout_of: fixed by its
        registration, so an edit of one in param_groups registers the group
        anew with its state converted, as loading the state dict into an
        optimizer made with the new options would convert it."""
        return dict(master_weights=group.get("master_weights"),
                    store_param_remainders=bool(
                        group.get("store_param_remainders", False)),
                    state_dtype=group.get(self._state_dtype_key,
                                          torch.float32))

    def _check_storage(self, gi, group):
        """Raises, before anything changes, for storage options in
        param_groups[gi] that no registration takes (an edit, or a loaded
        group)."""
        key = self._state_dtype_key
        try:
            self._check_options({}, group.get(key, torch.float32),
                                group.get("amsgrad"))
        except (TypeError, ValueError) as err:
            raise type(err)("param_groups[%d][%r]: %s" % (gi, key, err)) \
                from None
        if group.get("master_weights") not in (None, True, False):
            raise TypeError(
                "param_groups[%d]['master_weights'] must be None, True or "
                "False, not %r" % (gi, group.get("master_weights")))
        if gi < len(self._groups):
            for s in self._groups[gi]["tensors"]:
                refusal = _storage_refusal(group, s.mem.dtype, key)
                if refusal:
                    raise ValueError("param_groups[%d]: %s %s" %
                                     (gi, s.name, refusal))

    def _open(self, resume, resume_secret):
        """Opens (or resumes) the session on self._device and registers
        every group."""
        ident = self._identity
        job, rank = ident["job"], ident["rank"]
        self._client = Client(ident["address"], timeout=ident["timeout"])
        if self._device.type == "cuda":
            self._client.before_trainer_memory = self._trainer_stream_done
        # Weakly: the client must not keep its optimizer alive (its calls
        # after the optimizer is gone, closing the session, tell nothing).
        tell = weakref.WeakMethod(self._send_written_params)
        self._client.before_other_call = lambda: (tell() or _nothing)()
        # CUDA: the trainer's stream and the daemon's are ordered by step
        # flags (_step_flags.py), so step() never waits for the daemon.
        self._flags = None
        self._overlap = None
        self._pending = collections.deque()  # replies not yet looked at
        if self._device.type == "cuda":
            self._flags = StepFlags(self._device)
            oom_release.watch(self)
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
        nccl_id = shared_nccl_id(None) if nccl_job and rank != 0 else b""
        reply = self._client.create_session(
            job, rank=rank, world_size=ident["world_size"],
            device=-1 if self._device.type == "cpu" else self._device.index,
            resume=bool(resume), resume_secret=resume_secret or "",
            gradient_sharding=ident["sharding"], nccl_unique_id=nccl_id,
            shard_state=ident["shard_state"])
        if nccl_job and rank == 0:
            shared_nccl_id(reply.nccl_unique_id)
        self.resumed = reply.resumed
        # What a restarted trainer must present to resume this session.
        self.resume_secret = reply.resume_secret
        _secrets.store(job, rank, reply.resume_secret)
        self._closer = weakref.finalize(self, close_session, self._client,
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

    def _part_key(self, p):
        """What an optimizer over several devices splits its parameters by,
        one part (and session) per key (_several_devices.py): their
        device."""
        return p.device

    def _part_label(self, key):
        """A part's key as its job-id suffix and checkpoint folder: "cpu",
        "cuda0"."""
        return key.type + ("" if key.index is None else str(key.index))

    def _part_keys(self):
        """The part keys (devices) of the parameters of param_groups."""
        return {self._part_key(p) for g in self.param_groups
                for p in g["params"]}

    def _check_devices(self):
        """The one device of every parameter (they are on one)."""
        device = next((p.device for g in self.param_groups
                       for p in g["params"]), torch.device("cpu"))
        if device.type not in ("cpu", "cuda"):
            raise ValueError("optimd.torch supports CPU and CUDA "
                             "parameters, not %s" % device)
        return device

    def add_param_group(self, param_group):
        if self._ready and len(self._groups) != len(self.param_groups):
            # Groups taken out since the last step: the daemon's first.
            self._sync_structure()
            if isinstance(self, SeveralDevices):
                return self.add_param_group(param_group)
        if isinstance(param_group, dict):
            param_group = self._names.strip_group(param_group)
        super().add_param_group(param_group)
        if self._ready:
            gi = len(self.param_groups) - 1
            try:
                if len(self._part_keys()) > 1:
                    self._spread()
                    return
                self._check_devices()
                self._register_group(gi, self.param_groups[gi],
                                     existing=False)
                self._restore_retired(gi)
            except BaseException:
                # Refused: the optimizer stays as it was, no group half
                # added (one in param_groups that the daemon never steps).
                self.param_groups.pop()
                if isinstance(self, SeveralDevices):
                    # Refused while spreading over devices: its parts
                    # made over the groups as they were, the state kept.
                    self._rebuild_quietly()
                raise

    def _restore_retired(self, gi):
        """Group `gi`, just registered: parameters taken out of a group
        before get their state back, as torch's state keeps it."""
        g = self._groups[gi]
        entries = [self._take_retired(s.param) for s in g["tensors"]]
        if any(e is not None for e in entries):
            self._client.set_state(set_state_request(
                g["id"], g["tensors"], entries,
                slot_names=self._slot_names(self.param_groups[gi])))
            self.state.invalidate()

    def _reconcile_group(self, gi, group):
        """Brings keys of param_groups[gi] that mean one thing into
        agreement after an edit (an optimizer with such keys overrides
        this)."""

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
                                    param_dtype=DTYPES[s.mem.dtype],
                                    keep_fp32=id(s.param) in self._keep_fp32,
                                    frozen=s.frozen,
                                    shape=memory_shape(s.mem),
                                    stage=s.stage,
                                    aliases=self._names.aliases_of(s.param))
            place = None if keeps_layout(s.mem) else shard_place(s.param,
                                                                 s.mem)
            if place is not None:
                t.global_shape.extend(place[0])
                t.global_offset.extend(place[1])
            if not s.frozen:
                # Steps tell the daemon where gradients are (_grads.py).
                t.grad_dtype = DTYPES[s.mem.dtype]
                t.grad_absent = True
            if s.numel and s.in_place:
                t.param.CopyFrom(self._in_place_handle(s))
            elif s.numel:
                nbytes = s.numel * s.mem.element_size()
                t.param.CopyFrom(seg_p.handle(p_off, nbytes))
        return request

    def _in_place(self):
        """Whether DTensor shards are registered where they are (CUDA,
        where CUDA IPC can export torch's memory) rather than mirrored in
        memory the daemon reaches (CPU shared memory; CUDA buffers of the
        optimizer's own)."""
        return self._device.type == "cuda" and self._torch_memory_shareable()

    def _torch_memory_shareable(self):
        """CUDA: whether the daemon can reach torch's allocations where
        they are: by CUDA IPC, or under
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True chunk by chunk
        over the daemon's descriptor socket (_vmm.py). Where neither can
        (cudaMallocAsync's pool; a daemon on TCP), parameters move into the
        optimizer's own buffers (DTensor shards are copied there and back
        around each step) and gradients are copied into them at each step,
        at the cost of those copies; said once."""
        global _SAID_UNSHAREABLE
        shareable = cuda_ipc.torch_memory_shareable(self._device) or \
            self._vmm_sharer() is not None
        if not shareable and not _SAID_UNSHAREABLE:
            _SAID_UNSHAREABLE = True
            warnings.warn(
                "optimd.torch: the daemon cannot reach torch's allocations "
                "here (CUDA IPC cannot share them, as under "
                "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, or "
                "expandable_segments:True with a daemon on TCP or without "
                "a descriptor socket); "
                "parameters move into the optimizer's own buffers and "
                "gradients are copied there at each step, so CUDA graphs "
                "captured before the optimizer was made do not see its "
                "steps, and each step copies every gradient once")
        return shareable

    def _in_place_handle(self, s):
        """The handle of a tensor registered in its own memory: its CUDA
        allocation, or (CPU) its storage's named shared-memory file."""
        if self._device.type == "cuda":
            return self._param_handles.handle(s.mem)
        return shm_handle(s.mem, s.name)

    def _shared_memory_params(self):
        """The ids of the parameters to register where they are: on CUDA
        every one (by its allocation's IPC handle), so that whatever holds
        a parameter's address rather than the tensor (a CUDA graph captured
        before the optimizer was made) sees each step, as with torch; on
        the CPU those whose memory other tensors share (optimd/_aliased.py).
        Those registered before keep where they were registered."""
        registered = {id(s.param): s.in_place
                      for g in self._groups for s in g["tensors"]}
        fresh = [p for g in self.param_groups for p in g["params"]
                 if id(p) not in registered and not _is_lazy(p) and
                 not is_dtensor(p)]
        kept = {i for i, was in registered.items() if was}
        if self._device.type == "cuda":
            return {id(p) for p in fresh if self._exportable(p)} | kept
        return aliased(fresh) | kept

    def _exportable(self, p):
        """Whether CUDA IPC can export the allocation of parameter p (not
        memory of a pluggable allocator or another library's pool). One
        it cannot is moved into its group's buffer, as before this
        registered CUDA parameters where they are, with a warning: graphs
        captured before the optimizer then miss its steps. An empty one
        has no memory to export and none to move."""
        if p.numel() == 0:
            return True
        if not self._torch_memory_shareable():
            return False  # said once, for every parameter
        try:
            self._param_handles.handle(local_of(p))
            return True
        except RuntimeError as e:
            warnings.warn(
                "optimd.torch: parameter %s is in CUDA memory that CUDA IPC "
                "cannot share (%s); it moves into the optimizer's own "
                "buffer, so CUDA graphs captured before the optimizer was "
                "made do not see its steps" % (
                    self._names.get(id(p), "of shape %s" % (tuple(p.shape),)),
                    e))
            return False

    @property
    def _param_handles(self):
        """CUDA IPC handles of the allocations of parameters registered in
        place, made on first use."""
        vmm = self._vmm_sharer()
        cache = getattr(self, "_param_handle_cache", None)
        if cache is None or cache.vmm is not vmm:
            self._param_handle_cache = HandleCache(vmm)
        return self._param_handle_cache

    def _vmm_sharer(self):
        """Where CUDA IPC cannot export torch's memory (expandable
        segments), what shares it with the daemon chunk by chunk
        (_vmm.py), or None; made once per device the optimizer is on."""
        if getattr(self, "_vmm_device", None) != self._device:
            self._close_vmm()
            self._vmm_device = self._device
            if self._device.type == "cuda" and \
                    not cuda_ipc.torch_memory_shareable(self._device):
                self._vmm = VmmSharer.open(self._client.address,
                                           self._device)
        return self._vmm

    def _close_vmm(self):
        if getattr(self, "_vmm", None) is not None:
            self._vmm.close()
        self._vmm = None
        self._vmm_device = None

    def _refuse_sharded_options(self, name, p):
        """Options that FSDP's parameters (p: FSDP2's DTensor, or FSDP
        version 1's) do not take, refused by name: shard_state would write
        one rank's part over the other ranks' different shards, and
        overlap's hooks cannot hold back FSDP's own all-gathers."""
        kind, fsdp = ("DTensor", "FSDP2") if is_dtensor(p) else \
            ("FSDP version 1", "FSDP1")
        for option, on in (("overlap", self._identity["overlap"]),
                           ("shard_state", self._shard_state)):
            if on:
                raise NotImplementedError(
                    "optimd.torch: %s=True does not take %s parameters "
                    "(parameter %s): %s shards the parameters and "
                    "gathers them itself" % (option, kind, name, fsdp))

    def _register_group(self, gi, group, existing, replace=False):
        self._check_group(gi, group)
        tensors = []
        p_bytes = 0
        shared = self._shared_memory_params()
        for pi, p in enumerate(group["params"]):
            if _is_lazy(p):
                # Not materialized yet (a lazy module before its first
                # forward): absent, without state, as torch has it, until
                # _sync_structure finds it materialized.
                continue
            s = _TensorEntry()
            s.param = p
            s.mem = local_of(p)
            s.name = self._names.get(id(p), "group%d.param%d" % (gi, pi))
            s.numel = s.mem.numel()
            # torch steps every parameter with a gradient, one set by hand
            # on a parameter that requires none included.
            s.frozen = not p.requires_grad and p.grad is None
            s.group_id = str(gi)
            s.gview = None
            s.keeps_grads = False  # optimd/_grads.py, _renew_held
            s.sent_ptr = 0
            # A view with gaps (base[:, ::2]) is stepped in a dense copy in
            # the group's segment, copied both ways around each step.
            gappy = _gappy(p)
            s.mirrored = (is_dtensor(p) and not self._in_place()) or gappy
            s.in_place = (is_dtensor(p) and self._in_place()) or \
                (id(p) in shared and not gappy)
            tensors.append((s, p_bytes))
            if not s.in_place:
                p_bytes += align(s.numel * s.mem.element_size())
        if self._device.type == "cuda":
            seg_p = CudaSegment(max(p_bytes, 64), self._device)
        else:
            seg_p = SharedSegment(max(p_bytes, 64))
        for s, p_off in tensors:
            self._home_param(s, seg_p, p_off)
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
                 slots=self._slot_names(group),
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

    def _home_param(self, s, seg_p, p_off):
        """Puts tensor `s` where the daemon steps it: its own memory where
        it is registered in place (every exportable CUDA parameter, or CPU
        memory other tensors share); a DTensor's shard in FSDP2's memory
        (in place, or mirrored); otherwise its view of the group's segment,
        which becomes the parameter's memory."""
        if is_dtensor(s.param) and self._in_place():
            s.pview = s.mem
            s.pflat = _flat_or_none(s.mem)
            return
        if s.in_place:
            # Memory other tensors share: stepped where it is. A tensor of
            # its own over it, so that `p.data = other` shows as a move.
            s.pview = s.mem.detach()
            s.pflat = _flat_or_none(s.pview)
            return
        s.pflat = seg_p.tensor(p_off, s.numel, s.mem.dtype)
        s.pview = alias_like(s.pflat, s.mem)
        s.pview.copy_(s.mem.detach())
        if not s.mirrored:
            s.param.data = s.pview

    def _mirror_in(self):
        """Mirrored parameters (DTensor shards on the CPU, views with gaps)
        into the memory the daemon steps."""
        for s in self._mirrored:
            s.pview.copy_(s.mem)

    def _mirror_out(self):
        """What the daemon wrote into the memory it steps back into the
        mirrored parameters (DTensor shards on the CPU, views with gaps)
        after a step, a resume, a load."""
        before = [s.mem._version for s in self._mirrored]
        for s in self._mirrored:
            s.mem.copy_(s.pview)
        self._forget_own_writes(self._mirrored, before)

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
            if is_dtensor(p):
                check_mesh(p, name, self._world_size)
            if is_dtensor(p) or is_fsdp1(p):
                self._refuse_sharded_options(name, p)
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
            if p.numel() and overlaps_itself(local_of(p)):
                raise _overlapping_error(name, local_of(p))
            if is_dtensor(p) and p.numel() and not is_dense(local_of(p)):
                raise _not_dense_error(name, local_of(p))
        if self._identity["overlap"] and self._device.type == "cuda":
            self._refuse_overlapping_memory()
            self._refuse_gappy(group)

    def _refuse_gappy(self, group):
        """overlap=True releases parameters stage by stage on the GPU; a
        parameter with gaps in its memory is stepped in a dense copy,
        copied back after the whole step, so it is refused, naming it."""
        for p in group["params"]:
            if _gappy(p):
                raise NotImplementedError(
                    "optimd.torch: overlap=True does not take parameter %s "
                    "(shape %s, strides %s), which has gaps in its memory; "
                    "make it contiguous or use overlap=False" % (
                        self._names.get(id(p), "?"), tuple(p.shape),
                        p.stride()))

    def _refuse_overlapping_memory(self):
        """overlap=True updates stage by stage, in the order of the next
        forward; parameters over one memory (tied by `v.data = w.data`) must
        be updated one after the other, as torch steps them, so they are
        refused here, naming them."""
        params = [p for g in self.param_groups for p in g["params"]
                  if not _is_lazy(p) and not is_dtensor(p)]
        tied = overlapping(params)
        if tied:
            raise NotImplementedError(
                "optimd.torch: overlap=True does not take parameters over "
                "one memory (%s: tied by .data?); tie them as one Parameter "
                "(v = w) or use overlap=False" % ", ".join(
                    self._names.get(id(p), "a parameter") for p in tied[:4]))

    def _flat_grads(self, group_id, renew=False):
        """The group's flat gradient segment, made on first use, with a
        view per steppable tensor (CPU: where gradients are copied for the
        daemon; both: where zero_grad(set_to_none=False) puts them). With
        `renew`, a new one: a view of the old is the trainer's now (a
        gradient it kept), whose values must stay."""
        g = self._groups[int(group_id)]
        if renew:
            g["segments"][1] = None
        if g["segments"][1] is not None:
            return g["segments"][1]
        offsets, g_bytes = [], 0
        for s in g["tensors"]:
            offsets.append(g_bytes)
            if not s.frozen:
                g_bytes += align(s.numel * s.mem.element_size())
        if self._device.type == "cuda":
            seg_g = CudaSegment(max(g_bytes, 64), self._device)
        else:
            seg_g = SharedSegment(max(g_bytes, 64))
        for s, off in zip(g["tensors"], offsets):
            if not s.frozen:
                s.gview = alias_like(
                    seg_g.tensor(off, s.numel, s.mem.dtype), s.mem)
        g["segments"][1] = seg_g
        return seg_g

    def _trainer_stream_done(self):
        """CUDA: waits for the work queued on the trainer's stream, before a
        call in which the daemon reads or writes the parameters outside a
        step, on its own stream (Client.before_trainer_memory). Torch's
        stream order would give that: the daemon reads what the trainer
        wrote (the copy into the parameter's new memory at registration,
        an in-place edit before a save), and what it writes (a load, a
        resume) is not overwritten by trainer work queued before."""
        torch.cuda.current_stream(self._device).synchronize()

    def _restore_after_resume(self):
        """A restarted trainer: write the daemon's weights into our buffers."""
        try:
            self._client.get_params()
            self._mirror_out()
        except errors.FailedPreconditionError:
            # Remainder layouts: the bf16 half lived in the dead trainer.
            pass

    # The step.
    def _index_buffers(self):
        """Flat lists for the per-step check that nothing moved."""
        # The entries re-homed into our segments (not DTensor shards nor
        # mirrored ones).
        self._homed = [s for g in self._groups for s in g["tensors"]
                       if s.numel and not is_dtensor(s.param) and
                       not s.mirrored]
        self._params_flat = [s.param for s in self._homed]
        # Whether a step must check FSDP1's job options (check_fsdp1_job).
        self._any_fsdp1 = any(map(is_fsdp1, self._params_flat))
        self._pptrs_flat = [s.pview.data_ptr() for s in self._homed]
        self._watch_written_params()
        self._dtensors = [s for g in self._groups for s in g["tensors"]
                          if s.numel and is_dtensor(s.param)]
        self._mirrored = [s for g in self._groups for s in g["tensors"]
                          if s.numel and s.mirrored]
        self._router = GradRouter(
            [s for g in self._groups for s in g["tensors"]], self._device,
            _weakly(self._flat_grads), densify=self._takes_sparse_grads,
            copies=self._device.type == "cpu" or not self._in_place(),
            vmm=self._vmm_sharer())

    def _watch_written_params(self):
        """The parameters whose values the daemon keeps in an fp32 master
        (bf16 and fp16 ones, and any of a group with master_weights=True;
        a remainder layout's too, whose written zeros and infinities need
        their remainders cleared), DTensor shards and mirrored ones
        included, and their write counts now: a write into
        one after this (a weight load, an in-place edit; not through
        `.data`, which torch does not count) is told to the daemon at the
        next step (_follow_written_params)."""
        masters = {g["id"] for g, group in zip(self._groups, self.param_groups)
                   if group.get("master_weights")}
        watched = [s for g in self._groups for s in g["tensors"]
                   if s.numel and
                   (s.mem.dtype in (torch.bfloat16, torch.float16)
                    or s.group_id in masters)]
        self._watched_plain = [s for s in watched
                               if _shard_of(s.param) is None]
        self._watched_shards = [s for s in watched
                                if _shard_of(s.param) is not None]
        self._watched = self._watched_plain + self._watched_shards
        self._watch_index = {id(s): i for i, s in enumerate(self._watched)}
        # Parameters watched before keep their count (a write made before
        # this call is still to be told); new ones start now.
        seen = dict(zip(map(id, getattr(self, "_watched_before", ())),
                        getattr(self, "_versions", ())))
        self._versions = [seen.get(id(s), now) for s, now in zip(
            self._watched, self._write_counts())]
        self._watched_before = self._watched

    def _write_counts(self):
        """The watched parameters' write counts now (_write_counts)."""
        return _write_counts(getattr(self, "_watched_plain", ()),
                             getattr(self, "_watched_shards", ()))

    def _follow_written_params(self):
        """Tells the daemon which watched parameters were written since
        the last step (their write counts moved): each element the
        trainer changed becomes its master's value, as torch steps from
        the written tensor (UpdateBuffers' param_written; on CUDA after
        the trainer's stream, which the call waits for). A mirrored one
        is copied into the memory the daemon reads first."""
        self._written_unsent.add(self._newly_written_params())
        self._send_written_params()

    def _newly_written_params(self):
        """The watched parameters written since the last look (their
        write counts moved), mirrored ones copied into the memory the
        daemon reads (on the trainer's stream); to be told."""
        if not getattr(self, "_watched", None):
            return []
        # A DTensor given a new local shard (FSDP2 re-pads uneven shards
        # at its lazy init) is watched, and mirrored, from the new one on.
        swapped = self._follow_dtensor_shards()
        versions = self._write_counts()
        if versions == self._versions and not swapped:
            return []
        written = [s for s, now, then in zip(
            self._watched, versions, self._versions)
            if now != then or id(s) in swapped]
        for s in written:
            if s.mirrored:
                s.pview.copy_(s.mem)
        self._versions = versions
        return written

    @property
    def _written_unsent(self):
        """Parameters written and not yet told (_written.py): a step
        carries them (_with_written); any other call of the daemon's tells
        them first (Client.before_other_call)."""
        if "_unsent_writes" not in self.__dict__:
            self._unsent_writes = PendingWrites()
        return self._unsent_writes

    def _send_written_params(self):
        """Tells the daemon now of the writes no step carried."""
        written = self._written_unsent.take()
        if written:
            try:
                self._tell_written(written)
            except BaseException:
                self._written_unsent.put_back(written)
                raise

    def _retell_writes(self):
        """A step failed, maybe before the daemon took its updates: every
        watched parameter is told as written with the next step (an
        unwritten one changes nothing: its parameter is its master's
        rounding)."""
        self._written_unsent.add(getattr(self, "_watched", ()))

    def _with_written(self, updates, written):
        """The step's buffer updates `updates` (the router's) with the
        writes `written` told too (param_written, in the entry of the
        tensor's group, and on the tensor's own entry if it has one): the
        daemon adopts them once the trainer's stream reaches the step, so
        no wait for that stream here."""
        by_group = {u.group_id: u for u in updates}
        for s in written:
            if s.group_id not in by_group:
                by_group[s.group_id] = update_of(by_group, s)
                updates.append(by_group[s.group_id])
            update = by_group[s.group_id]
            for t in update.tensors:
                if t.name == s.name:
                    t.param_written = True
                    break
            else:
                update.tensors.add(name=s.name, param_written=True)
        return updates

    def _forget_own_writes(self, entries, counts_before):
        """Copies of the daemon's values into `entries` (mirrors) are no
        writes of the trainer's: their recorded counts move with them."""
        index = getattr(self, "_watch_index", {})
        for s, before in zip(entries, counts_before):
            i = index.get(id(s))
            if i is not None:
                self._versions[i] += s.mem._version - before

    def _sync_structure(self):
        """A group whose parameters were added or removed since it was
        registered (param_groups[i]["params"] edited), or which has a
        parameter frozen then and trained now, or a lazy one materialized
        since, is registered anew over its current parameters, keeping the
        state of those it had (torch picks such changes up at its next
        step)."""
        changed = [gi for gi, (g, group) in
                   enumerate(zip(self._groups, self.param_groups))
                   if _changed_since_registered(g, group)]
        if changed or len(self._groups) < len(self.param_groups):
            self._refuse_parameters_in_two_groups()
        for gi in changed:
            g, group = self._groups[gi], self.param_groups[gi]
            if self._followed_elsewhere():
                return
            self._refuse_with_shard_state(
                "adding, removing, unfreezing or materializing parameters "
                "of param_groups[%d]" % gi)
            self._check_group(gi, group)  # before it is unregistered
            state = self._fetch_state()
            self._retire(g, state, {id(p) for p in group["params"]})
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
        if len(self._groups) > len(self.param_groups):
            self._drop_removed_groups()
        elif len(self._groups) < len(self.param_groups):
            self._register_added_groups()

    def _refuse_parameters_in_two_groups(self):
        """A parameter put into a second group by an edit of param_groups
        raises torch's ValueError, as torch's constructor and
        add_param_group raise for it; torch's step would update it once per
        group, the daemon keeps one state per tensor. Before anything of
        the edit is followed, so the optimizer stays as it was."""
        seen = set()
        for group in self.param_groups:
            ids = set(map(id, group["params"]))
            if not seen.isdisjoint(ids):
                raise ValueError(
                    "some parameters appear in more than one parameter "
                    "group: param_groups was edited so that a parameter is "
                    "in two groups; torch steps it once per group, "
                    "optimd.torch refuses: take it out of one of them")
            seen |= ids

    def _followed_elsewhere(self):
        """Whether param_groups now hold parameters on other devices, which
        the optimizer then followed, registering every group anew: spread
        over several devices (a part each), or its session moved to the
        one device they are all on now (accelerate's prepare() with FSDP2
        puts DTensors on the GPU into param_groups)."""
        if len(self._part_keys()) > 1:
            self._spread()
            return True
        device = self._check_devices()
        if device != self._device:
            self._reopen({device})
            return True
        return False

    def _register_added_groups(self):
        """Groups put into param_groups by the trainer itself (appended or
        inserted, not through add_param_group) are stepped from now on,
        as torch steps every group of param_groups; a parameter of theirs
        taken out of another group keeps its state. A group without a
        hyperparameter raises KeyError, as torch's step does."""
        for gi in range(len(self._groups), len(self.param_groups)):
            if self._followed_elsewhere():
                return
            self._refuse_with_shard_state("adding param_groups")
            self._register_group(gi, self.param_groups[gi], existing=False)
            self._restore_retired(gi)
        self._sent_hyper = None
        self.state.invalidate()

    def _drop_removed_groups(self):
        """Groups taken out of param_groups (`del opt.param_groups[i]`) are
        no longer stepped, as in torch; their parameters in no group now
        keep their state for a return."""
        self._refuse_with_shard_state("removing param_groups")
        state = self._fetch_state()
        current = {id(p) for g in self.param_groups for p in g["params"]}
        for g in self._groups[len(self.param_groups):]:
            self._retire(g, state, current)
            self._client.unregister_group(g["id"])
        del self._groups[len(self.param_groups):]
        self._sent_hyper = None
        self._index_buffers()
        self.state.invalidate()

    def _retire(self, g, state, kept):
        """The parameters of registration `g` not in `kept` (ids) keep
        their state (from `state`) for a return, as in torch (whose state
        is keyed by the parameter). One registered in another group (moved
        into a group registered anew before this one) is not kept: its
        state lives there, and a copy kept here would later stand in for
        it, stale (in state_dict(), and in the next registration anew)."""
        elsewhere = {id(s.param) for other in self._groups
                     if other is not g for s in other["tensors"]}
        for s in g["tensors"]:
            if id(s.param) not in kept and id(s.param) not in elsewhere \
                    and s.param in state:
                self._retired[id(s.param)] = (weakref.ref(s.param),
                                              state[s.param])

    def _sync_params(self, follow_layout=True):
        """Follows parameters moved, swapped or resharded since the last
        call and, with `follow_layout`, layout keys edited in param_groups
        (a step's; state_dict() and load_state_dict() leave those to the
        next step, as torch's take effect only in its step, so that a
        refused edit does not block a load that replaces it)."""
        for gi, (g, group) in enumerate(zip(self._groups,
                                            self.param_groups)):
            self._reconcile_group(gi, group)
            if follow_layout and self._layout_of(group) != g["snapshot"]:
                self._follow_layout_keys(gi, group, g)
        self._follow_dtensor_shards()
        # map() keeps this at well under a microsecond per parameter.
        if list(map(torch.Tensor.data_ptr, self._params_flat)) == \
                self._pptrs_flat:
            return
        devices = {p.device for p in self._params_flat}
        if devices and devices != {self._device}:
            self._reopen(devices)
            return
        self._follow_swapped_storages()
        moved = [s for s in self._homed
                 if s.param.data_ptr() != s.pview.data_ptr()]
        for s in moved:
            if is_fsdp1(s.param):
                # Taken over by FSDP1 since registration: its flat buffer
                # holds the values from now on, stepped where they are.
                self._refuse_sharded_options(s.name, s.param)
                s.in_place = True
        if any(s.param.dtype != s.pview.dtype and s.param.dtype in DTYPES and
               s.param.shape == s.pview.shape for s in moved):
            # model.half(), .bfloat16() or .double() after construction:
            # followed (registered anew in the new dtype, the state carried
            # over and cast to it, as torch's load_state_dict casts state).
            for gi, group in enumerate(self.param_groups):
                self._check_group(gi, group)  # before the session closes
            self._reopen({self._device})
            return
        self._follow_moved_in_place([s for s in moved if s.in_place])
        for s in [s for s in moved if not s.in_place]:
            p = s.param
            if p.dtype != s.pview.dtype or p.shape != s.pview.shape:
                # A dtype the daemon does not step, or a new shape: we
                # cannot go on silently.
                raise errors.ParameterChangedError(
                    "parameter %s is now %s %s; it was registered as %s %s. "
                    "Convert the model before creating the optimizer (or "
                    "create a new one)" % (
                        s.name, p.dtype, tuple(p.shape), s.pview.dtype,
                        tuple(s.pview.shape)))
            if not is_dense(p):  # p.data = a view with gaps
                raise _not_dense_error(s.name, p)
            s.pview.copy_(p.detach())
            p.data = s.pview
        self._tell_written([s for s in moved if not s.in_place])

    def _tell_written(self, entries):
        """Tells the daemon that the trainer wrote the parameters of
        `entries` (UpdateBuffers' param_written): the elements it changed
        become their masters' values."""
        by_group = {}
        for s in entries:
            update_of(by_group, s).tensors.add(name=s.name,
                                               param_written=True)
        for update in by_group.values():
            self._client.update_buffers(update)

    def _follow_moved_in_place(self, moved):
        """Parameters registered where they are and given other memory
        since (`p.data = t`): stepped where they are now, as torch steps
        them (the memory they left is the trainer's, left alone)."""
        if not moved:
            return
        # A staged step may still write the memory they left, whose last
        # reference the entries below let go.
        self._finish_overlap()
        for s in moved:
            p = s.param
            if is_fsdp1(p) and p.shape != s.pview.shape:
                raise errors.ParameterChangedError(
                    "parameter %s is now %s, a part of FSDP version 1's "
                    "shard of this rank; it was registered as %s before "
                    "FSDP sharded it. Make the optimizer after wrapping "
                    "the model (as FSDP's guide does), over the wrapped "
                    "model's parameters" % (
                        s.name, tuple(p.shape), tuple(s.pview.shape)))
            # Its state lies in the registered memory order: memory in
            # another order would take each element's moments from another.
            if p.dtype != s.pview.dtype or p.shape != s.pview.shape or \
                    not is_dense(p) or not _same_order(p, s.pview):
                raise errors.ParameterChangedError(
                    "parameter %s is now %s %s with strides %s; it was "
                    "registered as %s %s with strides %s. Create a new "
                    "optimizer for it" % (
                        s.name, p.dtype, tuple(p.shape), p.stride(),
                        s.pview.dtype, tuple(s.pview.shape),
                        s.pview.stride()))
        # Update passes of parameters over one memory are planned at
        # registration: one moved onto another's memory is refused.
        tied = {id(p) for p in overlapping(
            [s.param for s in self._homed if not is_dtensor(s.param)])}
        for s in moved:
            if id(s.param) in tied:
                raise errors.ParameterChangedError(
                    "parameter %s now shares memory with another parameter "
                    "(tied by `.data` after the optimizer was made); tie "
                    "weights before making the optimizer, or make a new "
                    "one" % s.name)
        by_group = {}
        for s in moved:
            s.mem = local_of(s.param)
            s.pview = s.mem.detach()
            s.pflat = _flat_or_none(s.pview)
            update = update_of(by_group, s)
            # New memory holds the trainer's values: masters follow them.
            update.tensors.add(name=s.name, param=self._in_place_handle(s),
                               param_written=True)
        for update in by_group.values():
            self._client.update_buffers(update)
        self._index_buffers()

    def _follow_swapped_storages(self):
        """CPU: memory swapped under a parameter and the daemon's view of it
        alike (`model.share_memory()` after construction moves every
        storage into new shared memory): the daemon is pointed at the new
        memory, or the step raises where it cannot reach it. The gradient
        views of the segments, moved too, are made afresh."""
        swapped = [s for s, ptr in zip(self._homed, self._pptrs_flat)
                   if s.pview.data_ptr() != ptr]
        if not swapped or self._device.type != "cpu":
            return
        handles = {id(s): shm_handle(s.pview, s.name) for s in swapped}
        for g in self._groups:
            # Every gradient absent until the next step sends where it is.
            update = pb.UpdateBuffersRequest(group_id=g["id"])
            for s in g["tensors"]:
                if id(s) in handles:
                    s.in_place = True
                    s.pflat = _flat_or_none(s.pview)
                    update.tensors.add(name=s.name, param=handles[id(s)],
                                       grad_absent=not s.frozen)
                elif s.numel and not s.frozen:
                    update.tensors.add(name=s.name, grad_absent=True)
                s.sent_ptr = 0
            if update.tensors:
                self._client.update_buffers(update)
            g["segments"][1] = None
            self._flat_grads(g["id"])
        self._index_buffers()

    def _follow_dtensor_shards(self):
        """A DTensor whose local shard is another tensor now (FSDP2 made a
        new one, e.g. after model.to()): a mirrored one is followed (the
        mirror copies it each step), and so is one registered in place
        while it is the same memory; one in other memory would leave the
        daemon writing memory FSDP2 no longer reads, so it raises. Returns
        the ids of the entries followed."""
        followed = set()
        for s in self._dtensors:
            mem = local_of(s.param)
            if mem is s.mem:
                continue
            if mem.shape == s.mem.shape and mem.dtype == s.mem.dtype and (
                    s.mirrored or mem.data_ptr() == s.mem.data_ptr()):
                if s.pview is s.mem:
                    s.pview = mem
                s.mem = mem
                followed.add(id(s))
                continue
            raise RuntimeError(
                "optimd.torch: the local shard of DTensor parameter %s was "
                "replaced after the optimizer registered it (now %s %s on "
                "%s); create the optimizer after fully_shard() and after "
                "moving or casting the model" % (
                    s.name, mem.dtype, tuple(mem.shape), mem.device))
        return followed

    def _reopen(self, devices):
        """The parameters moved (model.to(), accelerate's prepare() of a
        model still on the CPU) or changed dtype (model.half()): a session
        lives on one device with one layout per tensor, so the optimizer
        opens one where the parameters are now, registers them as they
        are, and carries the state over (as torch's optimizer would go on
        with the changed parameters)."""
        if len(devices) > 1:
            self._spread()
            return
        device = devices.pop()
        if device.type not in ("cpu", "cuda"):
            raise ValueError("the parameters moved to %s; optimd.torch "
                             "supports CPU and CUDA parameters" % device)
        self._refuse_with_shard_state(
            "moving or casting the parameters after construction")
        self._finish_overlap()
        self._look_at_replies(block=True)
        self._write_back_state()
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
            self._load_state_dict(saved)  # internal: no user hooks

    def _spread(self):
        """The parameters are on several devices now (a group added on
        another device, parameters moved there): the optimizer becomes one
        over several devices (_several_devices.py), its state carried
        over. Raises first, leaving it as it was, for what that does not
        take."""
        # The parts start afresh (a secret given for this session is not
        # theirs), holding this session's state.
        check_several(self, dict(self._service, resume_secret=None),
                      self._part_keys())
        self._look_at_replies(block=True)
        self._write_back_state()
        held = held_state(self._whole_state(), self.param_groups)
        self._closer()
        self._close_vmm()
        # Its buffers go with the session (the parts have their own).
        for name in ("_groups", "_router", "_homed", "_params_flat",
                     "_pptrs_flat", "_dtensors", "_mirrored", "_flags",
                     "_param_handle_cache", "_watched", "_versions",
                     "_watched_before", "_watched_plain", "_watched_shards",
                     "_watch_index"):
            self.__dict__.pop(name, None)
        self._retired = {}
        become_several(self, self._service, held, resume=False)

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
        with self._step_lock:
            return self._step_after_closure(loss)

    def _step_after_closure(self, loss):
        self._finish_overlap()
        # Carried by the step; anything below that calls the daemon (a
        # group registered anew carries its state over) tells them first.
        if isinstance(self, SeveralDevices):
            self._follow_written_params()
        else:
            self._written_unsent.add(self._newly_written_params())
        # Writes to optimizer.state first: following edited param_groups
        # below carries the state over from the daemon.
        self._refuse_incomplete_state()
        self._write_back_state()
        self._sync_structure()
        self._sync_params()
        if isinstance(self, SeveralDevices):
            # The parameters spread over devices just now.
            return self._step_parts(loss)
        check_fsdp1_job(self._any_fsdp1, self._world_size,
                        self._identity["sharding"] != _SHARDING[None],
                        bool(self.max_grad_norm or self.skip_nonfinite))
        if self._flags is not None:
            # An earlier step's error, before this step's updates are built
            # on what that step told the daemon.
            self._look_at_replies(block=False)
        written = self._written_unsent.snapshot()
        try:
            self._request_step(self._with_written(self._router.updates(),
                                                  written))
            self._written_unsent.discard(written)
        except BaseException:
            # The daemon may not have what the router counts as told (a
            # step that failed, or updates built part-way): the next step
            # tells it every gradient again.
            self._router.forget()
            self._hold_retired_channels()
            raise
        self.state.invalidate()
        self.state.follow()  # state tensors the trainer holds, as in torch
        # What the step itself wrote (a mirror's copy back) is no write of
        # the trainer's.
        self._versions = self._write_counts()
        return loss

    def _request_step(self, updates):
        self._hold_retired_channels()
        overrides = self._overrides()
        request = dict(
            lr_overrides=overrides[0] if overrides else None,
            grad_scale=float(self.grad_scale or 0.0),
            max_grad_norm=float(self.max_grad_norm or 0.0),
            wait=self.wait_for_step,
            # Torch's semantics unless skipping is asked for: the daemon
            # neither checks nor skips (proto: StepRequest.assume_finite).
            assume_finite=not self.skip_nonfinite,
            buffer_updates=updates,
            # The daemon then closes its mappings of memory no buffer
            # uses, so that what torch gave back returns to the device.
            memory_released=self._router.memory_released)
        if self._flags is None:
            self._mirror_in()
            self._take_reply(self._client.step(**request))
            self._mirror_out()
        else:
            self._step_with_flags(request)
        # Written in place, as torch's steps write them (_versions.py).
        self._router.stepped().bump()
        if overrides:
            self._sent_hyper = overrides[1]

    def release_freed_gradients(self):
        """Torch ran out of device memory (_oom_release.py): tells the
        daemon that the gradients `.grad` no longer holds are absent and
        that memory was released, so that it lets go of them and a retry
        finds their memory on the device, as under torch. Under expandable
        segments the descriptor connections of the chunks sent so far are
        closed first (_close_chunk_connections)."""
        router = getattr(self, "_router", None)
        if router is None or self._flags is None or not self._groups or \
                not router.maps_torch_memory:
            return
        # Not while this optimizer steps (another thread, or this error
        # inside step()): that step's updates could cross these, and its
        # failure or the next step says memory_released anyway.
        if not self._step_lock.acquire(blocking=False):
            return
        try:
            if getattr(self, "_vmm", None) is not None:
                self._close_chunk_connections()
            updates = router.freed_updates() or \
                [pb.UpdateBuffersRequest(group_id=self._groups[0]["id"])]
            updates[-1].memory_released = True
            for update in updates:
                self._client.update_buffers(update, trainer_memory=False)
        except BaseException:
            router.forget()  # the next step tells the daemon everything
            raise
        finally:
            self._step_lock.release()

    def _close_chunk_connections(self):
        """Expandable segments: the daemon holds the descriptor of every
        chunk sent over the sharer's connections, and each keeps its chunk
        allocated after torch unmapped it. Once every step sent is answered
        (the daemon has resolved their chunk ids), the sharer forgets its
        chunks and every connection is closed, so that the daemon drops
        those descriptors; the next step sends its gradients anew. The
        replies stay for _look_at_replies, errors included."""
        bound = self._client.timeout or 60.0
        for future, _ in self._pending:
            try:
                future.exception(bound)  # waits; the error stays the step's
            except concurrent.futures.TimeoutError:
                raise RuntimeError(
                    "the daemon did not answer the steps sent before within "
                    "%.0f s" % bound) from None
            except concurrent.futures.CancelledError:
                pass
        for _, retired in self._pending:
            close_channels(retired)
            retired.clear()
        self._vmm.forget_chunks()
        close_channels(self._vmm.take_retired())

    def _step_with_flags(self, request):
        """CUDA: mark the gradients ready on our stream, send the step, make
        our stream wait for its done flag; look at replies as they come
        (their outcome: skipped, grad_norm) and raise a failed step's error
        at the first step() or synchronize() after its reply came."""
        # Before anything of this step is marked or numbered: a wait that
        # raises (Ctrl-C) leaves nothing half done.
        step_order.wait_for_others(self._device, self, self._client.timeout)
        stream = cuda_ipc.current_stream(self._device)
        flags, sequence = self._flags.next_step(self._client.steps_streamed)
        staged = self._overlap is not None
        self._mirror_in()  # copies on our stream, before the ready flag
        self._flags.mark_ready(stream, staged=staged)
        future = self._client.step_async(step_flags=flags, sequence=sequence,
                                         staged=staged, **request)
        step_order.sent(self._device, self, future)
        if staged:
            self._overlap.started()  # forwards wait, stage by stage
        else:
            self._flags.wait_done(stream)
            self._mirror_out()  # after the wait for the done flag
        self._pending.append((future, []))
        # wait_for_step: this step's own outcome; otherwise whatever
        # replies have come, waiting only when more than
        # _MAX_PENDING_REPLIES are out (the trainer's stream keeps the
        # order).
        self._look_at_replies(block=self.wait_for_step)

    def _look_at_replies(self, block):
        """Takes the replies that have come; with `block`, first waits for
        every step sent. Without, it waits for the oldest replies while
        more than _MAX_PENDING_REPLIES are out: the daemon replies once a
        step is queued on its stream, so this rarely waits, and it bounds
        how late a refused step's error (and opt.skipped) can come."""
        while self._pending:
            if (not block and not self._pending[0][0].done()
                    and len(self._pending) <= _MAX_PENDING_REPLIES):
                break
            future, retired = self._pending.popleft()
            try:
                reply = future.result()
            except BaseException:
                # Steps sent after it were built on what it carried.
                if getattr(self, "_router", None) is not None:
                    self._router.forget()
                self._retell_writes()
                raise
            finally:
                close_channels(retired)
            self._take_reply(reply)

    def _hold_retired_channels(self):
        """Descriptor connections the sharer retired while this step's
        updates were built (torch released memory) stay open until every
        step sent before this one is answered: the daemon resolves a step's
        chunk ids when its device worker reaches the step, and a connection
        closed sooner takes them with it."""
        vmm = getattr(self, "_vmm", None)
        retired = vmm.take_retired() if vmm is not None else []
        if self._pending:
            self._pending[-1][1].extend(retired)
            return
        close_channels(retired)

    def _take_reply(self, reply):
        if reply.known:
            self.skipped = reply.skipped
            self.grad_norm = reply.grad_norm

    def _on_stream_broken(self, first_index, replies_ok, error):
        """On the step stream's reader thread: the daemon will not release
        the unanswered steps; keep our stream from waiting forever."""
        failed = first_index + replies_ok - self._flags.first_index + 1
        # Every step answered: the last one's done flag is the one to wait
        # for.
        answered = min(failed - 1, self._flags.sequence)
        self._flags.release_after_break(
            answered, min(failed, self._flags.sequence),
            answers=self._client.daemon_answers)

    def synchronize(self):
        """Waits for every step sent; raises a failed step's error. With
        overlap, the current stream then also waits for the last step."""
        self._finish_overlap()
        self._look_at_replies(block=True)

    def _finish_overlap(self):
        if self._overlap is not None:
            self._overlap.finish()

    def zero_grad(self, set_to_none=None):
        """As torch's: set_to_none=True sets every `.grad` to None, so the
        next backward writes fresh gradients once; set_to_none=False zeroes
        the existing gradients (in the group's flat gradient buffer, one
        launch per group; with overlap, after the last step is done with
        them). The default is the installed torch's (True from torch 2.0,
        False before)."""
        if set_to_none is None:
            set_to_none = _TORCH_SET_TO_NONE
        if set_to_none:
            if self._overlap is not None:
                self._overlap.keep(self._router.grads())
            # Over param_groups as they are now, as torch's (parameters
            # added since the last step included, removed ones left alone).
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        elif self._routed_as_registered():
            self._finish_overlap()
            if list(map(torch.Tensor.data_ptr, self._params_flat)) != \
                    self._pptrs_flat:
                # model.share_memory() since the last step moved the
                # gradient segments' views too: followed first.
                self._follow_swapped_storages()
            self._router.zero_()
        else:
            self._finish_overlap()
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        zero_in_place(local_of(p.grad))

    def _routed_as_registered(self):
        """Whether the gradient router holds the parameters of param_groups
        as they are now (none added, removed, unfrozen or materialized
        since the last step registered them)."""
        return len(self._groups) == len(self.param_groups) and not any(
            map(_changed_since_registered, self._groups, self.param_groups))


    @property
    def state(self):
        """optimizer.state: the daemon's state in torch's format
        (optimd/_state.py; over several devices, _several_devices.py)."""
        return self.__dict__["state"]

    @state.setter
    def state(self, value):
        # A mapping the trainer assigns (`opt.state = defaultdict(dict)`,
        # a reset) is the state from then on, as in torch: written into
        # the daemon's at the next step. What the optimizer assigns itself
        # (torch's constructor, then ours) is kept as it is.
        current = self.__dict__.get("state")
        ours = (DaemonState, PartsState)
        if isinstance(current, ours) and not isinstance(value, ours):
            entries = dict(value)
            current.clear()
            current.update(entries)
            return
        self.__dict__["state"] = value

    # Daemon access.
    @property
    def client(self):
        return self._client

    def close(self):
        """Closes the session: the daemon frees this trainer's state. Done
        by itself when the optimizer is collected or the process exits
        normally (a killed trainer's session stays for resume=True)."""
        # First: whatever of the rest fails, nothing waits for this
        # optimizer's replies or asks it to release memory any more.
        step_order.forget(self)
        oom_release.forget(self)
        if self._overlap is not None:
            self._finish_overlap()
            self._overlap.close()
            self._overlap = None
        self._closer()
        self._close_vmm()
        self._drop_pending()

    def _drop_pending(self):
        """Forgets the replies not yet looked at (the session is gone), and
        closes the descriptor connections held for them."""
        pending = getattr(self, "_pending", ())
        self._pending = collections.deque()
        for _, retired in pending:
            close_channels(retired)

    def __reduce_ex__(self, protocol):
        """Pickled as a stand-in without a session (PickledOptimizer): what
        pickles an optimizer only by the way loads (torch 1.13's OneCycleLR
        state dict holds a bound method of the scheduler, and so the
        optimizer); the stand-in raises when used. Save state_dict() to
        keep the optimizer's state."""
        return (PickledOptimizer, (type(self).__name__,))

    def __copy__(self):
        raise TypeError(_NO_COPY)

    def __deepcopy__(self, memo):
        raise TypeError(_NO_COPY)


_NO_COPY = ("optimd.torch optimizers hold a daemon session and cannot be "
            "copied; make a new optimizer and load_state_dict() into it")


class PickledOptimizer:
    """What an optimd.torch optimizer unpickles as: its class name only,
    no session, no state; any use raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        raise AttributeError(
            "this optimd.torch.%s was pickled as part of another object (a "
            "scheduler's state dict, say) and holds no daemon session nor "
            "state; use the optimizer of this process (its state: "
            "state_dict() / load_state_dict())" % self.__dict__["_name"])


def _gappy(p):
    """Whether plain parameter `p` has gaps in its memory (a view such as
    base[:, ::2]): stepped in a dense copy (mirrored)."""
    return not is_dtensor(p) and p.numel() > 0 and not is_dense(p) and \
        not overlaps_itself(p)


def _overlapping_error(name, p):
    return errors.OverlappingParameterError(
        "parameter %s (shape %s, strides %s) has elements that share memory "
        "(an expanded tensor); an in-place step cannot update it (torch's "
        "raises RuntimeError): make it a tensor of its own, e.g. "
        "torch.nn.Parameter(t.clone())" % (name, tuple(p.shape), p.stride()))


def _not_dense_error(name, p):
    """The daemon steps a tensor as one run of memory: a DTensor's shard
    with gaps, or a parameter given such memory after registration
    (`p.data = base[:, ::2]`), would silently lose its strides."""
    return ValueError(
        "parameter %s (shape %s, strides %s) is not dense in memory; "
        "optimd.torch steps each parameter as one run of memory: make it "
        "contiguous, e.g. torch.nn.Parameter(t.contiguous())" %
        (name, tuple(p.shape), p.stride()))



def _changed_since_registered(g, group):
    """Whether param_groups entry `group` is no longer what its
    registration `g` holds: parameters added or removed, a parameter
    frozen then and with a gradient now (trained again, or one set by
    hand), or a lazy one materialized since."""
    if list(map(id, group["params"])) != g["param_ids"]:
        return True
    # All None: the set is built without a Python call per parameter.
    if g["frozen"] and set(map(_grad_of, g["frozen"])) != {None}:
        return True
    return bool(g["lazy"]) and not all(map(_is_lazy, g["lazy"]))


def _same_order(a, b):
    """Whether tensors a and b of one shape lay their elements out in the
    same order (strides of dimensions of one element do not count)."""
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape)
               if n > 1)


def _flat_or_none(t):
    """`t`'s memory as one dimension, in memory order (pflat, which the
    state's parts cut by memory ranges): where its elements fill their
    memory without gaps (contiguous, transposed, channels_last)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,)) if is_dense(t) else None


_grad_of = operator.attrgetter("grad")
# An UninitializedParameter (a lazy module's before its first forward).
_is_lazy = torch.nn.parameter.is_lazy
