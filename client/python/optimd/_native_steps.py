"""A session's StepStream through liboptimd_step_channel.so: no Python
thread per step.

Over grpcio's stream (_step_stream.py) every step wakes two Python threads
of gRPC's, each needing the GIL: the trainer's thread waits for the first
to take the request and loses the GIL to both during its next forward.
Here the trainer's own thread hands the request to the library's C++
writer thread and takes the replies its C++ reader thread has read when it
looks for them (`done()`, `result()`, `drain()`), so nothing else runs
Python.

The library is optional: `load()` finds it through OPTIMD_STEP_CHANNEL_LIB
or beside this package (optimd/_lib/), and gives None where there is none
or OPTIMD_STEP_CHANNEL=python asks for grpcio's stream. Unix-socket
addresses only (a TCP daemon speaks TLS, which the library does not set
up). The interface is _step_stream.StepStream's.
"""
import collections
import concurrent.futures
import ctypes
import logging
import os
import threading
import time

import grpc

from optimd import errors
from optimd.v1 import optimd_pb2 as pb

_LIB_NAME = "liboptimd_step_channel.so"
_REPLY_BYTES = 1 << 16  # a reply larger than this is fetched in a second call
_lib = None
_lib_error = None


def load():
    """The loaded library, or None (then `why_not()` says why)."""
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    if os.environ.get("OPTIMD_STEP_CHANNEL", "") == "python":
        _lib_error = "OPTIMD_STEP_CHANNEL=python"
        return None
    path = os.environ.get("OPTIMD_STEP_CHANNEL_LIB") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "_lib", _LIB_NAME)
    try:
        lib = _Lib(path)
    except (OSError, AttributeError) as err:  # not there, or another build
        _lib_error = "%s: %s" % (path, err)
        if os.path.exists(path):
            logging.getLogger("optimd").warning(
                "optimd: %s does not load (%s); steps go over grpcio's "
                "stream", path, err)
        return None
    _lib = lib
    return lib


class _Lib:
    """The library's functions twice: `released` drops the GIL for the
    call (those that may wait), `held` keeps it (a queue push or a look at
    the replies: microseconds, where giving the GIL up would let another
    thread keep it from the trainer)."""

    def __init__(self, path):
        self.released = ctypes.CDLL(path)
        self.held = ctypes.PyDLL(path)
        for lib in (self.released, self.held):
            _declare(lib)


def _declare(lib):
    lib.optimd_step_channel_open.restype = ctypes.c_void_p
    lib.optimd_step_channel_open.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
        ctypes.c_size_t]
    lib.optimd_step_channel_send.restype = ctypes.c_int
    lib.optimd_step_channel_send.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.optimd_step_channel_next.restype = ctypes.c_int
    lib.optimd_step_channel_next.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)]
    lib.optimd_step_channel_wait.restype = ctypes.c_int
    lib.optimd_step_channel_wait.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                             ctypes.c_int]
    lib.optimd_step_channel_end_writes.restype = None
    lib.optimd_step_channel_end_writes.argtypes = [ctypes.c_void_p]
    lib.optimd_step_channel_finish.restype = None
    lib.optimd_step_channel_finish.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.optimd_step_channel_free.restype = None
    lib.optimd_step_channel_free.argtypes = [ctypes.c_void_p]


def why_not():
    return _lib_error


class _Status(Exception):
    """The stream's end as grpc.RpcError's code() and details()."""

    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Reply:
    """The future of one step's reply: done(), result() and exception() as
    concurrent.futures.Future's, resolved when the stream is looked at (or
    by its watcher thread when the stream ends)."""

    def __init__(self, stream):
        self._stream = stream
        self._resolved = False
        self._value = None
        self._error = None

    def _set(self, value=None, error=None):
        self._resolved = True
        self._value, self._error = value, error

    def done(self):
        if not self._resolved:
            self._stream.poll()
        return self._resolved

    def result(self, timeout=None):
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout=None):
        """The step's error, or None once it was answered."""
        self._wait(timeout)
        return self._error

    def _wait(self, timeout):
        if not self._resolved:
            self._stream.wait_for(self, timeout)
        if not self._resolved:
            raise concurrent.futures.TimeoutError(
                "no reply from the daemon within %s s" % timeout)


