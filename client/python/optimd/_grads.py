"""Where each parameter's gradient is, told to the daemon step by step.

torch's autograd writes a fresh gradient tensor into `.grad` when it is None
(torch 2's default `zero_grad(set_to_none=True)`) and accumulates into the
existing one otherwise. optimd follows autograd instead of fighting it:

* CUDA: the daemon reads each gradient where the caching allocator put it.
  Per step the router compares the gradients' data pointers with the ones
  the daemon has (one C-level pass over the tensors, no Python loop); only
  moved or newly absent gradients become buffer updates of the next Step.
  The allocator hands out the same blocks step after step, so the steady
  state sends nothing and the daemon opens nothing.
* CPU: the daemon reads shared memory only, so a gradient autograd put in
  ordinary memory is copied into the tensor's view of the group's shared
  gradient segment (the same bytes autograd would have accumulated into)
  and `.grad` becomes that view. The same on CUDA where CUDA IPC cannot
  export torch's allocations (expandable segments): the segment is then
  the optimizer's own device memory.
* A parameter whose `.grad` is None at step() is absent: the daemon leaves
  it out of the step (no decay, no moment update), as torch does.
* zero_grad(set_to_none=False) points every gradient autograd made (and
  nobody else holds) at its view of the group's flat gradient segment and zeroes each segment in one
  launch; later backwards accumulate there.
* A gradient tensor the trainer holds (a view of a flat buffer of its own,
  or one it keeps a reference to) stays the trainer's, as in torch: it is
  read (CPU: copied) where it is at each step and zeroed in place. Only
  what autograd made and nobody else holds is taken over (_ours_to_take).
"""
import operator
import sys

import torch

from optimd._aliased import shares_storage
from optimd._dtensor import is_dtensor, local_of
from optimd._versions import VersionBumper
from optimd._vmm import NotVmmMemory, release_counts
from optimd.v1 import optimd_pb2 as pb

_get_grad = operator.attrgetter("grad")


def segments_freed(device):
    """torch's counts of what its caching allocator gave back to the device
    (cudaFree) on `device`: its device frees (torch 2.1 on) and its
    segments freed (every torch), and their resets (release_counts). None
    where torch keeps neither (an allocator of another library's)."""
    return release_counts(device, ("num_device_free", "segment.all.freed"),
                          every_key=False)


# How many times GradRouter.updates builds a step's updates while torch
# keeps releasing device memory under them.
_VMM_TRIES = 3


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _refs(grad):
    return sys.getrefcount(grad)


def _calibrate():
    """What _ours_to_take's count is for a gradient nobody else holds, seen
    as the loops below see theirs: an element of a list of `.grad` values
    zipped with the tensors (zip's reused result tuple holds it too), bound
    to a loop variable, passed to a function that counts."""
    def take_frame(grad):  # stands for _ours_to_take's own frame
        return _refs(grad)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    for _, grad in zip([p], [p.grad]):
        return take_frame(grad)


_UNHELD_REFS = _calibrate()


def _ours_to_take(grad):
    """Whether the gradient `grad` (an element of a list of `.grad` values
    in the caller's zip loop, as _calibrate sees one) may be replaced by its
    tensor's view of the flat gradient segment without the trainer
    noticing: autograd made it (it is no view of a buffer of the
    trainer's), nothing but `.grad` and that loop holds it, and (torch 2)
    no other tensor uses its memory."""
    return grad._base is None and _refs(grad) <= _UNHELD_REFS and \
        not shares_storage(grad)


def _held(entry):
    """Whether something besides `entry` holds its gradient view (a
    gradient the trainer kept after zero_grad(set_to_none=True), or a view
    of it): the view's memory must then not take the next gradient."""
    return _refs(entry.gview) > _HELD_REFS or shares_storage(entry.gview)


def _calibrate_held():
    class Entry:
        __slots__ = ("gview",)
    e = Entry()
    e.gview = torch.zeros(1)
    return _refs(e.gview)


_HELD_REFS = _calibrate_held()


def update_of(by_group, entry):
    """The UpdateBuffersRequest of `entry`'s group in `by_group` (group id
    -> request), made on its first use."""
    request = by_group.get(entry.group_id)
    if request is None:
        request = by_group[entry.group_id] = pb.UpdateBuffersRequest(
            group_id=entry.group_id)
    return request


