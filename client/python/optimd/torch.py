"""optimd.torch.AdamW, Adam, SGD and Lion: drop-in torch optimizers whose
step runs in the optimd daemon.

    from optimd.torch import AdamW
    opt = AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    # or SGD(model.parameters(), lr=0.1, momentum=0.9), Lion(...)

The daemon writes new values into the parameters' own memory with no copy.
On CUDA every parameter is stepped where it is, through its allocation's
CUDA IPC handle (only memory CUDA IPC cannot export moves into its group's
buffer, with a warning). On the CPU a parameter's storage moves into POSIX
shared memory, keeping the parameter's identity for the model (one whose
memory other tensors share stays where it is and is stepped there). On
CUDA gradients stay where autograd puts them: zero_grad() sets them to None as torch 2's does (on torch 1.x
its default zeroes them, as there), backward writes
fresh ones, and each step tells the daemon only which moved or went away
(see optimd/_grads.py); a parameter whose `.grad` is None is not stepped.
The optimizer state (moments, master weights, step counters) lives in the
daemon; `state_dict()` and `optimizer.state[p]` fetch it on demand.

Followed as torch follows them: zero_grad both ways (its default the
installed torch's); a gradient set by hand on a parameter that requires
none; load_state_dict replacing each group; SGD's default lr; edits of
param_groups (hyperparameters, amsgrad and maximize, parameters added,
removed or unfrozen, groups taken out: a parameter taken out keeps its
state for a return);
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

Where it differs from torch.optim.AdamW, each deliberate, or behaves as
torch in a way worth a word (README, "Deliberate differences"):
  * bf16 and fp16 parameters keep an fp32 master (or a 16-bit remainder)
    and fp32 moments, where torch steps them in their own dtype;
    master_weights=False is refused for them.
  * defaults, param_groups and state dicts carry optimd's own options
    beside torch's keys.
  * A parameter whose shape changes after steps raises
    optimd.ParameterChangedError (a RuntimeError, as torch's step raises,
    and a TypeError) at the next step.
  * After model.double() the state is carried over cast to float64 (as
    torch's load_state_dict casts it), so the moments are float64 from
    then on; torch's own step fails there (float32 moments, float64
    gradients).
  * A parameter listed twice in a group raises (torch warns that this
    will be an error and meanwhile steps it twice per step; the daemon
    keeps one state per tensor), unless under two names:
    a tied weight, registered once with the second name as its alias
    (optimd/_names.py). So does one put into a second group by an edit of
    param_groups, at the next step (torch's ValueError, which its
    constructor and add_param_group raise; its step would update it once
    per group).
  * Parameters on several devices (CPU and CUDA, cuda:0 and cuda:1) are
    taken as torch takes them, one part and session per device
    (_several_devices.py); overlap, shard_state, gradient_sharding and
    state_bytes then raise, and checkpoints are one folder per device.
  * Two parameters over one memory (v.data = w.data) are updated one
    after the other as in torch, but overlap=True refuses them.
  * A view with gaps (base[:, ::2]) is stepped in a dense copy, copied
    both ways around each step (overlap=True refuses it); an expanded
    parameter raises optimd.OverlappingParameterError (a RuntimeError,
    as torch's step raises, and a ValueError) when registered.
  * DTensor parameters (FSDP2's fully_shard) are stepped in their local
    shards (README, "FSDP2"); replicated or hybrid placements, overlap
    and shard_state with them raise NotImplementedError naming the
    parameter.
  * state_dict() is a copy taken when called (torch's holds the live
    state tensors); the optimizer cannot be copied or deep-copied (pickled,
    it loads as a stand-in without session); capturable=True and
    differentiable=True raise ValueError.
  * FSDP version 1's parameters are stepped in FSDP's flat buffers
    (README, "FSDP version 1"); over several ranks max_grad_norm and
    skip_nonfinite need gradient_sharding (ValueError without).
  * Parameter memory other tensors share is stepped where it is (README):
    memory shared with other processes through file descriptors only
    (torch's default sharing strategy) raises RuntimeError; on torch 1.13
    a tensor sharing a parameter's whole memory and not itself a
    parameter of the optimizer (taken from it before the optimizer was
    made) is not detected and stops seeing the steps; `v.data = w.data`
    done after construction unties them. Gradients: on torch 1.13 a view
    of an autograd-made gradient kept elsewhere is not detected.
  * max_grad_norm (optimd's own) clips by the norm of this rank's
    gradients, or of the job's with gradient_sharding.
"""
import functools

