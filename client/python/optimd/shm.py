"""POSIX shared-memory segments as torch tensors (CPU backend).

A SharedSegment is a file under /dev/shm (what shm_open creates on Linux),
mapped into this process; the daemon maps the same pages, so tensors viewed
on it are read and written by both with no copy. The segment is unlinked when
the SharedSegment is closed or collected.
"""
import mmap
import os
import secrets

import torch

from optimd.v1 import optimd_pb2 as pb

_SHM_DIR = "/dev/shm"
ALIGNMENT = 64


def align(n, a=ALIGNMENT):
    return (n + a - 1) // a * a


class SharedSegment:
    """One shared-memory segment owned by this process."""

    def __init__(self, nbytes):
        if nbytes <= 0:
            raise ValueError("a shared-memory segment needs > 0 bytes")
        self.name = "/optimd-py-%d-%s" % (os.getpid(), secrets.token_hex(6))
        path = _SHM_DIR + self.name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.nbytes = nbytes
        self._closed = False
        self._base = None

    def tensor(self, offset, numel, dtype):
        """A 1-D tensor of `numel` elements of `dtype` at byte `offset`."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        byte_view = torch.frombuffer(self._mmap, dtype=torch.uint8,
                                     count=numel * _itemsize(dtype),
                                     offset=offset)
        return byte_view.view(dtype)

    def handle(self, offset, nbytes):
        return pb.BufferHandle(shared_memory=pb.SharedMemoryBuffer(
            segment_name=self.name, offset=offset, size=nbytes))

    def base_ptr(self):
        """The address of the segment's first byte in this process."""
        if self._base is None:
            self._base = torch.frombuffer(self._mmap, dtype=torch.uint8,
                                          count=1).data_ptr()
        return self._base

    def zero_(self):
        torch.frombuffer(self._mmap, dtype=torch.uint8).zero_()

    def close(self):
        if not self._closed:
            self._closed = True
            try:
                os.unlink(_SHM_DIR + self.name)
            except FileNotFoundError:
                pass

    def __del__(self):
        self.close()


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()
