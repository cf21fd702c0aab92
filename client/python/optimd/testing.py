"""Starting a private optimd daemon, for tests and examples.

    with optimd.testing.Daemon() as d:
        opt = AdamW(model.parameters(), address=d.address)

DaemonTestCase is a unittest base class with one private daemon per test
class and a seeded generator per test.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import zlib

from optimd import errors
from optimd.client import Client


def find_binary():
    """$OPTIMD_BINARY, else bazel-bin/server/optimd of the source tree."""
    env = os.environ.get("OPTIMD_BINARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "..", "..", "..", ".gpu", "optimd")
    if os.path.exists(bundled) and os.environ.get("OPTIMD_USE_BUNDLE"):
        return os.path.abspath(bundled)
    candidate = os.path.join(here, "..", "..", "..", "bazel-bin", "server",
                             "optimd")
    if os.path.exists(candidate):
        return os.path.abspath(candidate)
    found = shutil.which("optimd")
    if found:
        return found
    raise FileNotFoundError(
        "cannot find the optimd binary: build it with `bazel build "
        "//server:optimd` or set OPTIMD_BINARY")


class Daemon:
    """An optimd process on a private Unix socket; stopped on exit."""

    def __init__(self, flags=(), binary=None, backend="cpu", stderr=None):
        """stderr: a file for the daemon's log (default: this process's)."""
        self._dir = tempfile.mkdtemp(prefix="optimd-", dir="/tmp")
        self.socket_path = os.path.join(self._dir, "optimd.sock")
        self.address = "unix:" + self.socket_path
        cmd = [binary or find_binary(), "--listen=" + self.address,
               "--backend=" + backend] + list(flags)
        self.process = subprocess.Popen(cmd, stderr=stderr)
        deadline = time.time() + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("optimd exited with status %d during "
                                   "start-up" % self.process.returncode)
            if os.path.exists(self.socket_path):
                try:
                    Client(self.address, connect_timeout=1).close()
                    break
                except errors.DaemonUnavailableError:
                    pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError("optimd did not start within 30 s")
            time.sleep(0.02)

    def stop(self):
        """SIGTERM and wait; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)
        return self.process.returncode

    def freeze(self, timeout=10):
        """SIGSTOP, and wait until every thread of the daemon is stopped:
        a thread that was running when the signal came may still answer a
        call for a moment otherwise."""
        os.kill(self.process.pid, signal.SIGSTOP)
        task_dir = "/proc/%d/task" % self.process.pid
        deadline = time.monotonic() + timeout
        while not _all_stopped(task_dir):
            if time.monotonic() > deadline:
                raise RuntimeError("optimd did not stop within %g s" % timeout)
            time.sleep(0.001)

    def thaw(self):
        """SIGCONT (after freeze)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _all_stopped(task_dir):
    """Whether every thread under /proc/<pid>/task is in state T (stopped)."""
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "stat")) as f:
                # The state follows the parenthesised command name.
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # the thread ended
        if state not in ("T", "t"):
            return False
    return True


def session_state_bytes(address, job, rank):
    """The daemon-held state bytes of the session (job, rank), as
    ListSessions reports them, or None if there is no such session."""
    client = Client(address)
    try:
        for s in client.list_sessions().sessions:
            if s.job_id == job and s.rank == rank:
                return s.state_bytes
    finally:
        client.close()
    return None


def run_threads(fns):
    """Runs each fn in a thread of its own (ranks of one job stepping
    together); re-raises the first error."""
    errors = [None] * len(fns)

    def call(i):
        try:
            fns[i]()
        except BaseException as e:  # noqa: B902 (reported below)
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,))
               for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e


def record_written_tells(opt):
    """Returns a list that grows by the number of parameters `opt` tells
    the daemon were written, each time it tells some: by an UpdateBuffers
    call of their own or with a step. Tests use it to check that a write is
    told once, and that steps alone tell nothing."""
    told = []
    tell = opt._tell_written
    carry = opt._with_written

    def tell_now(entries):
        told.append(len(entries))
        return tell(entries)

    def tell_with_step(updates, written):
        if written:
            told.append(len(written))
        return carry(updates, written)
    opt._tell_written = tell_now
    opt._with_written = tell_with_step
    return told


class DaemonTestCase(unittest.TestCase):
    """One private daemon per test class (started with `daemon_flags`,
    stopped cleanly after the class: a daemon that does not exit 0 fails
    the class), and per test a torch generator `self.gen` seeded from
    `seed` and the test's id (the same numbers for a test in every
    process: Python's hash() is salted), and `self.opts`, optimizers
    closed after the test."""

    daemon_flags = ()
    seed = 0

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(flags=cls.daemon_flags)

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0

    def setUp(self):
        import torch
        self.gen = torch.Generator().manual_seed(
            self.seed + zlib.crc32(self.id().encode()) % 1000)
        self.opts = []

    def tearDown(self):
        for o in self.opts:
            o.close()
