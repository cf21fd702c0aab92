"""Operating the daemon as a cluster operator does, in one script: the real
daemon with a save directory, HTTP metrics and its log in a file; two
trainers, a refused call, an evicted session and a killed trainer; SIGTERM;
a restarted daemon on the same save directory; both trainers resume
bit-exactly. /metrics is scraped over HTTP with a real client and parsed
with Prometheus's own Python parser, and the log holds a line for every
event."""
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

import grpc

import optimd
import optimd.client
import optimd.errors
import optimd.testing
from optimd.v1 import optimd_pb2 as pb
from optimd.v1 import optimd_pb2_grpc as pb_grpc
from optimd.testing import Daemon
from optimd.torch import AdamW

# The resume secrets of these tests' sessions stay in their own scratch.
os.environ.setdefault("OPTIMD_SECRETS_DIR",
                      tempfile.mkdtemp(prefix="optimd-secrets-"))

STEPS = 5


def grad(i, step, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(
        1000 * i + step))


def train(params, opt, i, steps):
    for step in steps:
        for k, p in enumerate(params):
            p.grad = grad(i * 10 + k, step, p.numel()).view_as(p)
        opt.step()


def make(daemon, i, job, **kw):
    torch.manual_seed(i)
    params = [torch.nn.Parameter(torch.randn(33, 7)),
              torch.nn.Parameter(torch.randn(100))]
    return params, AdamW(params, lr=1e-2, address=daemon.address,
                         job_id=job, master_weights=True, **kw)


def samples(families):
    """{(sample name, labels): value} of parsed families; bucket bounds as
    floats (the text may spell them differently from Python's repr)."""
    out = {}
    for f in families.values():
        for s in f.samples:
            labels = dict(s.labels)
            if "le" in labels:
                labels["le"] = float(labels["le"])
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


# Each field of GetMetricsResponse and the series it is exposed as.
SCALARS = (("optimd_steps_total", "steps"),
           ("optimd_skipped_steps_total", "skipped_steps"),
           ("optimd_plan_builds_total", "plan_builds"),
           ("optimd_plan_entry_updates_total", "plan_entry_updates"),
           ("optimd_sessions", "sessions"),
           ("optimd_state_bytes", "state_bytes"),
           ("optimd_metadata_bytes", "metadata_bytes"),
           ("optimd_worker_tasks", "worker_tasks"),
           ("optimd_checkpoint_saves_total", "checkpoint_saves"),
           ("optimd_checkpoint_save_bytes_total", "checkpoint_save_bytes"),
           ("optimd_checkpoint_loads_total", "checkpoint_loads"),
           ("optimd_checkpoint_load_bytes_total", "checkpoint_load_bytes"),
           ("optimd_checkpoint_failures_total", "checkpoint_failures"))
HISTOGRAMS = (("optimd_step_latency_seconds", "step_latency"),
              ("optimd_step_host_seconds", "step_host_time"),
              ("optimd_step_device_seconds", "step_device_time"),
              ("optimd_step_ready_wait_seconds", "step_ready_wait"))
PER_SESSION = (("optimd_session_state_bytes", "state_bytes"),
               ("optimd_session_steps_total", "steps"))


def reply_samples(reply):
    """What samples() should read from /metrics, from a GetMetrics reply's
    exact values."""
    out = {("optimd_build_info", (("api_revision", str(reply.api_revision)),
                                  ("version", reply.daemon_version))): 1.0}
    for name, field in SCALARS:
        out[(name, ())] = float(getattr(reply, field))
    for name, field in HISTOGRAMS:
        h = getattr(reply, field)
        out[(name + "_count", ())] = float(h.count)
        out[(name + "_sum", ())] = h.sum
        for bound, count in zip(h.bounds, h.counts):
            out[(name + "_bucket", (("le", bound),))] = float(count)
        out[(name + "_bucket", (("le", float("inf")),))] = float(h.count)
    for name, field in PER_SESSION:
        for info in reply.session_infos:
            labels = (("job_id", info.job_id), ("rank", str(info.rank)))
            out[(name, labels)] = float(getattr(info, field))
    return out


