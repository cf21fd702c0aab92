"""Steps through liboptimd_step_channel.so against grpcio's step stream:
the same results, the same errors, and no Python thread per step."""
import concurrent.futures
import gc
import os
import signal
import sys
import threading
import time
import unittest
import weakref
from unittest import mock

import torch

import optimd
from optimd import _native_steps
from optimd.testing import Daemon
from optimd.torch import AdamW

# run_python_tests.sh points OPTIMD_STEP_CHANNEL_LIB at the built library:
# then it must load (a broken build fails here rather than skipping).
HAVE_LIBRARY = _native_steps.load() is not None
if os.environ.get("OPTIMD_STEP_CHANNEL_LIB") and not HAVE_LIBRARY:
    raise RuntimeError("OPTIMD_STEP_CHANNEL_LIB is set but the library does "
                       "not load: %s" % _native_steps.why_not())


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def train(opt, m, steps):
    x = torch.linspace(-1, 1, 64).reshape(8, 8)
    for _ in range(steps):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


@unittest.skipUnless(HAVE_LIBRARY, "liboptimd_step_channel.so not built: %s"
                     % _native_steps.why_not())
class StepChannelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        assert cls.daemon.stop() == 0

    def python_stream(self):
        """The rest of the test steps over grpcio's stream."""
        patch = mock.patch("optimd._native_steps.load", lambda: None)
        patch.start()
        self.addCleanup(patch.stop)

    def optimizer(self, m, **kw):
        opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.1,
                    address=self.daemon.address, job_id=self.id(), **kw)
        self.addCleanup(opt.close)
        return opt

    def test_steps_give_the_bits_of_the_python_stream_and_of_torch(self):
        ours, theirs, ref = model(1), model(1), model(1)
        native = self.optimizer(ours, max_grad_norm=0.5)
        train(native, ours, 12)
        self.assertTrue(native.client.native_steps)
        native.close()
        self.python_stream()
        python = self.optimizer(theirs, max_grad_norm=0.5)
        train(python, theirs, 12)
        self.assertFalse(python.client.native_steps)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            self.assertTrue(torch.equal(p, q))
        torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2,
                                      weight_decay=0.1)
        x = torch.linspace(-1, 1, 64).reshape(8, 8)
        for _ in range(12):
            torch_opt.zero_grad()
            ref(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            torch_opt.step()
        for p, q in zip(ours.parameters(), ref.parameters()):
            self.assertLess((p - q).abs().max().item(), 1e-5)

    def dropped_client_threads(self, job):
        """The threads a stepping Client started that are still alive a
        while after it was dropped without close(); asserts it was
        collected."""
        before = set(threading.enumerate())
        client = optimd.Client(self.daemon.address)
        client.create_session(job)
        client.step(assume_finite=True)
        started = set(threading.enumerate()) - before
        self.assertTrue(started)  # the stream's threads
        gone = weakref.ref(client)
        del client
        gc.collect()
        self.assertIsNone(gone())
        deadline = time.monotonic() + 20
        while any(t.is_alive() for t in started) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        return [t.name for t in started if t.is_alive()]

    def test_a_client_dropped_without_close_ends_its_threads(self):
        # A notebook or a loop that drops Clients must not pile up threads
        # (the stream held its Client before, so none was collected).
        self.assertEqual(self.dropped_client_threads(self.id() + "-n"), [])
        self.python_stream()
        self.assertEqual(self.dropped_client_threads(self.id() + "-p"), [])

    def step_threads(self):
        """The Python threads other than this one that run gRPC's or
        optimd's code while a session steps (but grpcio's watcher of the
        channel's connectivity, which wakes only when that changes)."""
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session(self.id())
        replies = [client.step_async(assume_finite=True) for _ in range(30)]
        busy = set()
        # The step channel's own watcher sleeps in the library until the
        # stream ends.
        watchers = {t.ident for t in threading.enumerate()
                    if t.name == "optimd-step-channel-end"}
        for tid, frame in sys._current_frames().items():
            if frame.f_code.co_name == "_poll_connectivity" or \
                    tid in watchers:
                continue
            while frame is not None and tid != threading.get_ident():
                name = frame.f_code.co_filename
                if os.sep + "grpc" + os.sep in name or \
                        os.sep + "optimd" + os.sep in name:
                    busy.add(tid)
                frame = frame.f_back
        self.assertEqual(len([r.result(timeout=30) for r in replies]), 30)
        client.close_session()
        return busy

    def test_no_python_thread_runs_steps(self):
        self.assertEqual(self.step_threads(), set())
        # The check sees the threads of grpcio's stream.
        self.python_stream()
        self.assertGreaterEqual(len(self.step_threads()), 2)

    def refused_then_later(self):
        """(refused step's error, error of one sent after it on the same
        stream, whether a new stream steps)."""
        client = optimd.Client(self.daemon.address)
        self.addCleanup(client.close)
        client.create_session(self.id())
        refused = client.step_async(lr_overrides={"no-such-group": 0.1})
        first = refused.exception(timeout=30)
        ended = client._stream
        later = ended.send(client._step_request(assume_finite=True))
        second = later.exception(timeout=30)
        self.assertTrue(ended.broken)
        again = client.step(assume_finite=True).known
        client.close_session()
        return first, second, again

    def test_a_refused_step_fails_as_over_the_python_stream(self):
        native = self.refused_then_later()
        self.python_stream()
        python = self.refused_then_later()
        self.assertIsInstance(native[0], optimd.NotFoundError)
        self.assertEqual(type(native[0]), type(python[0]))
        self.assertIn("no-such-group", str(native[0]))
        self.assertIsInstance(native[1], optimd.OptimdError)
        self.assertTrue(native[2] and python[2])

    def test_steps_in_flight_are_answered_at_close(self):
        client = optimd.Client(self.daemon.address)
        client.create_session(self.id())
        replies = [client.step_async(assume_finite=True) for _ in range(10)]
        client.close_session()  # drains the stream first
        self.assertTrue(all(r.done() for r in replies))
        self.assertEqual([r.exception() for r in replies], [None] * 10)
        client.close()

    def test_a_daemon_gone_mid_run_is_daemon_unavailable(self):
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        m = model(2)
        opt = AdamW(m.parameters(), lr=1e-2, address=daemon.address,
                    job_id=self.id())
        train(opt, m, 2)
        self.assertTrue(opt.client.native_steps)
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        with self.assertRaises(optimd.DaemonUnavailableError) as caught:
            train(opt, m, 1)
        self.assertIn("went away", str(caught.exception))


    def session(self, daemon=None, on_broken=None):
        client = optimd.Client((daemon or self.daemon).address)
        self.addCleanup(client.close)
        client.create_session(self.id())
        client.on_stream_broken = on_broken
        client.step(assume_finite=True)  # opens the stream
        return client

    def test_a_daemon_gone_fails_steps_in_flight_without_a_poll(self):
        # A CUDA trainer's stream may wait on the done flag of a step in
        # flight: the stream's end must release it (on_broken) without the
        # trainer's thread looking at the replies.
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        ended = threading.Event()
        client = self.session(daemon, on_broken=lambda *args: ended.set())
        daemon.freeze()
        reply = client.step_async(assume_finite=True)
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        self.assertTrue(ended.wait(20))
        self.assertTrue(reply._resolved)  # resolved by the watcher
        self.assertIsInstance(reply.exception(), optimd.OptimdError)

    def test_an_idle_stream_that_ended_is_broken(self):
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        client = self.session(daemon)
        stream = client._stream
        os.kill(daemon.process.pid, signal.SIGKILL)
        daemon.process.wait()
        deadline = time.monotonic() + 20
        while not stream.broken and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(stream.broken)

    def test_a_wait_gives_way_to_close_from_another_thread(self):
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        client = self.session(daemon)
        self.addCleanup(daemon.thaw)
        daemon.freeze()
        reply = client.step_async(assume_finite=True)
        closer = threading.Thread(target=client._stream.close,
                                  kwargs=dict(timeout=0.5))
        t0 = time.monotonic()
        closer.start()
        with self.assertRaises(concurrent.futures.TimeoutError):
            reply.result(timeout=1.0)  # waits in slices, lock let go
        closer.join(5)
        self.assertFalse(closer.is_alive())
        self.assertLess(time.monotonic() - t0, 5)

    def test_a_zero_timeout_takes_a_reply_that_came(self):
        client = self.session()
        reply = client.step_async(assume_finite=True)
        deadline = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < deadline:
            try:
                got = reply.result(timeout=0)
            except concurrent.futures.TimeoutError:
                time.sleep(0.01)
        self.assertIsNotNone(got)

    def test_exception_returns_a_steps_deadline_error(self):
        reply = _native_steps.Reply(stream=None)
        error = optimd.DeadlineExceededError("ranks did not all step")
        reply._set(error=error)
        self.assertIs(reply.exception(), error)

    def test_a_forked_child_lets_the_stream_go(self):
        client = self.session()
        pid = os.fork()
        if pid == 0:  # the child: no library threads here
            code = 1
            try:
                stream = client._stream
                broken = stream.broken
                stream.close()
                code = 0 if broken else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        self.assertEqual(status, 0)
        self.assertTrue(client.step(assume_finite=True).known)  # parent's


if __name__ == "__main__":
    unittest.main()
