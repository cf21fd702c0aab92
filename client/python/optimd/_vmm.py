"""torch's memory under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
shared with the daemon where it is.

Expandable segments are made with cuMemCreate and mapped with cuMemMap, so
CUDA IPC handles cannot share them; the driver shares each physical chunk
(2 MiB for small blocks, 20 MiB for large ones) as a POSIX file
descriptor instead (torch asks for that handle type). The client sends
each chunk's descriptor once, under a random 16-byte id, over the daemon's
descriptor socket (`<socket>.fds`, SCM_RIGHTS), and names a buffer by the
ids of the chunks under it (BufferHandle.cuda_vmm); the daemon maps them
one after the other, as the trainer does.

A chunk stays the daemon's to map while this client's connection lasts.
torch unmaps chunks only of free memory (empty_cache, or when an
allocation fails and it frees its cache), and may then map a new chunk at
the same address: a gradient at the same pointer would then be in other
memory than the daemon maps. So at each step, and before it names any
other buffer, the client looks at torch's counts of device maps and
releases (num_device_alloc, num_device_free, and how many times they were
reset); when they moved, it forgets every chunk (a new connection: the
daemon drops the old descriptors once the steps sent before are answered)
and sends every gradient anew. Between two such looks a known chunk is found
without a driver call. Memory that is not cuMemCreate's (a CUDA graph's
private pool) raises NotVmmMemory, and goes by CUDA IPC instead.
Parameters are live memory, which torch never unmaps.
"""
import bisect
import ctypes
import os
import socket
import struct

import torch

from optimd import cuda_ipc
from optimd.client import unix_socket_path
from optimd.v1 import optimd_pb2 as pb

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_MAX_BATCH = 64  # descriptors per message (the daemon's bound)
_REPLY_TIMEOUT_S = 60
_REPLIES = {1: "refused the message", 2: "holds too many descriptors"}


def descriptor_socket_path(address):
    """The daemon's descriptor socket for gRPC address `address`, or None
    where descriptors cannot travel (TCP)."""
    path = unix_socket_path(address)
    return None if path is None else path + ".fds"


def _driver():
    _, driver = cuda_ipc._libs()
    return driver


class NotVmmMemory(RuntimeError):
    """Memory not made with cuMemCreate (cudaMalloc's: a CUDA graph's
    private pool, another library's), which CUDA IPC shares instead."""


def _export(address):
    """A POSIX descriptor of the physical chunk mapped at `address`."""
    driver = _driver()
    handle = ctypes.c_uint64()
    err = driver.cuMemRetainAllocationHandle(ctypes.byref(handle),
                                             ctypes.c_void_p(address))
    if err != 0:
        raise NotVmmMemory(
            "cuMemRetainAllocationHandle failed with CUDA driver error %d "
            "(memory not made with cuMemCreate)" % err)
    fd = ctypes.c_int(-1)
    try:
        err = driver.cuMemExportToShareableHandle(
            ctypes.byref(fd), handle, _POSIX_FD, ctypes.c_uint64(0))
    finally:
        driver.cuMemRelease(handle)
    if err != 0:
        raise RuntimeError(
            "cuMemExportToShareableHandle failed with CUDA driver error %d "
            "(memory made without the POSIX descriptor handle type)" % err)
    return fd.value


# Resets of torch's accumulated allocator stats in this process
# (torch.cuda.reset_accumulated_memory_stats). A reset zeroes the counts the
# release checks compare, so that a release and then a reset could read as
# no change: every count of device_releases and _grads.segments_freed
# carries this one too.
_stat_resets = 0


def _counting(reset):
    def counted(*args, **kwargs):
        global _stat_resets
        _stat_resets += 1
        return reset(*args, **kwargs)

    counted.uncounted = reset
    return counted


def _count_stat_resets():
    """Puts a counter in front of torch's reset of the accumulated stats,
    which torch.cuda.reset_accumulated_memory_stats looks up on torch._C at
    each call. Once per process."""
    reset = getattr(torch._C, "_cuda_resetAccumulatedMemoryStats", None)
    if reset is not None and not hasattr(reset, "uncounted"):
        torch._C._cuda_resetAccumulatedMemoryStats = _counting(reset)


_count_stat_resets()


def release_counts(device, keys, every_key):
    """torch's caching allocator's counters `keys` on `device`, then how
    many times they were reset (_stat_resets), as a tuple compared from
    step to step: any change is a release. None where torch keeps no stats
    (a pluggable allocator), or lacks any of `keys` (`every_key`) or all of
    them."""
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    if stats is None:
        return None
    try:
        got = stats(cuda_ipc.device_index(device))
    except RuntimeError:  # an allocator that keeps no stats (pluggable)
        return None
    counts = tuple(got.get(key) for key in keys)
    kept = [c is not None for c in counts]
    if not (all(kept) if every_key else any(kept)):
        return None
    return counts + (_stat_resets,)


def device_releases(device):
    """torch's counts of device memory maps and releases (unmaps of
    expandable segments among them) on `device` and of their resets
    (release_counts), or None where torch does not keep them."""
    return release_counts(device, ("num_device_alloc", "num_device_free"),
                          every_key=True)


def close_channels(channels):
    """Closes descriptor connections (a sharer's retired ones)."""
    for channel in channels:
        channel.close()


