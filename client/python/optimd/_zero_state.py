"""ZeRO-sharded state (shard_state=True) in torch's format.

Each rank's daemon session keeps the state of its own contiguous part of
each group's flat element space (core/state_shard.h: the group's tensors,
frozen and empty ones included, laid end to end; rank r of N owns elements
[T*r//N, T*(r+1)//N)). As torch's ZeroRedundancyOptimizer does, the whole
state is put together on one rank by a collective, `consolidate_state_dict
(to)`, and a full state dict given to `load_state_dict` on every rank is cut
into the parts each rank's session keeps (optimd._state.set_state_request
with `ranges`).
"""
import torch


def part_ranges(tensors, rank, world_size):
    """(begin, end) of the elements of each of `tensors` (a group's, in
    registration order: objects with `numel`) that `rank` keeps state for;
    begin == end where it keeps none."""
    total = sum(s.numel for s in tensors)
    lo, hi = total * rank // world_size, total * (rank + 1) // world_size
    ranges, start = [], 0
    for s in tensors:
        b, e = max(start, lo), min(start + s.numel, hi)
        ranges.append((b - start, e - start) if b < e else (0, 0))
        start += s.numel
    return ranges


def local_parts(groups, daemon_groups, blob_tensor):
    """This rank's parts, as plain data that pickles small: per group (in
    `groups` order) a list per tensor of (own step, {kind: 1-D part}) or
    None for a frozen tensor or one without a part here. `daemon_groups`:
    the GetState reply's groups by id."""
    out = []
    for g in groups:
        by_name = {}
        for t in daemon_groups[g["id"]].tensors:
            by_name.setdefault(t.tensor, {})[t.kind] = t
        parts = []
        for s in g["tensors"]:
            blobs = by_name.get(s.name, {})
            if s.frozen or not blobs or not next(iter(blobs.values())).numel:
                parts.append(None)
                continue
            own = next(iter(blobs.values())).step
            parts.append((own, {k: blob_tensor(t) for k, t in blobs.items()}))
        out.append(parts)
    return out


def assemble(groups, every_rank, world_size, make_entry):
    """{param: torch-format entry} from every rank's `local_parts` (in rank
    order). A tensor's parts are joined in rank order into its whole
    memory-order buffer; `make_entry(s, own_step, {kind: flat})` gives its
    entry, or None (never stepped)."""
    out = {}
    for gi, g in enumerate(groups):
        ranges = [part_ranges(g["tensors"], r, world_size)
                  for r in range(world_size)]
        for ti, s in enumerate(g["tensors"]):
            if s.frozen or not s.numel:
                continue
            pieces = [(ranges[r][ti], every_rank[r][gi][ti])
                      for r in range(world_size)
                      if every_rank[r][gi][ti] is not None]
            if not pieces:
                continue
            own = pieces[0][1][0]
            flats = {}
            for kind in pieces[0][1][1]:
                flat = torch.cat([part[1][kind] for _, part in pieces])
                if flat.numel() != s.numel:
                    raise RuntimeError(
                        "optimd.torch: the ranks' parts of %s hold %d of its "
                        "%d elements; were the ranks' parameters registered "
                        "alike?" % (s.name, flat.numel(), s.numel))
                flats[kind] = flat
            entry = make_entry(s, own, flats)
            if entry is not None:
                out[s.param] = entry
    return out

