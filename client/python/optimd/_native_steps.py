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
import ctypes
import os
import threading
import time

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
    except OSError as err:
        _lib_error = "%s: %s" % (path, err)
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
    """The future of one step's reply (what the optimizer uses of
    concurrent.futures.Future): resolved when the stream is looked at."""

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
            self._stream.poll(0)
        return self._resolved

    def result(self, timeout=None):
        if not self._resolved:
            self._stream.wait_for(self, timeout)
        if not self._resolved:
            raise TimeoutError("no reply from the daemon within %s s" %
                               timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout=None):
        """The step's error, or None once it was answered."""
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except Exception as err:  # noqa: B902 (the step's own error)
            return err
        return None


class NativeStepStream:
    def __init__(self, lib, target, token, address, on_broken=None,
                 answers=None, connect_timeout_s=10.0):
        self._lib = lib
        self._address = address
        self._on_broken = on_broken
        self._answers = answers
        self._lock = threading.RLock()
        self._pending = collections.deque()
        self._error = None
        self.replies_ok = 0
        self._buf = ctypes.create_string_buffer(_REPLY_BYTES)
        self._len = ctypes.c_size_t(0)
        self._code = ctypes.c_int(0)
        err = ctypes.create_string_buffer(512)
        self._ch = lib.released.optimd_step_channel_open(
            target.encode(), token.encode(), int(connect_timeout_s * 1000),
            err, len(err))
        if not self._ch:
            raise errors.DaemonUnavailableError(err.value.decode())

    @property
    def broken(self):
        with self._lock:
            self.poll(0)
            return self._error is not None

    def send(self, request):
        """Writes the request; returns the Reply of it."""
        reply = Reply(self)
        data = request.SerializeToString()
        with self._lock:
            if self._error is not None:
                reply._set(error=self._error)
                return reply
            self._pending.append(reply)
            if self._lib.held.optimd_step_channel_send(self._ch, data,
                                                       len(data)) != 0:
                self.poll(-1)  # the stream ended: its status fails it
        return reply

    def poll(self, timeout_ms):
        """Takes the replies that have come (waiting up to timeout_ms for
        the first one; negative: until one comes or the stream ends)."""
        with self._lock:
            while self._pending and self._error is None and self._ch:
                lib = self._lib.held if timeout_ms == 0 else \
                    self._lib.released
                rc = lib.optimd_step_channel_next(
                    self._ch, timeout_ms, self._buf, len(self._buf),
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
                self._pending.popleft()._set(value=reply)
                timeout_ms = 0

    def wait_for(self, reply, timeout=None):
        """Until `reply` is resolved (or timeout seconds passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not reply._resolved and self._error is None and self._ch:
                if deadline is None:
                    self.poll(-1)
                    continue
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    return
                self.poll(left_ms)

    def _end(self, code, details):
        pending = list(self._pending)
        self._pending.clear()
        status = _Status(_status_code(code), details)
        error = errors.from_rpc_error(status, self._address,
                                      had_session=True,
                                      answers=self._answers if pending
                                      else None)
        self._error = error
        try:
            if pending and self._on_broken is not None:
                self._on_broken(self.replies_ok, error)
        finally:
            for reply in pending:
                reply._set(error=error)

    def drain(self, timeout=None):
        """Waits until every request sent so far is answered (or failed)."""
        with self._lock:
            if self._pending:
                self.wait_for(self._pending[-1], timeout)

    def close(self, timeout=10.0):
        """Ends the call after the requests sent so far are answered."""
        with self._lock:
            if not self._ch:
                return
            self._lib.released.optimd_step_channel_finish(
                self._ch, int(timeout * 1000))
            self.poll(0)  # the replies that came before the end
            self._lib.released.optimd_step_channel_free(self._ch)
            self._ch = None
            if self._error is None:
                self._error = errors.OptimdError("the step stream was closed")
            for reply in self._pending:
                reply._set(error=self._error)
            self._pending.clear()


def _status_code(value):
    """The grpc.StatusCode of a numeric gRPC code."""
    import grpc
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN
