"""Device memory the daemon reaches over CUDA IPC, for the optimd.torch
optimizers' flat gradient buffers, the parameters CUDA IPC cannot export
where they are, and FP8 parameters.
"""
import torch

from optimd.v1 import optimd_pb2 as pb


class _DeviceBytes:
    """`nbytes` bytes of device memory at `ptr` inside `owner`, offered to
    torch.as_tensor through the CUDA array interface (torch keeps this
    object, hence `owner`, alive as long as the tensor's storage)."""

    def __init__(self, owner, ptr, nbytes):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "version": 2}


class CudaSegment:
    """A flat CUDA buffer shared with the daemon by CUDA IPC."""

    def __init__(self, nbytes, device):
        from optimd import cuda_ipc
        self.buffer = cuda_ipc.shareable_zeros(nbytes, device)
        self.device = device
        self.ipc_handle, self.base_offset = cuda_ipc.mem_handle(self.buffer)

    def tensor(self, offset, numel, dtype):
        """A 1-D tensor over bytes [offset, +numel elements) whose storage
        is exactly those bytes (not the whole buffer), as a tensor of its
        own allocation would be: libraries that look at storages (e.g.
        safetensors, which saves tied weights only when one name covers
        its whole storage) see each parameter as torch would have made
        it. The flat buffer stays alive as long as any of them."""
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        piece = _DeviceBytes(self.buffer, self.buffer.data_ptr() + offset,
                             nbytes)
        return torch.as_tensor(piece, device=self.device).view(dtype)

    def handle(self, offset, nbytes):
        return pb.BufferHandle(cuda_ipc=pb.CudaIpcBuffer(
            ipc_handle=self.ipc_handle, device=self.device.index or 0,
            offset=self.base_offset + offset, size=nbytes))

    def base_ptr(self):
        return self.buffer.data_ptr()

    def zero_(self):
        self.buffer.zero_()