class ShutdownMessageTest(unittest.TestCase):
    def test_a_call_refused_by_a_stopping_daemon_says_so(self):
        # The daemon's refusal while it drains (UNAVAILABLE "optimd is
        # shutting down"), as gRPC hands it over: not "no daemon answers".
        class Refusal(grpc.RpcError):
            def code(self):
                return grpc.StatusCode.UNAVAILABLE

            def details(self):
                return "optimd is shutting down"
        e = optimd.errors.from_rpc_error(Refusal(), "unix:/run/o.sock")
        self.assertIsInstance(e, optimd.DaemonUnavailableError)
        self.assertIn("unix:/run/o.sock is shutting down", str(e))
        self.assertNotIn("start one", str(e))


class GoneDaemonTest(unittest.TestCase):
    def test_a_call_to_a_daemon_that_stopped_is_not_sent_again(self):
        # A call that never left waits for the connection once more only
        # where something still listens (a connection gRPC dropped): a
        # daemon that stopped fails the call at once, as an optimizer's
        # close at exit does.
        d = Daemon()
        client = optimd.client.Client(d.address)
        sent = []

        class Recorder:
            def __init__(self, stub):
                self.stub = stub

            def __getattr__(self, name):
                method = getattr(self.stub, name)

                def call(*args, **kwargs):
                    sent.append(kwargs.get("wait_for_ready", False))
                    return method(*args, **kwargs)
                return call
        client._stub = Recorder(client._stub)
        try:
            client.get_metrics()
            self.assertFalse(optimd.client._refuses_connections(d.address))
            d.stop()
            self.assertTrue(optimd.client._refuses_connections(d.address))
            with self.assertRaises(optimd.DaemonUnavailableError):
                client.get_metrics()
            self.assertEqual(sent, [False, False])
        finally:
            client.close()
            d.stop()


