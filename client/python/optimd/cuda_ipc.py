"""CUDA IPC for the PyTorch client: memory handles of torch allocations and
stream memory operations (the step flags' waits and writes), through the
CUDA runtime and driver torch already loaded.

torch's own storage IPC handles are in torch's format, not raw
cudaIpcMemHandle_t; the daemon needs the raw handle of the allocation and
the offset of the tensor in it, so this module asks the runtime directly.
"""
import contextlib
import ctypes

import torch

_runtime = None
_driver = None


def _libs():
    global _runtime, _driver
    if _runtime is None:
        torch.cuda.init()
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcudart" in line:
                    path = line.split()[-1]
                    break
        _runtime = ctypes.CDLL(path or "libcudart.so")
        _driver = ctypes.CDLL("libcuda.so.1")
        _runtime.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p,
                                                 ctypes.c_void_p]
        _driver.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64]
        _driver.cuPointerGetAttributes.argtypes = [
            ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
    return _runtime, _driver


@contextlib.contextmanager
def context_of(device):
    """Makes `device`'s primary context current in this thread for the
    driver calls inside (a thread that has made no CUDA call of its own
    has none, and the driver's calls then fail with
    CUDA_ERROR_INVALID_CONTEXT): torch's device guard, which calls
    cudaSetDevice only for another device than the thread's (device 0 on
    a fresh thread, without a context), and a runtime call that binds the
    context (cudaFree(NULL) frees nothing)."""
    with torch.cuda.device(device):
        runtime, _ = _libs()
        runtime.cudaFree(None)
        yield


# CUpointer_attribute values: the allocation's process-wide unique id, its
# start and its size.
_POINTER_ATTRIBUTES = (ctypes.c_int * 3)(7, 11, 12)


def allocation_of(tensor):
    """(buffer id, base address, size) of the CUDA allocation holding a
    tensor's data, in one driver call. The id is unique in the process for
    its whole life: an allocation freed and made anew at the same address
    has another id (and another IPC handle)."""
    _, driver = _libs()
    # One array for the three answers (id, base, size: 8 bytes each).
    out = (ctypes.c_uint64 * 3)()
    at = ctypes.addressof(out)
    data = (ctypes.c_void_p * 3)(at, at + 8, at + 16)
    err = driver.cuPointerGetAttributes(3, _POINTER_ATTRIBUTES, data,
                                        tensor.data_ptr())
    if err != 0:
        # A thread without a current CUDA context.
        with context_of(tensor.device):
            err = driver.cuPointerGetAttributes(3, _POINTER_ATTRIBUTES, data,
                                                tensor.data_ptr())
    if err != 0:
        raise RuntimeError("cuPointerGetAttributes failed with CUDA driver "
                           "error %d" % err)
    if out[1] == 0:
        # The driver answers for memory it does not own (an empty tensor's
        # null pointer, host memory) with zeros rather than an error.
        raise RuntimeError("tensor at 0x%x is not in CUDA device memory"
                           % tensor.data_ptr())
    return out[0], out[1], out[2]


def address_range(address):
    """(base address, size) of the allocation mapped at device address
    `address` (for memory of cuMemCreate's, its physical chunk), in this
    thread's current context."""
    _, driver = _libs()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    err = driver.cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if err != 0:
        raise RuntimeError("cuMemGetAddressRange failed with CUDA driver "
                           "error %d" % err)
    return base.value, size.value


def allocation_range(tensor):
    """(base address, size) of the CUDA allocation holding a tensor's
    data."""
    with context_of(tensor.device):
        return address_range(tensor.data_ptr())


def device_index(device):
    """The ordinal of CUDA `device` (the current one where it has none)."""
    return device.index if device.index is not None else \
        torch.cuda.current_device()


def mem_handle_at(base, device):
    """The 64-byte cudaIpcMemHandle_t of the allocation at `base`."""
    runtime, _ = _libs()
    with torch.cuda.device(device):
        handle = (ctypes.c_char * 64)()
        err = runtime.cudaIpcGetMemHandle(ctypes.byref(handle),
                                          ctypes.c_void_p(base))
    if err != 0:
        # Taken off the runtime's last-error slot, or torch's next kernel
        # launch check would report it as its own.
        runtime.cudaGetLastError()
        raise RuntimeError(
            "cudaIpcGetMemHandle failed with CUDA error %d (allocations of "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot be "
            "shared this way)" % err)
    return bytes(handle)


def mem_handle(tensor):
    """(64-byte cudaIpcMemHandle_t, byte offset of the tensor's data in its
    allocation) for a CUDA tensor."""
    base, _ = allocation_range(tensor)
    return mem_handle_at(base, tensor.device), tensor.data_ptr() - base


_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_VALUE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced


def _stream_value_fns():
    _, driver = _libs()
    fns = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(driver, name + "_v2", None) or getattr(driver, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                       ctypes.c_uint]
        fns.append(fn)
    return fns


_write_value32 = _wait_value32 = None


class RawStream:
    """A CUDA stream by its handle alone (what the driver calls take)."""
    __slots__ = ("cuda_stream",)

    def __init__(self, handle):
        self.cuda_stream = handle


def current_stream(device):
    """The current stream of `device` as a RawStream: torch's handle
    without building a torch.cuda.Stream (a few microseconds a step)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device)
    return RawStream(raw(device_index(device)))


def stream_write_value32(stream, address, value, device=None):
    """Enqueues on `stream` (a torch.cuda.Stream): *address = value, after
    a memory fence (the stream's earlier writes are visible first).
    `device`: the stream's, made current for a thread that has no CUDA
    context yet (a step() from a thread of its own)."""
    global _write_value32, _wait_value32
    if _write_value32 is None:
        _write_value32, _wait_value32 = _stream_value_fns()
    _stream_op(_write_value32, "cuStreamWriteValue32", stream, address,
               value, _WRITE_VALUE_DEFAULT, device)


def stream_wait_value32(stream, address, value, device=None):
    """Enqueues on `stream`: wait until *address >= value (as uint32)."""
    global _write_value32, _wait_value32
    if _wait_value32 is None:
        _write_value32, _wait_value32 = _stream_value_fns()
    _stream_op(_wait_value32, "cuStreamWaitValue32", stream, address, value,
               _WAIT_VALUE_GEQ, device)


def _stream_op(fn, name, stream, address, value, flags, device):
    err = fn(stream.cuda_stream, address, value, flags)
    if err != 0 and device is not None:
        # A thread without a current context (CUDA_ERROR_INVALID_CONTEXT).
        with context_of(device):
            err = fn(stream.cuda_stream, address, value, flags)
    if err != 0:
        raise RuntimeError("%s failed with CUDA driver error %d" % (name, err))


class SideStream:
    """A non-blocking stream of the driver's own, for the step flags'
    clean-up: it never waits behind the legacy default stream (which may be
    the very stream blocked on a step flag), as a blocking stream or a
    synchronous copy would."""

    def __init__(self, device):
        _, driver = _libs()
        self._driver = driver
        with torch.cuda.device(device):  # makes the device's context current
            handle = ctypes.c_void_p()
            _check(driver.cuStreamCreate(ctypes.byref(handle), 0x1),
                   "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
        self.cuda_stream = handle.value

    def read_u32(self, address):
        """*address, read on this stream (waits for this stream only)."""
        out = ctypes.c_uint32()
        d = self._driver
        d.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                           ctypes.c_size_t, ctypes.c_void_p]
        _check(d.cuMemcpyDtoHAsync_v2(ctypes.byref(out), address, 4,
                                      ctypes.c_void_p(self.cuda_stream)),
               "cuMemcpyDtoHAsync")
        self.synchronize()
        return out.value

    def synchronize(self):
        self._driver.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        _check(self._driver.cuStreamSynchronize(
            ctypes.c_void_p(self.cuda_stream)), "cuStreamSynchronize")


def _check(err, what):
    if err != 0:
        raise RuntimeError("%s failed with CUDA driver error %d" % (what, err))


_shareable_by_device = {}


def torch_memory_shareable(device):
    """Whether CUDA IPC can export what torch's caching allocator hands out
    on `device`: not under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    (its segments are mapped with cuMemMap, which cudaIpcGetMemHandle
    refuses). Probed once per device with a fresh allocation."""
    index = device_index(device)
    shareable = _shareable_by_device.get(index)
    if shareable is None:
        probe = torch.empty(1, device=torch.device("cuda", index))
        try:
            mem_handle(probe)
            shareable = True
        except RuntimeError:
            shareable = False
        _shareable_by_device[index] = shareable
    return shareable


class _OwnDeviceMemory:
    """Device memory of cudaMalloc's, outside torch's allocator (which
    CUDA IPC may not be able to export), offered to torch.as_tensor
    through the CUDA array interface; freed when the last tensor over it
    goes (torch keeps this object alive as long as the storage)."""

    def __init__(self, nbytes, device):
        runtime, _ = _libs()
        runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.c_size_t]
        runtime.cudaFree.argtypes = [ctypes.c_void_p]
        self._runtime = runtime
        self._ptr = None
        self._device = device
        ptr = ctypes.c_void_p()
        with torch.cuda.device(device):
            err = runtime.cudaMalloc(ctypes.byref(ptr), max(nbytes, 1))
        if err != 0:
            runtime.cudaGetLastError()  # not torch's next launch check's
            raise torch.cuda.OutOfMemoryError(
                "optimd.torch: cudaMalloc of %d bytes for the optimizer's "
                "shared buffers failed with CUDA error %d" % (nbytes, err))
        self._ptr = ptr.value
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (self._ptr, False),
            "version": 2}

    def __del__(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            try:
                with torch.cuda.device(self._device):
                    if self._runtime.cudaFree(ptr) != 0:
                        # Not left for torch's next launch check (a free
                        # refused during a graph capture, say: the memory
                        # stays until the process ends).
                        self._runtime.cudaGetLastError()
            except Exception:  # interpreter shutdown: the process frees it
                pass


def shareable_zeros(nbytes, device):
    """A zeroed uint8 CUDA tensor of `nbytes` that CUDA IPC can export:
    torch's when its allocator's memory can be shared, else memory of
    cudaMalloc's own."""
    if torch_memory_shareable(device):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    buffer = torch.as_tensor(_OwnDeviceMemory(nbytes, device), device=device)
    return buffer.zero_()