class GradRouter:
    """The gradients of one optimizer's steppable tensors, in registration
    order. `tensors` are the optimizer's _TensorEntry objects (param, name,
    numel, frozen, gview, group_id, sent_ptr); gview is None until the
    group's flat gradient segment exists."""

    def __init__(self, tensors, device, flat_segment, densify=False,
                 copies=False, vmm=None):
        # flat_segment(group_id) -> the group's flat gradient segment,
        # created on first use (CUDA) or already there (CPU). densify: a
        # sparse gradient is stepped as its dense equivalent (torch's SGD
        # steps sparse gradients; the daemon reads dense memory), `.grad`
        # staying sparse; otherwise it raises as torch's Adam does.
        self._densify = densify
        # copies: gradients are copied into the flat segments (CPU; CUDA
        # where torch's allocations cannot be exported), not read in place.
        self._copies_in = copies
        # What _checked copied for the daemon, by tensor name.
        self._copies = {}
        self._tensors = [s for s in tensors if not s.frozen and s.numel]
        self._params = [s.param for s in self._tensors]
        # DTensor parameters (FSDP2): their gradients' local shards are
        # what the daemon reads.
        self._dtensors = any(map(is_dtensor, self._params))
        self._cuda = device.type == "cuda"
        self._flat_segment = flat_segment
        # What the daemon has for each tensor (kept on its entry, so that a new
        # router over more groups starts from the truth): a data pointer, or
        # 0 when absent. Registration leaves every tensor absent.
        self._sent = [s.sent_ptr for s in self._tensors]
        # stepped()'s, and the _sent it was made for.
        self._stepped, self._stepped_for = None, None
        self._handles = HandleCache(vmm, vmm_refreshed=True) \
            if self._cuda else None
        self._vmm = vmm
        # A generation no sharer has: a new router sends every gradient
        # at its first step (its tensors' sent_ptr may date from chunks
        # forgotten since).
        self._vmm_generation = -1
        self._allocated = False  # _checked copied a gradient in this pass
        # torch's count of segments freed at the last step (CUDA IPC: not
        # with expandable segments, whose sharer keeps its own counts, nor
        # with copies, where the daemon reads buffers of the optimizer's
        # own), and whether it moved before the step being built
        # (StepRequest.memory_released). A new router starts from a count
        # no torch has: its first step sends every gradient (torch may
        # have freed memory since the router before it looked).
        self._device = device
        self._releases = () if self._cuda and vmm is None and \
            not copies else None
        self.memory_released = False

    def stepped(self):
        """A VersionBumper over the parameters whose gradients the daemon
        has: those the step just sent updates (torch's steps skip a
        parameter whose `.grad` is None)."""
        if self._stepped_for != self._sent:
            self._stepped_for = list(self._sent)
            self._stepped = VersionBumper(
                s.param for s, sent in zip(self._tensors, self._sent) if sent)
        return self._stepped

    def forget(self):
        """The daemon may not have what this router told it (a step failed
        or was never sent): the next step tells it every gradient again."""
        self._sent = [None] * len(self._sent)
        for s in self._tensors:
            s.sent_ptr = None
        # And says again that memory was released, should the step that
        # said it have failed.
        if self._releases is not None:
            self._releases = ()
        self._vmm_generation = -1

    @property
    def maps_torch_memory(self):
        """Whether the daemon reads gradients in torch's own memory (CUDA
        IPC, or expandable segments' chunks), not copies."""
        return self._cuda and not self._copies_in

    def freed_updates(self):
        """UpdateBuffersRequest messages marking absent every gradient the
        daemon reads in torch's memory that `.grad` no longer holds at the
        address sent (set to None, or moved): torch may have freed it, and
        the daemon's mapping keeps that memory allocated. The next step
        sends the gradients present then. Empty where the daemon reads
        copies in buffers of the optimizer's own."""
        if self._copies_in:
            return []
        by_group = {}
        for i, grad in enumerate(self._local_grads()):
            sent = self._sent[i]
            if sent == 0:
                continue  # absent already
            try:
                if grad is not None and _ptr(grad) == sent:
                    continue
            except RuntimeError:  # sparse: no data pointer of its own
                pass
            s = self._tensors[i]
            update_of(by_group, s).tensors.add(name=s.name, grad_absent=True)
            self._sent[i] = s.sent_ptr = 0
        return list(by_group.values())

    def updates(self):
        """The buffer updates that bring the daemon to the gradients now in
        `.grad`, as UpdateBuffersRequest messages; empty when nothing
        moved."""
        self.memory_released = False
        if self._releases is not None:
            releases = segments_freed(self._device)
            if releases != self._releases:
                # torch freed allocations (cudaFree), and a new one may lie
                # at a freed one's address: every gradient is sent anew,
                # by its allocation's handle (the daemon's mapping of a
                # freed one still reads the old memory).
                self.memory_released = True
                self._sent = [None] * len(self._sent)
            self._releases = releases
        for _ in range(_VMM_TRIES):
            self._allocated = False
            out = self._updates_once()
            # A copy made for the daemon (_checked) can make torch release
            # cached memory to satisfy it; chunks named above may then be
            # gone: the updates are built again against the new chunks.
            if not (self._allocated and self._vmm is not None) or \
                    self._vmm.refresh() == self._vmm_generation:
                return out
        raise RuntimeError(
            "torch released device memory each time optimd copied a "
            "gradient for the daemon (%d tries); free memory on %s or set "
            "PYTORCH_CUDA_ALLOC_CONF without expandable_segments"
            % (_VMM_TRIES, self._vmm.device))

    def _updates_once(self):
        grads = self._local_grads()
        if self._copies_in:
            grads = self._home_grads(grads)
        try:
            ptrs = list(map(_ptr, grads))
        except RuntimeError:  # a sparse gradient has no data pointer
            ptrs = [-1 if g is not None and g.is_sparse else _ptr(g)
                    for g in grads]
        if self._vmm is not None and \
                self._vmm.refresh() != self._vmm_generation:
            # torch released memory: a gradient at its old pointer may be
            # in another chunk now; every one is sent anew.
            self._vmm_generation = self._vmm.generation
            self.memory_released = True
            self._sent = [None] * len(self._sent)
        if ptrs == self._sent:
            return []
        by_group = {}
        handles = self._handles
        for i, (ptr, sent) in enumerate(zip(ptrs, self._sent)):
            if ptr == sent:
                continue
            s = self._tensors[i]
            update = update_of(by_group, s)
            if ptr == 0:
                update.tensors.add(name=s.name, grad_absent=True)
            else:
                grad = self._checked(s, grads[i])
                ptr = grad.data_ptr()
                # Filled in place: a moved gradient costs the host what it
                # must (2,000-tensor models move hundreds a step).
                self._fill_handle(update.tensors.add(name=s.name).grad, s,
                                  grad, handles)
            self._sent[i] = s.sent_ptr = ptr
        return list(by_group.values())

    def _local_grads(self):
        grads = list(map(_get_grad, self._params))
        if self._dtensors:
            grads = list(map(local_of, grads))
        return grads

    def _checked(self, s, grad):
        """What the daemon reads for gradient `grad` of tensor `s`: `grad`,
        or a copy of it in the parameter's memory order (dense, with the
        parameter's strides), kept alive until the next step (the CUDA
        daemon may still read it); `.grad` stays as the trainer set it."""
        self._copies.pop(s.name, None)
        if grad.is_sparse and self._densify:
            grad = grad.to_dense()
            self._copies[s.name] = grad
            self._allocated = True
        if grad.is_sparse:
            # The exception torch's Adam and AdamW raise (its SGD steps
            # sparse gradients; the daemon steps dense memory only).
            raise RuntimeError(
                "optimd.torch does not support sparse gradients (parameter "
                "%s); use a dense gradient (e.g. nn.Embedding(sparse=False))"
                % s.name)
        mem = s.mem
        if grad.dtype != mem.dtype or grad.shape != mem.shape:
            raise TypeError(
                "parameter %s has a gradient of %s %s; its parameter is %s "
                "%s" % (s.name, grad.dtype, tuple(grad.shape),
                        mem.dtype, tuple(mem.shape)))
        if grad.device != mem.device:
            raise ValueError("parameter %s has its gradient on %s, not on %s"
                             % (s.name, grad.device, mem.device))
        if grad.stride() != s.pview.stride() and grad.numel() > 1:
            # The daemon reads the gradient in the memory order of the
            # parameter it steps (a dense copy of one with gaps).
            grad = torch.empty_like(s.pview).copy_(grad)
            self._copies[s.name] = grad
            self._allocated = True
        return grad

    def _fill_handle(self, out, s, grad, handles):
        """Sets BufferHandle `out` to where `grad` is."""
        if s.gview is not None and grad.data_ptr() == s.gview.data_ptr():
            seg = self._flat_segment(s.group_id)
            out.CopyFrom(seg.handle(grad.data_ptr() - seg.base_ptr(),
                                    grad.numel() * grad.element_size()))
        else:
            handles.fill(out, grad)

    def _home_grads(self, grads):
        """CPU (and CUDA without exportable torch memory): the daemon reads
        the flat segments only; a gradient elsewhere is copied into its
        view there, which then becomes `.grad` when the
        gradient is autograd's and nobody else's (_ours_to_take; a
        DTensor's gradient stays FSDP2's, and one the trainer owns its own:
        both are copied each step). Returns what the daemon reads for each
        tensor."""
        self._renew_held(grads)
        out = []
        dsts, srcs = [], []
        for s, grad in zip(self._tensors, grads):
            if grad is not None and grad is not s.gview:
                if s.gview is None:
                    self._flat_segment(s.group_id)  # creates every gview
                take = not (is_dtensor(s.param) or grad.is_sparse or
                            s.keeps_grads) and _ours_to_take(grad)
                grad = self._checked(s, grad)
                if grad.data_ptr() != s.gview.data_ptr():
                    dsts.append(s.gview)
                    srcs.append(grad)
                self._copies.pop(s.name, None)  # copied: needed no more
                if take:
                    s.param.grad = s.gview
            out.append(None if grad is None else s.gview)
        copy_all(dsts, srcs)
        return out

    def zero_(self):
        """zero_grad(set_to_none=False): existing gradients become views of
        the flat gradient segments, zeroed one segment per launch. None
        stays None, as in torch."""
        touched = set()
        grads = self.grads()
        self._renew_held(grads)
        for s, grad in zip(self._tensors, grads):
            if grad is None:
                continue
            if is_dtensor(s.param) or grad.is_sparse or (
                    s.keeps_grads and grad is not s.gview) or not (
                    grad is s.gview or _ours_to_take(grad)):
                # FSDP2's own gradient, a sparse one, or one the trainer
                # holds: zeroed where it is, as torch's zero_grad does.
                zero_in_place(local_of(grad))
                continue
            touched.add(s.group_id)
            if s.gview is None:
                self._flat_segment(s.group_id)  # creates every gview
            if grad is not s.gview:
                s.param.grad = s.gview
        for group_id in sorted(touched):
            self._flat_segment(group_id).zero_()

    def grads(self):
        return list(map(_get_grad, self._params))

    def _renew_held(self, grads):
        """A gradient view of a flat segment the trainer keeps (it took
        `.grad` and let it go: gradient noise estimates, say) is the
        trainer's now: the group gets a new segment, so the next gradient
        or zero_grad does not overwrite the kept one, and that tensor's
        gradients are not taken into the segment again (keeps_grads), so
        this happens once per tensor, not every step."""
        renew = set()
        for s, grad in zip(self._tensors, grads):
            if s.gview is not None and grad is not s.gview and _held(s):
                s.keeps_grads = True
                renew.add(s.group_id)
        for group_id in renew:
            self._flat_segment(group_id, renew=True)


