"""The identity of a job's ranks for the optimd.torch optimizers: rank and
world size from torch.distributed, the job id and NCCL unique id shared
through it, and closing a session when its optimizer goes.
"""
import os
import secrets
import socket

import torch

from optimd import _secrets, errors


def zero_sharding(shard_state, gradient_sharding, world_size):
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


def check_fsdp1_job(fsdp1, world_size, sharding_given, job_wide):
    """FSDP version 1 (`fsdp1`: some parameter is its) over several ranks:
    each rank holds a shard of every flat gradient (FULL_SHARD,
    SHARD_GRAD_OP) or all of it (NO_SHARD), which the parameters do not
    tell. A norm to clip by and a skip (`job_wide`: max_grad_norm or
    skip_nonfinite) are the job's only when gradient_sharding says which
    (`sharding_given`); without it each rank would clip by its own shard's
    norm, so it raises."""
    if not fsdp1 or world_size < 2 or sharding_given or not job_wide:
        return
    raise ValueError(
        "optimd.torch: FSDP version 1 over %d ranks with max_grad_norm or "
        "skip_nonfinite needs gradient_sharding, so that the norm and the "
        "skip are the job's: gradient_sharding='sharded' for FULL_SHARD "
        "and SHARD_GRAD_OP, 'replicated' for NO_SHARD; otherwise (and for "
        "HYBRID_SHARD) clip in the trainer with model.clip_grad_norm_, "
        "FSDP's own" % world_size)


def dist_identity(rank, world_size):
    """rank and world_size as given, else torch.distributed's when it is
    initialized, else 0 and 1."""
    initialized = torch.distributed.is_available() and \
        torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if initialized else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if initialized else 1
    return rank, world_size


def shared_job_id():
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


def shared_nccl_id(mine):
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


def close_session(client, job, rank):
    """Closes an optimizer's session and channel, and forgets its resume
    secret once the session is really closed (not when the daemon is gone
    or another trainer has taken the session over: a resume may still need
    it); at interpreter exit a daemon already gone is no error worth
    raising. Nothing in a forked child (its exit would close the parent's
    session through the parent's connection)."""
    if not client.owned_here:
        return
    try:
        if client.token:
            client.close_session()
            _secrets.remove(job, rank)
    except errors.OptimdError:
        pass
    finally:
        client.close()