class NativeStepStream:
    """One StepStream through the library. The trainer's thread sends and
    polls; a watcher thread sleeps in the library until the stream ends,
    then fails what is unanswered and runs `on_broken` at once (a CUDA
    trainer's stream may be waiting on a step's done flag that only that
    releases), as grpcio's reader thread does. Waits go in short slices
    outside the lock, so that Ctrl-C and a close() from another thread get
    through."""

    _SLICE_MS = 100

    def __init__(self, lib, target, token, address, on_broken=None,
                 answers=None, connect_timeout_s=10.0):
        self._lib = lib
        self._address = address
        self._on_broken = on_broken
        self._answers = answers
        self._lock = threading.RLock()
        self._pending = collections.deque()
        self._error = None
        self._closing = False
        self._sleepers = 0  # threads in _sleep_in_library
        self._pid = os.getpid()
        self.replies_ok = 0
        self._buf = ctypes.create_string_buffer(_REPLY_BYTES)
        self._len = ctypes.c_size_t(0)
        self._code = ctypes.c_int(0)
        err = ctypes.create_string_buffer(512)
        self._ch = lib.released.optimd_step_channel_open(
            target.encode(), token.encode(), int(connect_timeout_s * 1000),
            err, len(err))
        if not self._ch:
            # Steps belong to a session: as over grpcio's stream, a daemon
            # that does not answer went away under it.
            raise errors.from_rpc_error(
                _Status(grpc.StatusCode.UNAVAILABLE, err.value.decode()),
                address, had_session=True, answers=answers)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name="optimd-step-channel-end")
        self._watcher.start()

    @property
    def broken(self):
        self.poll()
        with self._lock:
            return self._error is not None

    def send(self, request):
        """Queues the request; returns the Reply of it."""
        reply = Reply(self)
        data = request.SerializeToString()
        with self._lock:
            self._check_process()
            if self._error is not None:
                reply._set(error=self._error)
                return reply
            self._pending.append(reply)
            if self._lib.held.optimd_step_channel_send(self._ch, data,
                                                       len(data)) != 0:
                self.poll()  # the stream ended (or is ending): see below
        return reply

    def poll(self):
        """Takes the replies that have come, and the stream's end."""
        with self._lock:
            self._check_process()
            while self._ch and self._error is None:
                rc = self._lib.held.optimd_step_channel_next(
                    self._ch, 0, self._buf, len(self._buf),
                    ctypes.byref(self._len), ctypes.byref(self._code))
                if rc == -2:
                    self._buf = ctypes.create_string_buffer(self._len.value)
                    continue
                if rc == 0:
                    return
                if rc == -1:
                    self._end(self._code.value, self._buf.value.decode(
                        errors="replace"))
                    return
                reply = pb.StepResponse.FromString(
                    ctypes.string_at(self._buf, self._len.value))
                self.replies_ok += 1
                if self._pending:
                    self._pending.popleft()._set(value=reply)

    def wait_for(self, reply, timeout=None):
        """Until `reply` is resolved (or timeout seconds passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.poll()
            if reply._resolved:
                return
            with self._lock:
                if self._error is not None or not self._ch:
                    return
            left = self._SLICE_MS if deadline is None else min(
                self._SLICE_MS, int((deadline - time.monotonic()) * 1000))
            if left <= 0:
                return
            self._sleep_in_library(left, until_end=False)

    def _sleep_in_library(self, timeout_ms, until_end):
        """Waits in the library (the GIL and the lock let go) for a reply
        or the end; whether it came. close() frees the channel only once
        no thread sleeps here."""
        with self._lock:
            self._check_process()
            if not self._ch:
                return True
            self._sleepers += 1
            ch = self._ch
        try:
            return self._lib.released.optimd_step_channel_wait(
                ch, timeout_ms, 1 if until_end else 0) == 1
        finally:
            with self._lock:
                self._sleepers -= 1
                if self._closing and self._error is not None:
                    self._free()  # the last sleeper out of a closed one

    def _watch(self):
        """The watcher thread: until the stream ends, then its clean-up
        (and the channel's freeing, once closed)."""
        while not self._sleep_in_library(60000, until_end=True):
            pass
        self.poll()
        with self._lock:
            if self._closing:
                self._free()

    def _end(self, code, details):
        """The stream ended (on whichever thread saw it): fail what is
        unanswered, then run on_broken."""
        pending = list(self._pending)
        self._pending.clear()
        if self._closing or code == 0:
            error = errors.OptimdError("the step stream was closed"
                                       if self._closing else
                                       "the daemon closed the step stream")
        else:
            error = errors.from_rpc_error(
                _Status(_status_code(code), details), self._address,
                had_session=True, answers=self._answers)
        self._error = error
        try:
            # Also with every step answered, unless this end was asked for:
            # an answered step may not have run yet, and a daemon gone
            # now never writes its done flag (_step_flags.py).
            if (pending or not self._closing) and self._on_broken is not None:
                self._on_broken(self.replies_ok, error)
        finally:
            for reply in pending:
                reply._set(error=error)

    def drain(self, timeout=None):
        """Waits until every request sent so far is answered (or failed)."""
        with self._lock:
            last = self._pending[-1] if self._pending else None
        if last is not None:
            self.wait_for(last, timeout)

    def close(self, timeout=10.0):
        """Ends the call after the requests sent so far are answered
        (waiting up to `timeout` s; the watcher thread frees the channel
        when the daemon has ended the stream)."""
        with self._lock:
            self._check_process()
            if not self._ch or self._closing:
                return
            self._closing = True
            if self._error is not None:  # ended: the watcher has gone
                self._free()
                return
            self._lib.held.optimd_step_channel_end_writes(self._ch)
            last = self._pending[-1] if self._pending else None
        if last is not None:
            self.wait_for(last, timeout)

    def _free(self):
        """Frees a channel that has ended (the watcher's last act)."""
        if self._ch and self._sleepers == 0:
            self._lib.released.optimd_step_channel_free(self._ch)
            self._ch = None

    def _check_process(self):
        """In a child made by fork() the library's threads do not exist:
        the channel is let go there (not freed), the stream broken."""
        if os.getpid() == self._pid or not self._ch:
            return
        self._ch = None
        self._error = errors.OptimdError(
            "the step stream belongs to the process that forked this one")
        for reply in self._pending:
            reply._set(error=self._error)
        self._pending.clear()


def _status_code(value):
    """The grpc.StatusCode of a numeric gRPC code."""
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
