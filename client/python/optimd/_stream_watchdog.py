"""A bound on how long a reader of a server stream waits for its next
message: the call is cancelled when one wait passes the bound. The
reader's own time between messages (writing a chunk to disk, say) does not
count, so a long stream read slowly is never cut off; a daemon that stops
sending (stopped, wedged, or its host gone without closing the socket) is
found out after one bound instead of never."""
import threading
import time


class StreamWatchdog:
    """Watches waits on `call` (a gRPC call with cancel()) for the next
    message; `timeout` None watches nothing. One thread of its own,
    sleeping, for the life of the watch."""

    def __init__(self, call, timeout):
        self.fired = False
        self._call = call
        self._timeout = timeout
        self._cond = threading.Condition()
        self._deadline = None  # while a wait is on
        self._stopped = False
        self._thread = None
        if timeout is not None:
            self._thread = threading.Thread(
                target=self._run, name="optimd-stream-watchdog", daemon=True)
            self._thread.start()

    def next_of(self, iterator):
        """next(iterator), cancelling the call if it takes longer than the
        bound (gRPC then raises its RpcError, CANCELLED, in the wait)."""
        with self._cond:
            if self._timeout is not None:
                self._deadline = time.monotonic() + self._timeout
                self._cond.notify()
        try:
            return next(iterator)
        finally:
            with self._cond:
                self._deadline = None

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self):
        with self._cond:
            while not self._stopped:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.fired = True
                self._deadline = None
                self._call.cancel()
                return
