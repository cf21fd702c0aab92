"""The state dicts of the optimd.torch optimizers (a mixin of
_DaemonOptimizer): optimizer.state and state_dict() in torch's format,
fetched from the daemon; load_state_dict(); ZeRO-sharded state put together
(consolidate_state_dict) and taken apart (_zero_state.py); edits of
param_groups that need the group registered anew with its state.
"""
import copy
import functools
import weakref

import torch

from optimd._dtensor import like_param
from optimd._layout import view_like
from optimd import _zero_state, errors
from optimd._state import (DAEMON_KEYS, DTYPES, set_state_request,
                           step_tensor)

_TORCH_DTYPES = {v: k for k, v in DTYPES.items()}


@functools.lru_cache(maxsize=None)
def _torch_load_fills(cls):
    """The keys the installed torch's optimizer `cls` gives a loaded param
    group that lacks them, with their values: its __setstate__'s defaults
    for options older torch versions did not save (maximize, foreach,
    ...). A probe of torch's own class (None: no such class, nothing)."""
    if cls is None:
        return {}
    # lr: required by some torch versions' SGD; the load drops it.
    opt = cls([torch.zeros(1, requires_grad=True)], lr=0.01)
    opt.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


class StateDicts:
    """State dicts of a _DaemonOptimizer, whose attributes they use."""

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
        # By parameter: param_groups may be out of step with the
        # registrations here (groups taken out, their state being kept).
        fused = {id(p) for group in self.param_groups if group.get("fused")
                 for p in group["params"]}
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
                    kind: _blob_tensor(t) for kind, t in mine.items()},
                    id(s.param) in fused)
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
        sizes = {s.name: s.numel * 4 * max(4, s.mem.element_size())
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

    def _state_entry(self, s, own, flats, fused=False):
        """Tensor `s`'s torch-format entry from its own step count and its
        state buffers ({kind: 1-D in memory order}); None when it was never
        stepped (torch has no state for it then). `fused`: its group's
        fused=True, whose step torch keeps on the parameter's device."""
        if own == 0 and s.numel:
            return None
        device = s.param.device if fused else None
        # A loaded step of another dtype (an int64 count) keeps it, as
        # torch's load leaves the step of a group without fused or
        # capturable as it was, and its steps add to it in place.
        kept = None if fused else self.__dict__.get(
            "_loaded_step_dtypes", {}).get(id(s.param))
        dtype = kept[1] if kept is not None and kept[0]() is s.param else None
        entry = {"step": step_tensor(own, device, dtype)} \
            if self._state_has_step else {}
        for kind, flat in flats.items():
            # fp32 and float64 parameters need no master in torch's format.
            if kind == "master" and s.mem.dtype in (torch.float32,
                                                    torch.float64):
                continue
            entry[kind] = like_param(view_like(flat, s.mem).to(s.mem.device),
                                     s.param)
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
        """torch.distributed, through whose default group the ranks of a
        shard_state job exchange their parts (`what` needs it): its ranks
        must be the job's."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "optimd.torch: with shard_state=True %s needs the ranks to "
                "exchange their parts through torch.distributed, which is "
                "not initialized" % what)
        mine = (self._identity["rank"], self._world_size)
        if (dist.get_rank(), dist.get_world_size()) != mine:
            raise RuntimeError(
                "optimd.torch: with shard_state=True %s exchanges the ranks' "
                "parts through torch.distributed's default group, where this "
                "process is rank %d of %d; the optimizer is rank %d of %d "
                "(rank=, world_size=): they must be the same" %
                ((what, dist.get_rank(), dist.get_world_size()) + mine))
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
        # torch 2's state-dict hooks (register_state_dict_pre_hook and
        # _post_hook), called as torch's state_dict calls them.
        for hook in _hooks(self, "_optimizer_state_dict_pre_hooks"):
            hook(self)
        # Masters as the trainer's parameters now are (their writes).
        self._follow_written_params()
        if self._shard_state:
            state_dict = dict(self._consolidated_state())
        else:
            # Writes to optimizer.state first, as torch's state_dict
            # shows them.
            self._write_back_state()
            self._sync_params(follow_layout=False)
            state_dict = self._state_dict()
        for hook in _hooks(self, "_optimizer_state_dict_post_hooks"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _consolidated_state(self):
        """shard_state: as torch's ZeroRedundancyOptimizer, the last whole
        state put together on this rank."""
        if self._consolidated is None:
            raise RuntimeError(
                "optimd.torch: with shard_state=True the optimizer state is "
                "not put together on this rank (rank %d); call "
                "consolidate_state_dict(to=%d) on every rank first if you "
                "meant to save the whole state" % (
                    self._identity["rank"], self._identity["rank"]))
        return self._consolidated

    def _state_dict(self):
        return self._pack_state_dict(self._whole_state())

    def _whole_state(self):
        """{param: entry} as state_dict() packs it: the daemon's state,
        that of parameters out of their group, and the trainer's own keys
        in optimizer.state."""
        return self.state.with_extras(self._fetch_state())

    def _pack_state_dict(self, state):
        """torch's state-dict format of {param: entry}: parameters by their
        index across param_groups."""
        index = {}
        groups = []
        for group in self.param_groups:
            packed = {k: _plain(v) if k == self._state_dtype_key else v
                      for k, v in group.items() if k != "params"}
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            packed["params"] = ids
            groups.append(packed)
        # A key that is no parameter is packed as it is, as torch does.
        packed_state = {index[id(p)] if isinstance(p, torch.Tensor) else p: v
                        for p, v in state.items()}
        return {"state": packed_state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        # torch 2's load hooks: a pre-hook gets a shallow copy and may
        # return the state dict to load; post-hooks run after the load.
        state_dict = dict(state_dict)
        for hook in _hooks(self, "_optimizer_load_state_dict_pre_hooks"):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        # The groups a copy, as torch's load takes one: they share no value
        # (a list, a tensor lr filled in place) with the state dict given.
        # Loads of our own (a move to another device) keep the values.
        groups = copy.deepcopy(state_dict["param_groups"])
        self._as_torch_loads(groups)
        self._load_state_dict(dict(state_dict, param_groups=groups))
        for hook in _hooks(self, "_optimizer_load_state_dict_post_hooks"):
            hook(self)

    def _as_torch_loads(self, groups):
        """Changes loaded `groups` (copies) as the installed torch's
        optimizer of the same class changes them in its load (an
        optimizer whose torch class does so overrides this)."""

    def _load_state_dict(self, state_dict):
        # Parameters edited or materialized (a lazy module's, by the
        # model's own load_state_dict) are registered before their state.
        self._sync_structure()
        self._sync_params(follow_layout=False)
        from optimd._several_devices import SeveralDevices
        if isinstance(self, SeveralDevices):
            # The parameters spread over devices just now: the optimizer
            # loads as one over several (_several_devices.py).
            return self._load_state_dict(state_dict)
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
        _check_state_shapes(groups, saved, saved_state, self._slot_names)
        _check_steps(saved, saved_state)
        if self._every_slot_needed:
            _check_state_complete(groups, saved, saved_state,
                                  self._slot_names, self._counts_steps)
        self._take_saved_groups(groups, saved)
        masters = False
        for gi, (g, sg, mine) in enumerate(zip(groups, saved, self._groups)):
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
            self._mirror_out()
        self._sent_hyper = None  # the next step sends them all again
        # New state, as torch's load makes new tensors: what was handed out
        # before is let go.
        self.state.invalidate(follow=False)
        self._loaded_step_dtypes = _loaded_step_dtypes(groups, saved,
                                                       saved_state)
        # Keys the daemon does not keep (a library's own), kept as torch's
        # load keeps every key; None is no state (SGD's momentum_buffer
        # without momentum: the installed torch's entry says what it is).
        extras = {
            p: {k: v for k, v in (saved_state.get(pid) or {}).items()
                if v is not None and
                k not in self._slot_names(g) + ("step", "master")}
            for g, sg in zip(groups, saved)
            for p, pid in zip(g["params"], sg["params"])}
        # An entry of a key no group holds stays whole under that key, as
        # torch's load keeps it (and its state_dict gives it back).
        held = {pid for sg in saved for pid in sg["params"]}
        extras.update({k: dict(e) for k, e in saved_state.items()
                       if k not in held and e})
        self.state.set_extras(extras)

    def _take_saved_groups(self, groups, saved):
        """Each group becomes the saved one, as torch's load_state_dict
        replaces it, and one whose layout (_layout_of) changed with it is
        registered anew. Refused for any group, every group gets its keys
        and registration (with its state) back, and the refusal is
        raised."""
        # (gi, keys before, registration before and state entries where
        # this load registered the group anew)
        taken = []
        state = None
        self._write_back_state()  # kept if the load is refused
        try:
            for gi, (g, sg, mine) in enumerate(zip(groups, saved,
                                                   self._groups)):
                taken.append((gi, dict(g), None, None))
                self._take_saved_keys(gi, g, sg)
                if self._layout_of(g) == mine["snapshot"]:
                    continue
                self._check_storage(gi, g)
                if state is None and not self._shard_state:
                    self.state.invalidate()
                    state = self._whole_state()
                entries = None if state is None else [
                    _daemon_keys(state.get(s.param)) for s in mine["tensors"]]
                was = self._reregister(gi, g, mine, restore=entries)
                taken[-1] = (gi, taken[-1][1], was, entries)
        except Exception:
            for gi, keys, was, entries in reversed(taken):
                groups[gi].clear()
                groups[gi].update(keys)
                if was is not None:
                    self._restore_registration(gi, groups[gi], was,
                                               entries)
            raise

    def _restore_registration(self, gi, group, was, entries):
        """Registration `gi` made again as it was (`was`: its request,
        snapshot and slots then) over its tensors where they are now, with
        `entries` as its state (None under shard_state: not restored)."""
        mine = self._groups[gi]
        old = self._request_as_was(gi, group, mine, was)
        self._client.unregister_group(mine["id"])
        self._register_as(mine, dict(was, request=old), entries)

    def _request_as_was(self, gi, group, mine, was):
        """`was`'s layout and hyperparameters over the tensors where they
        are now: moved or swapped since, or their memory's chunks sent to
        the daemon anew (expandable segments), whose old ids the daemon no
        longer holds."""
        seg_p = mine["segments"][0]
        tensors = list(zip(mine["tensors"], _param_offsets(mine)))
        old = self._group_request(gi, group, tensors, seg_p)
        old.layout.CopyFrom(was["request"].layout)
        old.hyperparameters.CopyFrom(was["request"].hyperparameters)
        return old

    def _register_as(self, mine, record, entries):
        """Registers group `mine`, of which the daemon holds no
        registration now, as `record` (its request, snapshot and slots),
        with `entries` as its state (None: the caller's to write). Every
        gradient is then absent to the daemon, and the next step sends
        every hyperparameter (a scheduler's lr among them) again."""
        self._client.register_group(record["request"])
        mine.update(record)
        for s in mine["tensors"]:
            s.sent_ptr = 0
        self._sent_hyper = None
        self._index_buffers()
        if entries is not None:
            self._client.set_state(set_state_request(
                mine["id"], mine["tensors"], entries,
                slot_names=mine["slots"]))

    def _take_saved_keys(self, gi, g, sg):
        """Group g takes saved group sg's keys: a key sg lacks goes (a
        scheduler's initial_lr, say), but for the options torch fills in
        on a load (an older torch's state dict lacks maximize, say), which
        take torch's values as torch's optimizer does, the other
        constructor options, which take their constructor values (optimd's
        own; where torch's step would raise KeyError for one of its own),
        and the parameters' names, which stay as torch keeps them."""
        fills = _torch_load_fills(type(self)._torch_class)
        for k in [k for k in g if k not in sg and
                  k not in ("params", "param_names")]:
            if k in fills:
                g[k] = fills[k]
            elif k in self.defaults:
                g[k] = self.defaults[k]
            else:
                del g[k]
        for k, v in sg.items():
            if k != "params":
                g[k] = _unplain(v) if k == self._state_dtype_key else v
        self._reconcile_group(gi, g)

    def _reregister(self, gi, group, mine, restore):
        """New hyperparameters that steps do not carry (_layout_of): the
        group is registered afresh over the same buffers (its state is the
        caller's to write). Where the daemon refuses the new registration
        (one _check_storage does not foresee), the old one is made again
        with `restore` (its tensors' state entries; None under
        shard_state, where each rank holds a part only and its state is
        not restored) and the refusal raised. Returns the registration's
        record before (its request, snapshot and slots)."""
        seg_p = mine["segments"][0]
        tensors = list(zip(mine["tensors"], _param_offsets(mine)))
        request = self._group_request(gi, group, tensors, seg_p)
        was = {k: mine[k] for k in ("request", "snapshot", "slots")}
        self._client.unregister_group(mine["id"])
        try:
            self._register_as(mine, dict(
                request=request, snapshot=self._layout_of(group),
                slots=self._slot_names(group)), None)
        except errors.OptimdError:
            old = self._request_as_was(gi, group, mine, was)
            self._register_as(mine, dict(was, request=old), restore)
            raise
        return was

    def _refuse_with_shard_state(self, what):
        """shard_state: `what`, which carries the state over through a state
        dict, raises (each rank's session holds only its part)."""
        if self._shard_state:
            raise NotImplementedError(
                "optimd.torch: with shard_state=True %s is not supported: "
                "each rank's session holds only its part of the state, which "
                "the change would have to carry over; make the change before "
                "creating the optimizer" % what)

    def _follow_layout_keys(self, gi, group, mine):
        """Hyperparameters that steps do not carry (_layout_of) edited in
        param_groups: followed as torch does, keeping the state."""
        now = self._layout_of(group)
        self._refuse_with_shard_state(
            "changing param_groups[%d]'s %s" % (gi, ", ".join(
                k for k in sorted(now) if now[k] != mine["snapshot"].get(k))))
        # Taken with the trainer's own keys, among them slots the group
        # no longer stepped with (below): one in use again comes back.
        self.state.invalidate()
        state = self._whole_state()
        tensors_state = [_daemon_keys(state.get(s.param))
                         for s in mine["tensors"]]
        self._check_storage(gi, group)
        self._check_layout_change(gi, group, mine["snapshot"], tensors_state)
        was = set(mine["slots"])
        self._reregister(gi, group, mine, restore=tensors_state)
        self._client.set_state(set_state_request(
            mine["id"], mine["tensors"], tensors_state,
            slot_names=self._slot_names(group)))
        self.state.invalidate()
        # torch's step leaves a slot it no longer uses in the state
        # (momentum_buffer once SGD's momentum is 0, max_exp_avg_sq once
        # amsgrad is off), and uses it again when it is turned back on;
        # the daemon keeps only the slots it steps with, so such a slot is
        # kept here meanwhile, as a key of the trainer's is.
        now = set(mine["slots"])
        self.state.move_extras(
            {s.param: {k: e[k] for k in was - now if e.get(k) is not None}
             for s, e in zip(mine["tensors"], tensors_state) if e},
            taken=now - was)

    def _write_back_state(self):
        """Writes to optimizer.state since it was fetched (an entry zeroed,
        replaced or removed, state.clear()) reach the daemon before a step,
        as they would take effect in torch."""
        written = self.state.written()
        if written is None:
            return
        registered = {id(s.param) for g in self._groups for s in g["tensors"]}
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in registered and written.get(p):
                    # Not registered yet (appended since the last step, or
                    # lazy): kept for its registration, as a parameter out
                    # of its group keeps its state.
                    self._retired[id(p)] = (weakref.ref(p), written[p])
        for g in self._groups:
            # In the slots the group is registered with: an edit of
            # param_groups that changes them (amsgrad, momentum) is followed
            # after this, carrying the written state over.
            self._client.set_state(set_state_request(
                g["id"], g["tensors"], [written.get(s.param) for s in
                                      g["tensors"]],
                slot_names=g["slots"]))
        self.state.invalidate()

    def _refuse_incomplete_state(self):
        """Before a step: raises, writing nothing, when an entry written
        into optimizer.state has a step or a moment but lacks another (a
        key deleted, a step set alone). torch's step raises KeyError on
        it; the daemon would start the missing ones afresh under the
        entry's step. The entry stays written, so every step raises until
        it is made whole or emptied (opt.state[p] = {} starts it afresh,
        as in torch). Other writers of the state (state_dict(), saves,
        loads) take it as it is, as torch's do."""
        written = self.state.written() if self._every_slot_needed else None
        if not written:
            return
        for g in self._groups:
            for s in g["tensors"]:
                has, missing = _incomplete(written.get(s.param), g["slots"],
                                           self._counts_steps)
                if missing:
                    where = next(((gi, pi) for gi, group in enumerate(
                        self.param_groups) for pi, p in enumerate(
                            group["params"]) if p is s.param), ("?", "?"))
                    raise errors.MissingStateError(
                        "optimd.torch: optimizer.state of param_groups[%s]"
                        "['params'][%s] has %s but no %s (torch's step "
                        "raises KeyError); give it the missing keys, or set "
                        "opt.state[p] = {} to start its state afresh" % (
                            where + (", ".join(map(repr, has)),
                                     ", ".join(map(repr, missing)))))


def _daemon_keys(entry):
    """The keys of a state entry that the daemon keeps (the trainer's own
    left out); None for none."""
    entry = {k: v for k, v in (entry or {}).items() if k in DAEMON_KEYS}
    return entry or None


def _hooks(opt, table):
    """The hooks registered in torch 2's `table` of `opt` (none in torch
    1.13, which has no such tables)."""
    return list(getattr(opt, table, {}).values())


def _plain(v):
    """The moments' dtype (the group's exp_avg_dtype or state_dtype) as a
    state dict holds it: a torch.dtype by its name, "torch.bfloat16",
    since torch.distributed.checkpoint's state-dict helpers take tensors,
    numbers, strings and containers of them only. The trainer's own keys
    stay as they are, as torch keeps them."""
    return str(v) if isinstance(v, torch.dtype) else v


def _unplain(v):
    """_plain's inverse: a dtype's name back to the torch.dtype."""
    if isinstance(v, str) and v.startswith("torch."):
        dtype = getattr(torch, v[len("torch."):], None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return v


def _saved_slots(group, saved_group, slot_names):
    """The state slots `group` steps with once it takes the keys of the
    saved group (its amsgrad, momentum, ...): slot_names of the two
    merged."""
    return slot_names(dict(group, **{k: v for k, v in saved_group.items()
                                     if k != "params"}))


def _check_state_shapes(groups, saved, saved_state, slot_names):
    """Raises before anything is loaded when a saved state slot is not of
    its parameter's shape (a state dict of another model): torch's load
    takes it and its next step fails on the shapes; the daemon would take
    the elements in memory order, silently. `slot_names(group)`: the slots
    of a group with the saved group's keys. Other keys (a step, the
    trainer's own) and lazy parameters are not checked."""
    for g, sg in zip(groups, saved):
        slots = set(_saved_slots(g, sg, slot_names)) | {"master"}
        for p, pid in zip(g["params"], sg["params"]):
            if torch.nn.parameter.is_lazy(p):
                continue
            for key, value in (saved_state.get(pid) or {}).items():
                if key in slots and isinstance(value, torch.Tensor) and \
                        tuple(value.shape) != tuple(p.shape):
                    raise RuntimeError(
                        "optimd.torch: the loaded state's %r of parameter "
                        "%d has shape %s; the parameter is %s. Load a state "
                        "dict saved for this model (torch's step would "
                        "fail on the shapes)" % (key, pid, tuple(value.shape),
                                                 tuple(p.shape)))


def _loaded_step_dtypes(groups, saved, saved_state):
    """{id(param): (weak param, dtype)} of the loaded steps whose dtype is
    not the one a step of this client's gets (step_tensor), in groups
    without fused or capturable (whose steps torch makes float32)."""
    default = step_tensor(0).dtype
    out = {}
    for g, sg in zip(groups, saved):
        if g.get("fused") or g.get("capturable"):
            continue
        for p, pid in zip(g["params"], sg["params"]):
            step = (saved_state.get(pid) or {}).get("step")
            if isinstance(step, torch.Tensor) and step.dtype != default:
                out[id(p)] = (weakref.ref(p), step.dtype)
    return out


def _check_steps(saved, saved_state):
    """Raises before anything is loaded when a saved entry's "step" is not
    a count the daemon keeps: a whole number from 0 to 2**53 (torch takes
    any float and corrects its bias by it; the daemon counts whole steps,
    and would take 3.7 as 3, silently)."""
    for sg in saved:
        for pid in sg["params"]:
            step = (saved_state.get(pid) or {}).get("step")
            if step is None:
                continue
            value = float(step)
            if not (0 <= value <= 2.0 ** 53 and value == int(value)):
                raise ValueError(
                    "optimd.torch: the loaded state of parameter %d has step "
                    "%r; optimd counts whole steps from 0 to 2**53 (give the "
                    "step count the state was saved at)" % (pid, value))


def _check_state_complete(groups, saved, saved_state, slot_names,
                          counts_steps):
    """Raises before anything is loaded when a saved entry has state (a
    step or a slot) but lacks a slot its group steps with (exp_avg_sq
    left out, say): torch's load takes it and its next step fails
    (KeyError); the daemon would start the slot at zero under the saved
    step count, silently. An entry without state starts afresh, as in
    torch."""
    for g, sg in zip(groups, saved):
        slots = _saved_slots(g, sg, slot_names)
        for pid in sg["params"]:
            has, missing = _incomplete(saved_state.get(pid), slots,
                                       counts_steps)
            if missing:
                raise errors.MissingStateError(
                    "optimd.torch: the loaded state of parameter %d has %s "
                    "but no %s (torch's next step would fail: KeyError); "
                    "load a complete state dict, or leave the parameter's "
                    "entry out to start its state afresh" % (
                        pid, ", ".join(map(repr, has)),
                        ", ".join(map(repr, missing))))


def _incomplete(entry, slots, counts_steps):
    """(the keys it has, the keys it lacks) of a state entry that has one
    of `slots` or a step but not all of them (the step only where
    `counts_steps`; torch's step reads each: KeyError); ([], []) for a
    complete or an empty entry."""
    entry = {k: v for k, v in (entry or {}).items() if v is not None}
    # A step is wanted where the optimizer counts them; elsewhere one given
    # is state that lacks its slots all the same.
    step = ("step",) if counts_steps or "step" in entry else ()
    wanted = step + tuple(slots)
    has = [k for k in wanted if k in entry]
    missing = [k for k in wanted if k not in entry]
    return (has, missing) if has and missing else ([], [])


def _blob_tensor(t):
    dtype = _TORCH_DTYPES[t.dtype]
    if t.numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(t.data), dtype=dtype).clone()


def _param_offsets(group):
    seg_p = group["segments"][0]
    return [s.pview.data_ptr() - seg_p.base_ptr() if s.numel else 0
            for s in group["tensors"]]
