"""One StepStream call whose replies are read by a thread of their own.

Requests go out in order; each gets a concurrent.futures.Future that the
reader thread resolves with its reply, in order.

gRPC takes a stream's requests from its iterator on a Python thread of its
own, which needs the GIL. A trainer's thread that goes on with Python work
right after a step (the next forward launching its kernels) would keep it
waiting for CPython's switch interval (5 ms) or longer, and the daemon
would receive the step that late while the GPU waits for it. So `send`
returns only once gRPC's thread has taken the request (a hand-off of a few
microseconds while the caller waits and the GIL is free). A caller may wait for a
reply at once (Client.step) or later (Client.step_async: a CUDA trainer
whose streams are ordered by step flags need not wait at all). When the
stream ends (the daemon ends it at the first failed step, or the
connection breaks), `on_broken(replies_ok, error)` runs on the reader
thread, then every unanswered future fails with the error.
"""
import collections
import concurrent.futures
import queue
import threading

import grpc

from optimd import errors

# How often a sender waiting for gRPC's thread to take its request checks
# whether the stream has ended meanwhile.
_HANDOFF_CHECK_S = 0.05


class StepStream:
    def __init__(self, stub, metadata, address, on_broken=None,
                 answers=None):
        """answers(): whether the daemon still answers (asked when the
        stream breaks, to tell a broken connection from a daemon gone)."""
        self._address = address
        self._on_broken = on_broken
        self._answers = answers
        self._requests = queue.Queue()
        self._pending = collections.deque()
        self._lock = threading.Lock()
        self._error = None
        self._closing = False  # close() asked for the end
        self.replies_ok = 0
        self._call = stub.StepStream(self._outgoing(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="optimd-step-replies")
        self._reader.start()

    @property
    def broken(self):
        with self._lock:
            return self._error is not None

    def send(self, request):
        """Hands a request to gRPC; returns the Future of its reply."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            self._pending.append(future)
        taken = threading.Event()
        self._requests.put((request, taken))
        # Until gRPC's thread has it (next it serializes and sends it,
        # holding the GIL until it waits for the send), or the stream ended
        # (then the reader thread fails the future).
        while not taken.wait(_HANDOFF_CHECK_S) and not self.broken:
            pass
        return future

    def _outgoing(self):
        """The requests, for gRPC's thread; each marked taken as it goes."""
        while True:
            item = self._requests.get()
            if item is None:
                return
            request, taken = item
            taken.set()
            yield request

    def drain(self, timeout=None):
        """Waits until every request sent so far is answered (or failed)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)

    def close(self, timeout=10.0):
        """Ends the call after the requests sent so far are answered."""
        self._closing = True
        self._requests.put(None)
        self._reader.join(timeout)

    def _read(self):
        try:
            error = self._read_replies()
        except BaseException as err:  # noqa: B902 (the stream must end)
            # Whatever ends this thread ends the stream: senders and
            # waiters must never wait for a reader that is gone.
            error = errors.OptimdError(
                "the step stream's reader failed: %r" % (err,))
        with self._lock:
            self._error = error
            pending = list(self._pending)
            self._pending.clear()
        # First the clean-up (a caller waiting on a reply then finds it
        # done), then the errors.
        try:
            # Also with every step answered, unless this end was asked for:
            # an answered step may not have run yet, and a daemon gone
            # now never writes its done flag (_step_flags.py).
            if (pending or not self._closing) and self._on_broken is not None:
                self._on_broken(self.replies_ok, error)
        finally:
            for future in pending:
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)

    def _read_replies(self):
        """Resolves each reply's future in order; returns the error that
        ended the stream."""
        try:
            for reply in self._call:
                with self._lock:
                    future = self._pending.popleft()
                    self.replies_ok += 1
                if future.set_running_or_notify_cancel():
                    future.set_result(reply)
            return errors.OptimdError("the daemon closed the step stream")
        except grpc.RpcError as err:
            # Steps run within a session: a daemon that is unavailable now
            # went away under it.
            return errors.from_rpc_error(err, self._address,
                                         had_session=True,
                                         answers=self._answers)
