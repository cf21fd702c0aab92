"""The parameter writes of a trainer not yet told to the daemon (each
element the trainer changed becomes its master's value there). A step
carries them in its buffer updates (TensorBuffers.param_written); any
other call of the daemon's tells them first. Each parameter once, in the
order first written; thread-safe (a call from another thread tells them
while a step may be building its request)."""

import threading


class PendingWrites:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries = {}  # id(entry) -> entry, in insertion order

    def add(self, entries):
        with self._lock:
            for s in entries:
                self._entries.setdefault(id(s), s)

    def snapshot(self):
        """The entries now, left pending (a step's request; discard them
        once it is sent)."""
        with self._lock:
            return list(self._entries.values())

    def take(self):
        """Every entry, no longer pending (put_back if telling failed)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            return entries

    def put_back(self, entries):
        self.add(entries)

    def discard(self, entries):
        with self._lock:
            for s in entries:
                self._entries.pop(id(s), None)

    def __bool__(self):
        with self._lock:
            return bool(self._entries)
