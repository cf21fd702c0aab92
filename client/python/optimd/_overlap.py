"""Overlap (AdamW(overlap=True), CUDA): the daemon's update of step n runs
while the trainer's stream goes on with iteration n + 1, and each module's
forward waits only for the parameters it reads.

The daemon updates the tensors stage by stage (a staged step), each group's
tensors spread over `STAGES` stages by their position in the group (forward
order, for parameters listed as a model lists them), and writes progress
s + 1 into the third step-flag word after stage s. A forward pre-hook of
every module waits on the current stream for the stage of the module's own
parameters (cuStreamWaitValue32, no host sync).

What needs care besides parameters: gradients. The daemon reads step n's
gradients while the next iteration runs, so `zero_grad()` keeps the ones it
drops alive until the trainer's stream has waited for the last stage (the
update is then done with every gradient; usually in the forward's last
module, so the next backward gets the same memory back and no gradient
moves), at the latest until the next step. That step (or anything else that
needs step n complete: `synchronize()`, `zero_grad(set_to_none=False)`,
`close()`) makes the trainer's stream wait for its done flag first.

The contract (README): a parameter is current when the module that holds it
runs its forward (a module whose forward is a CUDA graph, from
torch.cuda.make_graphed_callables, waits for every parameter under it, as
its submodules' hooks do not run in the replay; so does torch.compile's
wrapper, and under model.compile() each wait is a graph break), or after
`opt.synchronize()`; code that reads parameters
elsewhere (a functional use of another module's weight, evaluation without
the module's forward, `model.state_dict()`) calls `opt.synchronize()` first.
"""
import weakref

import torch

STAGES = 16


def assign_stages(tensors):
    """Stage of each tensor of one group: its first element's position in the
    group's elements, in STAGES equal parts. Assigned with or without
    overlap: the daemon's plan (and so the order in which the gradient norm
    is summed) follows the stages, and plain steps must give the bits of
    staged ones, clipping included."""
    total = sum(s.numel for s in tensors) or 1
    before = 0
    for s in tensors:
        s.stage = min(STAGES - 1, before * STAGES // total)
        before += s.numel


def _runs_whole(module):
    """Whether `module`'s forward may read its submodules' parameters
    without their hooks having waited: a CUDA graph's replay
    (torch.cuda.make_graphed_callables sets the module's own forward), or
    torch.compile(model)'s wrapper, whose own hooks run eagerly before the
    compiled code."""
    if type(module).__name__ == "OptimizedModule":
        return True
    forward = module.__dict__.get("forward")
    return "make_graphed_callables" in getattr(forward, "__qualname__", "")


def _eager(fn):
    """`fn` run eagerly where torch.compile traces a module's forward (a
    graph break): its waits are CUDA driver calls dynamo cannot trace, and
    traced reads of the overlap's state would be specialized on. Outside
    tracing `fn` is called as it is, without the disabling wrapper's cost
    at every module's forward. torch before 2.1 has no
    torch.compiler.disable and takes `fn` as it is (use overlap with
    torch.compile on torch 2.1 or later)."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    if disable is None:
        return fn
    disabled = disable(fn)
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:  # torch 2.1-2.2: always through the wrapper
        return disabled

    def call(*args):
        if is_compiling():
            return disabled(*args)
        return fn(*args)
    return call


class Overlap:
    def __init__(self, optimizer, flags):
        self._flags = flags
        self._stage_of = {}  # id(param) -> stage
        self._last_stage = -1  # the highest stage of any parameter
        self._pending = False  # a staged step whose done is not awaited
        self._waited = -1  # the highest stage this step's forward awaited
        self._kept_grads = []  # gradients the pending step may still read
        # The highest stage under a module that runs whole (a walk over
        # every parameter under it), found at its first forward after a
        # registration.
        self._graphed_stage = weakref.WeakKeyDictionary()
        opt = weakref.ref(optimizer)

        @_eager
        def hook(module, args):
            o = opt()
            if o is not None and o._overlap is not None:
                o._overlap.before_forward(module)

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
            hook)
        weakref.finalize(optimizer, self._hook.remove)

    def set_stages(self, tensors):
        self._graphed_stage.clear()
        for s in tensors:
            self._stage_of[id(s.param)] = s.stage
            self._last_stage = max(self._last_stage, s.stage)

    def started(self):
        """A staged step was sent: forwards wait for its stages from now."""
        self._pending = True
        self._waited = -1

    def keep(self, grads):
        if self._pending:
            self._kept_grads.extend(g for g in grads if g is not None)

    def before_forward(self, module):
        if not self._pending:
            return
        if torch.cuda.is_current_stream_capturing():
            # A captured wait would wait for this step's stages at every
            # replay, long passed: later replays would not wait at all.
            raise RuntimeError(
                "optimd.torch: overlap=True: a CUDA graph is being captured "
                "while a step's update runs; capture before the first step "
                "or after opt.synchronize()")
        stage = self._stage_for(module)
        if stage > self._waited:
            self._flags.wait_stage(
                torch.cuda.current_stream(self._flags.device), stage)
            self._waited = stage
            if stage >= self._last_stage:
                # Work queued from here on runs after every stage's update:
                # the allocator may hand their gradients' memory out again.
                self._kept_grads.clear()

    def _stage_for(self, module):
        """The highest stage of the parameters `module`'s forward reads:
        its own, or every parameter under it for a module that runs whole
        (_runs_whole)."""
        if not _runs_whole(module):
            return self._highest_stage(module._parameters.values())
        stage = self._graphed_stage.get(module)
        if stage is None:
            stage = self._highest_stage(module.parameters())
            self._graphed_stage[module] = stage
        return stage

    def _highest_stage(self, params):
        stage = -1
        for p in params:
            if p is not None:
                stage = max(stage, self._stage_of.get(id(p), -1))
        return stage

    def finish(self):
        """Makes the current stream wait for the pending step's done flag,
        then lets its gradients go."""
        if not self._pending:
            return
        self._flags.wait_done(torch.cuda.current_stream(self._flags.device))
        self._pending = False
        self._kept_grads.clear()

    def close(self):
        self._hook.remove()