class SharedSegmentTest(unittest.TestCase):
    """Shared-memory segments of a session freed after its trainer died."""

    def segment(self, tag):
        """A shared-memory segment of 16 KiB of this test's own: its name."""
        name = "/optimd-ops-%s-%d-%s" % (tag, os.getpid(), os.urandom(4).hex())
        fd = os.open("/dev/shm" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL,
                     0o600)
        self.addCleanup(lambda: os.path.exists("/dev/shm" + name) and
                        os.unlink("/dev/shm" + name))
        os.ftruncate(fd, 4 * 4096)
        os.close(fd)
        return name

    @staticmethod
    def handle(name, offset):
        return pb.BufferHandle(shared_memory=pb.SharedMemoryBuffer(
            segment_name=name, offset=offset, size=4096))

    def register(self, stub, session, tensors):
        """Registers group "g" of `tensors`: (name, segment, offset,
        frozen) each, 1024 float32 elements, a gradient after the
        parameter unless frozen."""
        request = pb.RegisterGroupRequest(group_id="g")
        request.hyperparameters.lr = 0.01
        for name, segment, offset, frozen in tensors:
            t = request.tensors.add(name=name, numel=1024, frozen=frozen,
                                    param_dtype=pb.DTYPE_FLOAT32,
                                    grad_dtype=pb.DTYPE_FLOAT32)
            t.param.CopyFrom(self.handle(segment, offset))
            if not frozen:
                t.grad.CopyFrom(self.handle(segment, offset + 4096))
        stub.RegisterGroup(request, metadata=session, timeout=30)

    @staticmethod
    def session(stub, job, pid, rank=0, world_size=1, sharding=0):
        token = stub.CreateSession(pb.CreateSessionRequest(
            job_id=job, rank=rank, world_size=world_size, device=-1,
            trainer_pid=pid, gradient_sharding=sharding),
            timeout=30).session_token
        return (("x-optimd-session", token),)

    def free_a_trainers_session(self, stub, shared=None):
        """A session whose trainer then dies, with a frozen tensor in a
        segment of its own (and one in `shared`): waits until the daemon
        freed it, which removes its own segment; the seconds it took."""
        own = self.segment("own")
        child = subprocess.Popen(["sleep", "60"])
        gone = self.session(stub, "gone", child.pid)
        tensors = [("own", own, 0, True)]
        if shared:
            tensors.append(("b", shared, 2 * 4096, True))
        self.register(stub, gone, tensors)
        child.kill()
        child.wait()
        start = time.time()
        while os.path.exists("/dev/shm" + own):
            self.assertLess(time.time() - start, 30, "never freed")
            time.sleep(0.05)
        return time.time() - start

    def test_a_freed_sessions_segment_stays_while_another_session_maps_it(
            self):
        # Session A (a live trainer, this process) registers buffers in a
        # segment the freed session maps too: the segment's name stays
        # A's, and A's buffers are still resolved by it.
        shared = self.segment("shared")
        with Daemon(flags=["--orphan_grace_s=1"]) as d, \
                grpc.insecure_channel(d.address) as channel:
            stub = pb_grpc.OptimizerStub(channel)
            live = self.session(stub, "live", os.getpid())
            self.register(stub, live, [("a", shared, 0, False)])
            self.free_a_trainers_session(stub, shared)
            self.assertTrue(os.path.exists("/dev/shm" + shared))
            update = pb.UpdateBuffersRequest(group_id="g")
            update.tensors.add(name="a").grad.CopyFrom(
                self.handle(shared, 3 * 4096))
            stub.UpdateBuffers(update, metadata=live, timeout=30)
            stub.Step(pb.StepRequest(), metadata=live, timeout=30)

    def test_a_step_waiting_for_other_ranks_does_not_hold_up_the_freeing(
            self):
        # Rank 0 of a two-rank job waits in its step for rank 1 (up to the
        # 60 s rank timeout), holding its session: a session freed
        # meanwhile goes at once all the same.
        segment = self.segment("ranks")
        with Daemon(flags=["--orphan_grace_s=1", "--rank_timeout_s=60"]) \
                as d, grpc.insecure_channel(d.address) as channel:
            stub = pb_grpc.OptimizerStub(channel)
            ranks = [self.session(stub, "ranks", os.getpid(), rank, 2,
                                  pb.GRADIENT_SHARDING_SHARDED)
                     for rank in (0, 1)]
            for rank, session in enumerate(ranks):
                self.register(stub, session,
                              [("a", segment, rank * 8192, False)])
            step = pb.StepRequest(max_grad_norm=1.0)
            waiting = threading.Thread(target=stub.Step, args=(step,),
                                       kwargs=dict(metadata=ranks[0],
                                                   timeout=60))
            waiting.start()
            time.sleep(0.5)
            took = self.free_a_trainers_session(stub)
            self.assertTrue(waiting.is_alive(), "rank 0 stopped waiting")
            self.assertLess(took, 15)
            stub.Step(step, metadata=ranks[1], timeout=60)
            waiting.join(60)


class OperationsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optimd-ops-")
        self.flags = ["--save_dir=" + os.path.join(self.dir, "saved"),
                      "--metrics_listen=127.0.0.1:0", "--orphan_grace_s=1"]

    def start(self, name):
        log = open(os.path.join(self.dir, name), "w+")
        d = Daemon(flags=self.flags, stderr=log)
        d.log = log
        text = self.wait_for_log(d, r"metrics on http port (\d+)")
        d.metrics_url = "http://127.0.0.1:%s/metrics" % re.search(
            r"metrics on http port (\d+)", text).group(1)
        return d

    def wait_for_log(self, d, pattern, timeout=20):
        deadline = time.time() + timeout
        while True:
            d.log.seek(0)
            text = d.log.read()
            if re.search(pattern, text):
                return text
            self.assertLess(time.time(), deadline, "log never said " + pattern)
            time.sleep(0.05)

    def scrape_text(self, d):
        with urllib.request.urlopen(d.metrics_url, timeout=10) as r:
            self.assertEqual(r.status, 200)
            self.assertIn("text/plain", r.headers["Content-Type"])
            return r.read().decode()

    def scrape(self, d):
        text = self.scrape_text(d)
        return {f.name: f for f in text_string_to_metric_families(text)}

    def test_restart_metrics_and_log_lines(self):
        d1 = self.start("first.log")
        runs = [make(d1, i, "ops-%d" % i) for i in range(2)]
        for i, (params, opt) in enumerate(runs):
            train(params, opt, i, range(STEPS))
        # Held to the end: collected, they would close their sessions.
        evicted, first = self.refuse_evict_kill_and_resume(d1)
        self.save_and_load_checkpoints(runs)
        self.assert_metrics_match_events(d1)
        self.refuse_a_burst_of_calls(d1)
        self.assertEqual(d1.stop(), 0)  # SIGTERM: saves both sessions
        self.assert_first_log_lines(d1)

        d2 = self.start("second.log")
        try:
            self.assert_trainers_resume_bit_exactly(d2, runs)
        finally:
            self.assertEqual(d2.stop(), 0)
        self.assert_second_log_lines(d2)

    def refuse_evict_kill_and_resume(self, d):
        """A refused step, an evicted, a killed and a resumed session."""
        # A refused step, an evicted session, a killed trainer.
        params, bad = make(d, 9, "refused")
        bad.param_groups[0]["lr"] = float("nan")
        with self.assertRaises(optimd.InvalidArgumentError):
            train(params, bad, 9, range(1))
        bad.close()
        _, evicted = make(d, 8, "evicted")
        optimd.Client(d.address).evict_session("evicted", 0)
        trainer = subprocess.Popen([sys.executable, "-c", (
            "import os, signal, torch\n"
            "from optimd.torch import AdamW\n"
            "p = torch.nn.Parameter(torch.randn(10))\n"
            "opt = AdamW([p], address=%r, job_id='killed')\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n") % d.address])
        self.assertEqual(trainer.wait(60), -9)
        self.wait_for_log(d, r"job 'killed' rank 0 freed")
        # A live session resumed by a restarted trainer.
        _, first = make(d, 7, "again")
        _, again = make(d, 7, "again", resume=True)
        self.assertTrue(again.resumed)
        again.close()
        return evicted, first

    def save_and_load_checkpoints(self, runs):
        """Streams a save and load; a save and a damaged load that fail."""
        # Checkpoints: a streamed save and load (the same state back), a
        # save that fails, and a streamed load of damaged bytes that fails
        # and changes nothing.
        blob = b"".join(runs[0][1].state_bytes())
        runs[0][1].load_state_bytes([blob])
        not_a_dir = os.path.join(self.dir, "file")
        open(not_a_dir, "w").close()
        with self.assertRaises(optimd.OptimdError):
            runs[1][1].save_checkpoint(os.path.join(not_a_dir, "ckpt"))
        damaged = bytearray(blob)
        damaged[-1] ^= 0xFF
        with self.assertRaises(optimd.OptimdError):
            runs[1][1].load_state_bytes([bytes(damaged)])

    def assert_metrics_match_events(self, d):
        """/metrics counts the events, exactly as GetMetrics replies."""
        families = self.scrape(d)
        # Left: the two trainers (refused closed, evicted, killed freed).
        self.assertEqual(families["optimd_sessions"].samples[0].value, 2)
        steps = {s.labels["job_id"]: s.value for s in
                 families["optimd_session_steps"].samples
                 if s.name == "optimd_session_steps_total"}
        self.assertEqual(steps, {"ops-0": STEPS, "ops-1": STEPS})
        latency = families["optimd_step_latency_seconds"]
        count = [s.value for s in latency.samples
                 if s.name.endswith("_count")][0]
        self.assertGreaterEqual(count, 2 * STEPS)
        for family, value in (("optimd_checkpoint_saves", 1),
                              ("optimd_checkpoint_loads", 1),
                              ("optimd_checkpoint_failures", 2)):
            self.assertEqual(families[family].samples[0].value, value)
        # Full precision: every sample of the scrape, parsed, is the very
        # double GetMetrics replies with (nothing changed in between), and
        # the reply's own text is the same text.
        reply = optimd.Client(d.address).get_metrics()
        self.assertEqual(samples(families), reply_samples(reply))
        self.assertEqual(self.scrape_text(d), reply.prometheus_text)
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(d.metrics_url.replace("/metrics", "/x"))
        self.assertEqual(e.exception.code, 404)

    def refuse_a_burst_of_calls(self, d):
        """Makes 41 calls that the daemon refuses, one after another."""
        # A burst of refused calls: 20 lines per 10 s window, and the rest
        # counted in one line, here at the latest when the daemon stops (41
        # calls put more than 20 in one window, however they fall).
        admin = optimd.Client(d.address)
        for _ in range(41):
            with self.assertRaises(optimd.NotFoundError):
                admin.evict_session("nobody", 0)
        admin.close()

    def assert_first_log_lines(self, d):
        """The stopped first daemon's log has a dated line for each event."""
        d.log.seek(0)
        log = d.log.read()
        for line in (r"session created: job 'ops-0' rank 0",
                     r"group registered: job 'ops-1' rank 0 group '0', 2 "
                     r"tensors",
                     r"warning optimd: refused /optimd.v1.Optimizer/Step"
                     r"(Stream)?: INVALID_ARGUMENT: .*learning rate",
                     r"session closed: job 'refused' rank 0",
                     r"session evicted: job 'evicted' rank 0",
                     r"job 'killed' rank 0 orphaned",
                     r"session resumed: job 'again' rank 0",
                     r"checkpoint save started \(stream\): job 'ops-0'",
                     r"checkpoint saved \(stream\): job 'ops-0' rank 0, "
                     r"\d+ bytes",
                     r"checkpoint load started \(stream\): job 'ops-0'",
                     r"checkpoint loaded \(stream\): job 'ops-0' rank 0, "
                     r"\d+ bytes",
                     r"checkpoint save started: job 'ops-1' rank 0 to .*"
                     r"/file/ckpt",
                     r"warning optimd: checkpoint save failed: job 'ops-1' "
                     r"rank 0: ",
                     r"warning optimd: checkpoint load failed \(stream\): "
                     r"job 'ops-1' rank 0: ",
                     r"warning optimd: refused /optimd.v1.Optimizer/"
                     r"EvictSession: NOT_FOUND: ",
                     r"warning optimd: \d+ more refused calls were not "
                     r"logged in the last window",
                     r"received SIGTERM",
                     r"saving 2 sessions to ",
                     r"saved job 'ops-1' rank 0: \d+ bytes",
                     r"info optimd: stopped"):
            self.assertRegex(log, line)
        self.assertRegex(log, r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")  # dated

    def assert_trainers_resume_bit_exactly(self, d, runs):
        """Both trainers resume on `d` and go on as runs never stopped."""
        for i in range(2):
            fresh = [torch.nn.Parameter(torch.zeros_like(p))
                     for p in runs[i][0]]
            opt = AdamW(fresh, lr=1e-2, address=d.address,
                        job_id="ops-%d" % i, master_weights=True,
                        resume=True)
            self.assertTrue(opt.resumed)
            train(fresh, opt, i, range(STEPS, 2 * STEPS))
            ref, ref_opt = make(d, i, "ref-%d" % i)
            train(ref, ref_opt, i, range(2 * STEPS))
            for p, q in zip(fresh, ref):
                self.assertTrue(torch.equal(p.detach(), q.detach()))
            opt.close()
            ref_opt.close()
        families = self.scrape(d)
        self.assertIn("optimd_checkpoint_loads", families)
        self.assertEqual(
            families["optimd_checkpoint_loads"].samples[0].value, 2)

    def assert_second_log_lines(self, d):
        """The second daemon's log says it loaded the saved sessions."""
        d.log.seek(0)
        log = d.log.read()
        self.assertRegex(log, r"session resumed: job 'ops-0' rank 0 .*; its "
                              r"state saved at the daemon's last stop is in ")
        self.assertRegex(log, r"checkpoint load started: job 'ops-0' rank 0")
        self.assertRegex(log, r"checkpoint loaded: job 'ops-0'")

    def test_shutdown_save_is_bounded_and_names_what_is_lost(self):
        """--shutdown_save_s bounds the save at SIGTERM: sessions are saved
        smallest first, and when time runs out the daemon names the ones
        lost, exits with status 1, and its next start removes the
        unfinished file."""
        self.flags.append("--shutdown_save_s=0.001")
        d1 = self.start("first.log")
        _, tiny = make(d1, 0, "tiny")
        big = [torch.nn.Parameter(torch.zeros(20_000_000))]
        big_opt = AdamW(big, address=d1.address, job_id="big")
        for p in big:
            p.grad = torch.ones_like(p)
        big_opt.step()
        self.assertEqual(d1.stop(), 1)
        d1.log.seek(0)
        log = d1.log.read()
        order = re.findall(r"saving job '(\w+)' rank 0 \((\d) of 2\)", log)
        self.assertEqual(order[0], ("tiny", "1"))
        self.assertRegex(log, r"warning optimd: the shutdown save ran out of "
                              r"its 1ms \(--shutdown_save_s\); not saved, "
                              r"their state is lost: .*job 'big' rank 0")
        self.assertRegex(log, r"stopped before every session was saved")
        self.assertNotRegex(log, r"saved job 'big'")

        d2 = self.start("second.log")
        try:
            self.wait_for_log(d2, r"listening on")
            saved = os.path.join(self.dir, "saved")
            for root, _, files in os.walk(saved):
                for name in files:
                    self.assertNotIn(".tmp-", name, "left: " + name)
            with self.assertRaises(optimd.NotFoundError):
                AdamW([torch.nn.Parameter(torch.zeros(20_000_000))],
                      address=d2.address, job_id="big", resume=True)
        finally:
            self.assertEqual(d2.stop(), 0)

    def test_log_level_warning_keeps_only_warnings_and_errors(self):
        """--log_level=warning drops the info lines (sessions, start-up)
        and keeps refusals; a bad level keeps the daemon from starting."""
        log = open(os.path.join(self.dir, "quiet.log"), "w+")
        d = Daemon(flags=["--log_level=warning"], stderr=log)
        try:
            opt = AdamW([torch.nn.Parameter(torch.zeros(4))],
                        address=d.address, job_id="quiet")
            opt.step()
            admin = optimd.Client(d.address)
            with self.assertRaises(optimd.NotFoundError):
                admin.evict_session("nobody", 0)
            admin.close()
            opt.close()
        finally:
            self.assertEqual(d.stop(), 0)
        log.seek(0)
        text = log.read()
        self.assertRegex(text, r"warning optimd: refused /optimd.v1.Optimizer/"
                               r"EvictSession: NOT_FOUND: ")
        self.assertNotIn(" info optimd: ", text)
        out = subprocess.run(
            [optimd.testing.find_binary(), "--log_level=verbose",
             "--listen=unix:" + os.path.join(self.dir, "s.sock")],
            capture_output=True, text=True, timeout=60)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("must be info, warning or error", out.stderr)

    def test_start_up_failures_are_logged_as_errors(self):
        """What keeps the daemon from starting is an error line (dated,
        levelled), and the exit status is non-zero."""
        binary = optimd.testing.find_binary()
        sock = "unix:" + os.path.join(self.dir, "s.sock")
        for flags, status, said in (
                (["--backend=bogus"], 2,
                 "--backend must be auto, cpu or cuda, not 'bogus'"),
                (["--save_dir=relative/dir"], 1,
                 "--save_dir must be an absolute directory"),
                (["--listen=127.0.0.1:0"], 2,
                 r"listening on TCP \(127.0.0.1:0\) needs TLS")):
            out = subprocess.run([binary, "--listen=" + sock] + flags,
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, status, out.stderr)
            self.assertRegex(out.stderr,
                             r"(?m)^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}"
                             r"[+-]\d\d:\d\d error optimd: " + said)


if __name__ == "__main__":
    unittest.main()
