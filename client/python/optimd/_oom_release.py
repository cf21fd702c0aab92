"""Memory torch frees while the daemon still maps it, given back when torch
runs out of device memory.

The daemon keeps its CUDA IPC mappings of the gradients it read at the
last step, and closes those of memory torch gave back only at the next
step (StepRequest.memory_released). In between, gradients set to None and
then freed by torch's allocator (its retry before an out-of-memory error,
or `torch.cuda.empty_cache()`) stay allocated on the device. A script that
catches the error and retries before stepping again (a smaller batch, as
accelerate's `find_executable_batch_size` does) would find less memory
than under torch. So on an out-of-memory error (torch's observer, called
before it raises) every optimizer on that GPU tells the daemon which
gradients are gone and that memory was released (UpdateBuffers): the
daemon closes those mappings, and the retry finds their memory. Under
expandable segments the daemon also holds each chunk's descriptor, so the
optimizer first closes its descriptor connections
(_DaemonOptimizer._close_chunk_connections).
"""
import logging
import threading
import weakref

import torch

_log = logging.getLogger("optimd")
_lock = threading.Lock()
_optimizers = weakref.WeakSet()
_attached = False


def _observable():
    """Whether torch's allocator calls observers that may wait: torch 2.2
    or later, whose native allocator attaches them on every device and
    lets go of its lock before calling them (older ones attach to one
    device, and may call them with the lock held)."""
    try:
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 2) and hasattr(
        torch._C, "_cuda_attach_out_of_memory_observer")


def watch(optimizer):
    """Releases what `optimizer` (on a GPU, its `_device`) has the daemon
    map when torch runs out of memory on that GPU. A no-op where torch's
    allocator takes no observers (an older torch, cudaMallocAsync, a
    pluggable allocator)."""
    global _attached
    with _lock:
        if _attached is None:
            return  # refused once
        if not _attached:
            if not _observable():
                _attached = None
                return
            try:
                torch._C._cuda_attach_out_of_memory_observer(
                    _on_out_of_memory)
            except RuntimeError:  # "... does not yet support ..."
                _attached = None
                return
            _attached = True
        _optimizers.add(optimizer)


def forget(optimizer):
    """Stops watching `optimizer` (closed)."""
    with _lock:
        _optimizers.discard(optimizer)


def _on_out_of_memory(device, *_):
    """torch's observer (device, allocation size, allocated, free): never
    raises, so that torch raises its own error."""
    with _lock:
        optimizers = list(_optimizers)
    if torch.cuda.is_current_stream_capturing():
        return  # no stream may wait during a capture
    for opt in optimizers:
        try:
            if opt._device.index == device:
                opt.release_freed_gradients()
        except Exception as e:  # noqa: BLE001 (torch's error comes next)
            _log.warning("optimd: out of memory on cuda:%d, and the daemon's "
                         "mappings of freed gradients stay until the next "
                         "step: %s", device, e)