import torch
import torch.optim.optimizer as torch_optimizer

from optimd import errors
from optimd._daemon_optimizer import (BLOCK8, _DaemonOptimizer,
                                      _service_options, _torch_defaults)
# Public as optimd.torch.tied_named_parameters(model).
from optimd._names import tied_named_parameters  # noqa: F401
from optimd.v1 import optimd_pb2 as pb

# torch's marker for a hyperparameter without a default (SGD's lr before
# torch 2.2): torch.optim.Optimizer.add_param_group raises for a group
# that does not give it.
_REQUIRED = torch_optimizer.required

__all__ = ["AdamW", "Adam", "SGD", "Lion", "BLOCK8",
           "tied_named_parameters"]


class _AdamFamily(_DaemonOptimizer):
    """What optimd.torch.AdamW and Adam share (each is also a subclass of
    torch's own class, so that isinstance checks see what torch's would)."""

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
        self._check_options(torch_options, exp_avg_dtype, amsgrad)
        defaults = _torch_defaults(self._torch_class)
        defaults.update(torch_options)
        decoupled = bool(adam_w_mode or
                         torch_options.get("decoupled_weight_decay", False))
        defaults.update(dict(
            lr=lr, eps=eps, weight_decay=weight_decay,
            betas=betas if _torch_betas_kept_as_given(self._torch_class)
            else tuple(betas),
            amsgrad=amsgrad, maximize=maximize, master_weights=master_weights,
            store_param_remainders=store_param_remainders,
            exp_avg_dtype=exp_avg_dtype, adam_w_mode=decoupled,
            bias_correction=bias_correction))
        if "decoupled_weight_decay" in _torch_group_keys(self._torch_class):
            defaults["decoupled_weight_decay"] = decoupled
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
                    decoupled_weight_decay=_decoupled(group),
                    bias_correction=bool(group.get("bias_correction", True)),
                    **self._storage_of(group))

    def add_param_group(self, param_group):
        # A group that sets one of the two switches of decoupled decay gets
        # the other from it, not from the defaults.
        if isinstance(param_group, dict):
            given = [k for k in _DECAY_SWITCHES if k in param_group]
            if len(given) == 1:
                param_group = dict(param_group)
                for k in _DECAY_SWITCHES:
                    if k in self.defaults:
                        param_group[k] = param_group[given[0]]
        super().add_param_group(param_group)

    def _reconcile_group(self, gi, group):
        """Keeps the group's two switches of decoupled decay equal: where
        they differ, one was set since the group was registered, and its
        new value holds for both."""
        if not all(k in group for k in _DECAY_SWITCHES):
            return
        mode, decoupled = (bool(group[k]) for k in _DECAY_SWITCHES)
        if mode != decoupled:
            was = self._groups[gi]["snapshot"]["decoupled_weight_decay"]
            for k in _DECAY_SWITCHES:
                group[k] = not was

    def _slot_names(self, group):
        return ("exp_avg", "exp_avg_sq") + (
            ("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _check_layout_change(self, gi, group, snapshot, tensors_state):
        # Turning amsgrad on once the group has state fails in torch too
        # (its step finds no max_exp_avg_sq: KeyError), unless it was on
        # before: torch's state keeps the slot meanwhile, and so do we.
        if group["amsgrad"] and not snapshot["amsgrad"] and any(
                e and "exp_avg" in e and "max_exp_avg_sq" not in e
                for e in tensors_state):
            raise errors.MissingStateError(
                "param_groups[%d]['amsgrad'] was turned on after steps: the "
                "state has no max_exp_avg_sq (torch.optim.AdamW's step "
                "raises KeyError too); set amsgrad before the first step" %
                gi)


# The two switches of decoupled (AdamW) weight decay a group may carry:
# optimd's adam_w_mode, and torch's decoupled_weight_decay (torch.optim.Adam's
# argument since torch 2.6, a key of torch.optim.AdamW's groups since 2.7).
# _AdamFamily._reconcile_group keeps them equal.
_DECAY_SWITCHES = ("adam_w_mode", "decoupled_weight_decay")


class AdamW(_AdamFamily, torch.optim.AdamW):
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
      master_weights: None (an fp32 master for bf16 and fp16 parameters
        only), True (fp32 parameters too, so a crashed trainer can get fp32
        weights back; refused for float64), False.
      store_param_remainders: bf16 parameters keep an int16 remainder instead
        of an fp32 master (exact; 4 bytes less per parameter); every
        parameter of such a group must be bf16.
      timeout: seconds each daemon call may take (default 60; at least 900
        with gradient_sharding).
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
        device inside each step. DTensor (FSDP2) parameters get
        "sharded" by themselves; FSDP version 1's must be told (ValueError
        with max_grad_norm or skip_nonfinite and no gradient_sharding).
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
        completes before step() returns), but refused there as on CUDA
        with FSDP parameters and shard_state.
    Parameters may be given as (name, tensor) pairs to name their state;
    a tied weight given under each of its names (tied_named_parameters(
    model), or torch 2.x's named_parameters(remove_duplicate=False)) is
    registered once, its other names kept as aliases that checkpoints list
    and exports load by (optimd/_names.py).

    float64 parameters are stepped in float64 with float64 moments, as
    torch steps them (a group may mix them with float32 ones);
    exp_avg_dtype applies to float32, bf16 and fp16 parameters.

    Where it differs from torch.optim.AdamW (README, "Deliberate
    differences"): a parameter listed twice in a group and expanded
    parameters raise; parameters on several devices get a part (and
    session) per device; DTensor (FSDP2) parameters are stepped in
    their local shards (replicated or hybrid placements raise); after
    model.double() the moments are cast to float64 and training goes on
    (torch's own step fails there).
    """

    def _as_torch_loads(self, groups):
        """torch.optim.AdamW steps as AdamW after any load: from torch 2.7
        its load sets decoupled_weight_decay in every group (of a
        torch.optim.Adam state dict too), and before, its step had no other
        way. So does this one, unless made with adam_w_mode=False (optimd's
        own switch, which a load then sets as the state dict says)."""
        if not self.defaults["adam_w_mode"]:
            return
        for group in groups:
            for k in _DECAY_SWITCHES:
                if k in group or k in self.defaults:
                    group[k] = True


def _decoupled(group):
    """Whether a group's weight decay is AdamW's."""
    if "adam_w_mode" in group:
        return bool(group["adam_w_mode"])
    return bool(group.get("decoupled_weight_decay", True))


@functools.lru_cache(maxsize=None)
def _torch_group_keys(cls):
    """The keys the installed torch's `cls` puts in its param groups: its
    defaults, which may hold one its constructor does not take (AdamW's
    decoupled_weight_decay, torch 2.7 and later)."""
    return frozenset(cls([torch.zeros(1, requires_grad=True)]).defaults)


@functools.lru_cache(maxsize=None)
def _torch_betas_kept_as_given(cls):
    """Whether the installed torch's `cls` keeps `betas` as given (a list
    stays a list: torch 1.13) or makes it a tuple (later torch 2.x). A
    probe of torch's own class, as _torch_sgd_unset_slots."""
    made = cls([torch.zeros(1, requires_grad=True)], betas=[0.9, 0.999])
    return isinstance(made.defaults["betas"], list)


@functools.lru_cache(maxsize=None)
def _torch_sgd_unset_slots():
    """The keys that the installed torch's SGD sets to None in the state
    entry of a parameter it stepped without momentum: ("momentum_buffer",)
    where it keeps every stepped parameter's buffer, None without momentum
    (torch 1.13); () where it keeps one only with momentum and no entry
    otherwise (later torch 2.x). Found by stepping torch's own SGD once, a
    probe rather than a version check: what counts is the torch here."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.0)
    opt.step()
    entry = opt.state.get(p) or {}
    return tuple(k for k, v in entry.items() if v is None)


class Adam(_AdamFamily, torch.optim.Adam):
    """torch.optim.Adam with the step in the optimd daemon: AdamW with
    Adam's L2 weight decay (folded into the gradient) and torch.optim.Adam's
    defaults (weight_decay=0), so that a torch.optim.Adam user changes only
    the import. The optimd arguments are those of optimd.torch.AdamW but
    adam_w_mode."""

    _torch_class = torch.optim.Adam

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, **kwargs):
        if "adam_w_mode" in kwargs:
            raise TypeError("optimd.torch.Adam is Adam (L2 decay); use "
                            "optimd.torch.AdamW for decoupled decay")
        super().__init__(params, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad,
                         adam_w_mode=False, **kwargs)


class SGD(_DaemonOptimizer, torch.optim.SGD):
    """torch.optim.SGD with the step in the optimd daemon: lr (its default
    the installed torch's: 1e-3 from torch 2.2, required before), momentum,
    dampening, nesterov, weight_decay and maximize as torch has them (a
    tensor's first step starts its momentum buffer from the gradient);
    optimizer.state holds torch's "momentum_buffer"; without momentum a
    stepped parameter's entry is what the installed torch keeps (torch
    1.13: "momentum_buffer": None; later torch 2.x: no entry), and
    load_state_dict takes either. Momentum may change between steps
    (schedulers cycle it); turning it on or off, or changing dampening,
    nesterov or maximize, registers the group anew, keeping its state.

    Besides torch's arguments:
      address, job_id, rank, world_size, resume, resume_secret,
        master_weights, store_param_remainders, max_grad_norm,
        gradient_sharding, grad_scale, skip_nonfinite, keep_fp32, overlap,
        shard_state, timeout: as optimd.torch.AdamW has them.
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
    Sparse gradients (nn.Embedding(sparse=True)) are stepped as their dense
    equivalent, as torch steps them; `.grad` stays sparse, and a momentum
    buffer is dense where torch's would be sparse.
    """

    _takes_sparse_grads = True

    _kind = pb.OPTIMIZER_KIND_SGD
    _torch_class = torch.optim.SGD
    _every_slot_needed = False  # a missing momentum buffer: from the grad
    _state_has_step = False
    _state_dtype_key = "state_dtype"
    _takes_float64 = True

    def __init__(self, params, lr=None, momentum=0, dampening=0,
                 weight_decay=0, nesterov=False, *, maximize=False,
                 address=None, job_id=None, rank=None, world_size=None,
                 resume=False, master_weights=None,
                 store_param_remainders=False, state_dtype=torch.float32,
                 max_grad_norm=0.0, grad_scale=None, skip_nonfinite=False,
                 keep_fp32=(), overlap=False, resume_secret=None,
                 timeout=60.0, gradient_sharding=None, shard_state=False,
                 **torch_options):
        defaults = _torch_defaults(self._torch_class)
        if lr is None:
            # The installed torch's default: 1e-3 from torch 2.2; before,
            # none (`required`: every group must give one, as torch checks
            # in add_param_group).
            lr = defaults["lr"]
        if lr is not _REQUIRED and not 0.0 <= lr:
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
                    maximize=group["maximize"], **self._storage_of(group))

    def _slot_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _state_entry(self, s, own, flats, fused=False):
        """As torch's SGD keeps it: a stepped parameter of a group without
        momentum (no buffer from the daemon) has the installed torch's
        entry, {"momentum_buffer": None} or none at all (with a master of
        its own, bf16 or fp16, just that); loads drop the None."""
        entry = super()._state_entry(s, own, flats, fused)
        if entry is None or "momentum_buffer" in entry:
            return entry
        entry.update(dict.fromkeys(_torch_sgd_unset_slots()))
        return entry or None

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
        shard_state, timeout: as optimd.torch.AdamW has them.
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
        return dict(maximize=group["maximize"], **self._storage_of(group))

    _counts_steps = False

    def _slot_names(self, group):
        return ("exp_avg",)

    def _check_layout_change(self, gi, group, snapshot, tensors_state):
        pass
