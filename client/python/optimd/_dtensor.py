"""DTensor parameters (FSDP2's fully_shard): the daemon steps each rank's
local shard where FSDP2 keeps it.

FSDP2 gives each parameter a DTensor whose local tensor is a view of its
own sharded buffer, the one it all-gathers from before each forward, so
an update must land in that memory: the parameter cannot be re-homed into
a segment of ours as other parameters on the CPU are.

* CUDA: the local shard is registered where it is (a CUDA IPC handle of
  its allocation, as gradients are), and the daemon writes it in place.
* CPU: the daemon reads and writes shared memory only, so the shard is
  mirrored: copied into its view of the group's shared segment before each
  step and back after it (and after anything else the daemon writes
  parameters with: a resume, a load, masters set).

Gradients are DTensors too; their local tensors are what the daemon reads.
State handed out (optimizer.state, state_dict()) is made of DTensors of
the parameter's mesh and placements, as torch's own optimizer state of a
DTensor parameter is, so torch.distributed.checkpoint can reshard it.
"""


def is_dtensor(t):
    return type(t).__name__ == "DTensor"


def local_of(t):
    """The tensor whose memory holds `t`'s elements on this rank: a
    DTensor's local shard, any other tensor itself (None stays None)."""
    if t is not None and is_dtensor(t):
        return t._local_tensor
    return t


def like_param(value, p):
    """`value` (a local tensor shaped as p's shard) as p holds it: a DTensor
    of p's mesh and placements for a DTensor p, else `value` itself."""
    if not is_dtensor(p):
        return value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value, p.device_mesh, p.placements,
                              run_check=False, shape=p.shape,
                              stride=p.stride())


def check_mesh(p, name, world_size):
    """Refuses a DTensor parameter optimd cannot clip and skip by the job's
    norm: only a one-dimensional mesh over every rank of the job, whose
    shards are disjoint (Shard placements; FSDP2's default), is taken."""
    mesh = p.device_mesh
    if mesh.ndim != 1 or mesh.size() != world_size or any(
            not pl.is_shard() for pl in p.placements):
        raise NotImplementedError(
            "optimd.torch: parameter %s is a DTensor on a %d-D mesh of %d "
            "ranks with placements %s; optimd.torch steps DTensors sharded "
            "over one mesh dimension covering all %d ranks of the job "
            "(FSDP2's fully_shard over the default group), not replicated "
            "or hybrid (HSDP) placements" % (name, mesh.ndim, mesh.size(),
                                             tuple(p.placements), world_size))


def any_sharded(params):
    """Whether any of `params` is a DTensor shard (the job's ranks then
    hold disjoint parts of the gradients)."""
    return any(is_dtensor(p) for p in params)


def chunk_extent(size, parts, index):
    """(first index, length) of part `index` when `size` elements are split
    into `parts` as torch.chunk splits them (FSDP2's sharding): parts of
    ceil(size / parts) elements, the last ones shorter or empty."""
    part = -(-size // parts)
    begin = min(index * part, size)
    return begin, min(part, size - begin)


def shard_place(p, mem):
    """(whole shape, offset of the local shard's first element) of a
    DTensor `p` whose local shard is `mem`, for TensorSpec.global_shape and
    global_offset (checkpoints keep them, optimd.checkpoint.merge_shards
    puts the ranks' shards together); None for any other tensor, or a
    shard whose extent is not torch.chunk's (then it is saved without)."""
    if not is_dtensor(p) or p.dim() == 0:
        return None
    shape, offset = list(p.shape), [0] * p.dim()
    mesh = p.device_mesh
    for placement in p.placements:
        dim = placement.dim
        offset[dim], length = chunk_extent(shape[dim], mesh.size(),
                                           mesh.get_local_rank())
        if length != mem.shape[dim]:
            return None
    return shape, offset
