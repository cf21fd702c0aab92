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
memory than the daemon maps. So at each step the client looks at torch's
count of unmaps (num_device_free); when it moved, it forgets every chunk
(a new connection: the daemon drops the old descriptors) and sends every
gradient anew. Parameters are live memory, which torch never unmaps.
"""
import ctypes
import os
import socket
import struct

import torch

from optimd import cuda_ipc
from optimd.v1 import optimd_pb2 as pb

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_MAX_BATCH = 64  # descriptors per message (the daemon's bound)
_REPLIES = {1: "refused the message", 2: "holds too many descriptors"}


def descriptor_socket_path(address):
    """The daemon's descriptor socket for gRPC address `address`, or None
    where descriptors cannot travel (TCP)."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:"):]
    if path.startswith("//"):  # unix:///abs/path
        path = path[2:]
    return path + ".fds"


def _driver():
    _, driver = cuda_ipc._libs()
    return driver


def _chunk_range(address):
    """(start, size) of the physical chunk mapped at `address`."""
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    err = _driver().cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if err != 0:
        raise RuntimeError("cuMemGetAddressRange failed with CUDA driver "
                           "error %d" % err)
    return base.value, size.value


def _export(address):
    """A POSIX descriptor of the physical chunk mapped at `address`."""
    driver = _driver()
    handle = ctypes.c_uint64()
    err = driver.cuMemRetainAllocationHandle(ctypes.byref(handle),
                                             ctypes.c_void_p(address))
    if err != 0:
        raise RuntimeError(
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


def _device_frees(device):
    """torch's count of device memory releases (unmaps of expandable
    segments among them) on `device`, or None where torch does not keep
    it."""
    index = device.index if device.index is not None else \
        torch.cuda.current_device()
    stats = getattr(torch._C, "_cuda_memoryStats", None)
    return None if stats is None else stats(index).get("num_device_free")


class DescriptorChannel:
    """A connection to the daemon's descriptor socket: each message is
    b"OFD1", a little-endian uint32 count n (at most 64), n 16-byte ids,
    and n descriptors (SCM_RIGHTS); the daemon answers each with one byte
    (0: kept until this connection ends)."""

    def __init__(self, path):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
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
        self._frees = _device_frees(device)

    @classmethod
    def open(cls, address, device):
        """A sharer for the daemon at `address`, or None where torch's
        memory cannot be shared this way (another allocator, an old
        torch, a TCP address, a daemon without a descriptor socket)."""
        path = descriptor_socket_path(address)
        if path is None or _device_frees(device) is None:
            return None
        sharer = cls(path, device)
        probe = torch.empty(1, device=device)
        try:
            sharer.fill(pb.BufferHandle(), probe)
        except (OSError, RuntimeError):
            sharer.close()
            return None
        return sharer

    def fill(self, out, tensor):
        """Sets BufferHandle `out` to where `tensor` is."""
        start = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        with cuda_ipc.context_of(tensor.device):
            chunks = self._chunks_of(start, max(nbytes, 1))
        vmm = out.cuda_vmm
        vmm.device = tensor.device.index or 0
        for _, (fd_id, size) in chunks:
            vmm.chunks.add(fd_id=fd_id, size=size)
        vmm.offset = start - chunks[0][0]
        vmm.size = nbytes

    def _chunks_of(self, start, nbytes):
        """[(address, (id, size))] of the chunks under [start, +nbytes),
        sending the daemon those it has not got."""
        out, fresh = [], []
        address, end = start, start + nbytes
        try:
            while address < end:
                base, size = _chunk_range(address)
                entry = self._chunks.get(base)
                if entry is None or entry[1] != size:
                    fresh.append((base, os.urandom(16), _export(base)))
                    entry = (fresh[-1][1], size)
                out.append((base, entry))
                address = base + size
            self._send([(i, fd) for _, i, fd in fresh])
        finally:
            for _, _, fd in fresh:
                os.close(fd)
        for (base, entry) in out:
            self._chunks[base] = entry
        return out

    def _send(self, batch):
        if self._channel is None:
            self._channel = DescriptorChannel(self._path)
        self._channel.send(batch)

    def remapped(self):
        """Whether torch released device memory since the last look; if
        so, every chunk is forgotten (the daemon drops their
        descriptors with this connection) and sent again when named."""
        frees = _device_frees(self.device)
        if frees == self._frees:
            return False
        self._frees = frees
        self.close()
        return True

    def close(self):
        self._chunks.clear()
        if self._channel is not None:
            self._channel.close()
            self._channel = None