def copy_all(dsts, srcs):
    """dst.copy_(src) for each pair, in as few launches as torch allows
    (torch._foreach_copy_, from torch 2.1: a 2,000-tensor model's copies
    cost the host one launch per tensor otherwise)."""
    if not dsts:
        return
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(dsts, srcs)
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)


def zero_in_place(grad):
    """torch's zero_grad(set_to_none=False) on one gradient."""
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()


class HandleCache:
    """CUDA IPC handles of the allocations holding gradients (or, in the
    optimizer's own cache, parameters registered where they are), by the
    allocation's unique buffer id (cuda_ipc.allocation_of), kept across
    steps: gradients that alternate between allocations (overlap keeps the
    last step's alive while the next forward allocates) cost one driver
    call each, not an IPC handle each. Bounded: cleared past
    `MAX_ALLOCATIONS`."""

    MAX_ALLOCATIONS = 4096

    def __init__(self, vmm=None, vmm_refreshed=False):
        self._by_id = {}
        # torch's memory is expandable segments, shared chunk by chunk
        # (_vmm.py), or None: CUDA IPC. vmm_refreshed: the owner refreshes
        # the sharer before its fills (GradRouter, once a step).
        self.vmm = vmm
        self._vmm_refreshed = vmm_refreshed

    def handle(self, tensor):
        """A BufferHandle of where `tensor` is."""
        out = pb.BufferHandle()
        self.fill(out, tensor)
        return out

    def fill(self, out, tensor):
        """Sets BufferHandle `out` to where `tensor` is."""
        from optimd import cuda_ipc
        if self.vmm is not None:
            try:
                self.vmm.fill(out, tensor, refreshed=self._vmm_refreshed)
                return
            except NotVmmMemory:
                out.Clear()  # cudaMalloc's memory: CUDA IPC below
        buffer_id, base, _ = cuda_ipc.allocation_of(tensor)
        ipc_handle = self._by_id.get(buffer_id)
        if ipc_handle is None:
            if len(self._by_id) >= self.MAX_ALLOCATIONS:
                self._by_id.clear()
            ipc_handle = cuda_ipc.mem_handle_at(base, tensor.device)
            self._by_id[buffer_id] = ipc_handle
        ipc = out.cuda_ipc
        ipc.ipc_handle = ipc_handle
        ipc.device = tensor.device.index or 0
        ipc.offset = tensor.data_ptr() - base
        ipc.size = tensor.numel() * tensor.element_size()