class DescriptorChannel:
    """A connection to the daemon's descriptor socket: each message is
    b"OFD1", a little-endian uint32 count n (at most 64), n 16-byte ids,
    and n descriptors (SCM_RIGHTS); the daemon answers each with one byte
    (0: kept until this connection ends)."""

    def __init__(self, path):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The daemon answers at once; a stopped one must not hang a step.
        self._sock.settimeout(_REPLY_TIMEOUT_S)
        try:
            self._sock.connect(path)
        except OSError:
            self._sock.close()
            raise

    def send(self, batch):
        """Sends [(16-byte id, descriptor)], still the caller's to
        close."""
        for at in range(0, len(batch), _MAX_BATCH):
            part = batch[at:at + _MAX_BATCH]
            payload = b"OFD1" + struct.pack("<I", len(part)) + b"".join(
                i for i, _ in part)
            socket.send_fds(self._sock, [payload], [fd for _, fd in part])
            reply = self._sock.recv(1)
            if reply != b"\0":
                code = reply[0] if reply else None
                raise RuntimeError("the daemon's descriptor socket %s %s" % (
                    self.path, _REPLIES.get(code, "closed the connection")))

    def close(self):
        self._sock.close()


class VmmSharer:
    """One optimizer's chunks of torch memory shared with the daemon."""

    def __init__(self, path, device):
        self._path = path
        self.device = device
        self._channel = None
        self._chunks = {}  # the chunk's address here -> (id, size)
        self._bases = []  # the chunks' addresses, sorted
        self._frees = device_releases(device)
        self.generation = 0
        # Connections of forgotten generations, still open: steps sent
        # before may name their ids, which the daemon resolves only when its
        # device worker reaches those steps (take_retired).
        self._retired = []

    @classmethod
    def open(cls, address, device):
        """A sharer for the daemon at `address`, or None where torch's
        memory cannot be shared this way (another allocator, an old
        torch, a TCP address, a daemon without a descriptor socket)."""
        path = descriptor_socket_path(address)
        if path is None:
            return None
        sharer = cls(path, device)
        if sharer._frees is None:
            return None
        probe = torch.empty(1, device=device)
        try:
            sharer.fill(pb.BufferHandle(), probe)
        except (OSError, RuntimeError):
            sharer.close()
            return None
        return sharer

    def fill(self, out, tensor, refreshed=False):
        """Sets BufferHandle `out` to where `tensor` is; `refreshed`: the
        caller has just called refresh() (GradRouter, once a step)."""
        if not refreshed:
            self.refresh()
        start = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        chunks = self._chunks_of(start, max(nbytes, 1), tensor.device)
        vmm = out.cuda_vmm
        vmm.device = tensor.device.index or 0
        for _, (fd_id, size) in chunks:
            vmm.chunks.add(fd_id=fd_id, size=size)
        vmm.offset = start - chunks[0][0]
        vmm.size = nbytes

    def _known(self, address):
        """(base, (id, size)) of the known chunk holding `address`, or
        None (no driver call: nothing was unmapped since it was seen)."""
        i = bisect.bisect_right(self._bases, address) - 1
        if i >= 0:
            base = self._bases[i]
            entry = self._chunks[base]
            if address < base + entry[1]:
                return base, entry
        return None

    def _chunks_of(self, start, nbytes, device):
        """[(address, (id, size))] of the chunks under [start, +nbytes),
        sending the daemon those it has not got."""
        out, fresh = [], []
        address, end = start, start + nbytes
        try:
            while address < end:
                known = self._known(address)
                if known is None:
                    with cuda_ipc.context_of(device):
                        base, size = cuda_ipc.address_range(address)
                        fresh.append((base, os.urandom(16), _export(base)))
                    known = base, (fresh[-1][1], size)
                out.append(known)
                address = known[0] + known[1][1]
            self._send([(i, fd) for _, i, fd in fresh])
        finally:
            for _, _, fd in fresh:
                os.close(fd)
        for base, entry in out:
            if base not in self._chunks:
                bisect.insort(self._bases, base)
            self._chunks[base] = entry
        return out

    def _send(self, batch):
        """Sends [(id, descriptor)]; on any failure every chunk is
        forgotten (a new generation) and the connection retired, so that
        the daemon and this client never disagree on which ids it holds."""
        if not batch:
            return
        try:
            if self._channel is None:
                self._channel = DescriptorChannel(self._path)
            self._channel.send(batch)
        except (OSError, RuntimeError):
            self._forget()
            raise

    def refresh(self):
        """The generation of the chunks known: it moves on when torch
        released device memory since the last look (every chunk is then
        forgotten, and its connection retired: the daemon drops their
        descriptors when it is closed), so that whoever sent buffers of an
        older generation sends them anew."""
        frees = device_releases(self.device)
        if frees != self._frees:
            self._frees = frees
            self._forget()
        return self.generation

    def take_retired(self):
        """The connections retired since the last call, for the caller to
        close once every step sent before them is answered."""
        retired, self._retired = self._retired, []
        return retired

    def forget_chunks(self):
        """Forgets every chunk (a new generation), retiring the connection
        (take_retired): the caller knows the daemon needs none of its
        chunks' descriptors any more."""
        self._forget()

    def _forget(self):
        """Forgets every chunk (a new generation); the connection is
        retired, not closed: steps sent may still name its ids."""
        self._chunks.clear()
        self._bases.clear()
        if self._channel is not None:
            self._retired.append(self._channel)
            self._channel = None
        self.generation += 1

    def close(self):
        self._forget()
        close_channels(self.take_retired())

