"""One StepStream call whose replies are read by a thread of their own.

Requests go out in order; each gets a concurrent.futures.Future that the
reader thread resolves with its reply, in order. A caller may wait for a
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


class StepStream:
    def __init__(self, stub, metadata, address, on_broken=None):
        self._address = address
        self._on_broken = on_broken
        self._requests = queue.Queue()
        self._pending = collections.deque()
        self._lock = threading.Lock()
        self._error = None
        self.replies_ok = 0
        self._call = stub.StepStream(iter(self._requests.get, None),
                                     metadata=metadata)
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="optimd-step-replies")
        self._reader.start()

    @property
    def broken(self):
        with self._lock:
            return self._error is not None

    def send(self, request):
        """Queues a request; returns the Future of its reply."""
        future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(self._error)
                return future
            self._pending.append(future)
        self._requests.put(request)
        return future

    def drain(self, timeout=None):
        """Waits until every request sent so far is answered (or failed)."""
        with self._lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)

    def close(self, timeout=10.0):
        """Ends the call after the requests sent so far are answered."""
        self._requests.put(None)
        self._reader.join(timeout)

    def _read(self):
        try:
            for reply in self._call:
                with self._lock:
                    future = self._pending.popleft()
                    self.replies_ok += 1
                future.set_result(reply)
            error = errors.OptimdError("the daemon closed the step stream")
        except grpc.RpcError as err:
            # Steps run within a session: a daemon that is unavailable now
            # went away under it.
            error = errors.from_rpc_error(err, self._address,
                                          had_session=True)
        with self._lock:
            self._error = error
            pending = list(self._pending)
            self._pending.clear()
        # First the clean-up (a caller waiting on a reply then finds it
        # done), then the errors.
        if pending and self._on_broken is not None:
            self._on_broken(self.replies_ok, error)
        for future in pending:
            future.set_exception(error)
