"""The daemon's memory for calls being received is bounded as a whole
(--max_request_memory_bytes, a gRPC ResourceQuota), not only per message:
many large requests at once are refused with RESOURCE_EXHAUSTED and the
daemon does not grow past the bound. What a client is told then, and when
its connection breaks while the daemon runs on."""
import collections
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import unittest

import grpc
import torch

import optimd
from optimd.testing import Daemon
from optimd.torch import AdamW
from optimd.v1 import optimd_pb2 as pb
from optimd.v1 import optimd_pb2_grpc as pb_grpc

QUOTA = 64 << 20
REQUESTS = 32
REQUEST_BYTES = 48 << 20  # each below the quota; together 24 times it


def peak_rss(pid):
    """The process's peak resident memory (VmHWM), in bytes."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM")


class RequestMemoryTest(unittest.TestCase):
    def test_concurrent_large_requests_stay_within_the_bound(self):
        flags = ["--max_request_memory_bytes=%d" % QUOTA]
        with Daemon(flags=flags) as d:
            before = peak_rss(d.process.pid)
            request = pb.SetStateRequest(group_id="g")
            request.tensors.add().data = b"x" * REQUEST_BYTES
            raw = request.SerializeToString()
            codes = collections.Counter()
            lock = threading.Lock()

            def send():
                # A connection of its own per request.
                with grpc.insecure_channel(d.address, options=[
                        ("grpc.max_send_message_length", -1),
                        ("grpc.use_local_subchannel_pool", 1)]) as ch:
                    call = ch.unary_unary("/optimd.v1.Optimizer/SetState")
                    try:
                        call(raw, timeout=120)
                        code = "OK"
                    except grpc.RpcError as e:
                        code = e.code().name
                with lock:
                    codes[code] += 1

            threads = [threading.Thread(target=send) for _ in range(REQUESTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            grown = peak_rss(d.process.pid) - before
            print("statuses", dict(codes), "peak growth", grown >> 20, "MiB")
            # Refused for memory (the stream reset, or the connection closed
            # when gRPC reclaims it), or received and then refused for the
            # missing session token: nothing else.
            self.assertGreater(codes["RESOURCE_EXHAUSTED"], 0, codes)
            self.assertLessEqual(
                set(codes), {"RESOURCE_EXHAUSTED", "UNAVAILABLE",
                             "UNAUTHENTICATED"}, codes)
            # The quota's buffers plus a parsed copy of what fits, with room
            # for gRPC's own: far below the 1.5 GiB sent at once.
            self.assertLess(grown, 5 * QUOTA, codes)
            # The daemon serves on.
            p = torch.nn.Parameter(torch.ones(8))
            opt = AdamW([("w", p)], lr=0.1, address=d.address)
            p.grad = torch.ones(8)
            opt.step()
            self.assertTrue(torch.all(p.detach() < 1))
            opt.close()

    def test_a_request_refused_for_request_memory_says_so(self):
        # gRPC resets a call its quota cannot hold before the daemon reads
        # it: the client names the flag, and nothing changed. (Replies count
        # against the quota too: only the small tensor's state is read.)
        with Daemon(flags=["--max_request_memory_bytes=%d" % (8 << 20)]) \
                as d:
            big = torch.nn.Parameter(torch.ones(4 << 20))
            small = torch.nn.Parameter(torch.ones(8))
            opt = AdamW([("big", big), ("small", small)], lr=0.1,
                        address=d.address)
            big.grad, small.grad = torch.ones_like(big), torch.ones(8)
            opt.step()

            def small_exp_avg():
                state = opt.client.get_state(tensor_names=["small"])
                return [t.data for t in state.groups[0].tensors
                        if t.kind == "exp_avg"]
            before = small_exp_avg()
            group = {k: v for k, v in opt.param_groups[0].items()
                     if k != "params"}
            zeros = {"step": torch.tensor(1.0)}
            whole = {"param_groups": [dict(group, params=[0, 1])],
                     "state": {i: dict(zeros, exp_avg=torch.zeros_like(p),
                                       exp_avg_sq=torch.zeros_like(p))
                               for i, p in enumerate((big, small))}}
            # Under load gRPC may close the connection instead of resetting
            # the call (the client's write then breaks): the client cannot
            # tell that from any broken connection, so that try is made
            # again on a new connection.
            refused = None
            for _ in range(3):
                try:
                    opt.load_state_dict(whole)  # a 32 MiB SetState
                except optimd.DaemonUnavailableError as e:
                    self.assertIn("broke during the call", str(e))
                    continue
                except optimd.ResourceExhaustedError as e:
                    refused = e
                    break
                self.fail("a 32 MiB SetState was taken")
            self.assertIsNotNone(refused, "every try broke the connection")
            self.assertIn("--max_request_memory_bytes", str(refused))
            self.assertIn("Nothing was changed", str(refused))
            self.assertEqual(small_exp_avg(), before)
            self.assertNotEqual(before, [bytes(32)])
            opt.close()


# TensorSpec{name: "a", param_dtype: DTYPE_FLOAT32} as
# RegisterGroupRequest.tensors (field 4): 7 bytes on the wire, hundreds of
# bytes once parsed and converted.
TINY_TENSOR = b"\x22\x05\x0a\x01\x61\x18\x01"


class ParseCostTest(unittest.TestCase):
    """A request's cost once parsed is known from its bytes before it is
    parsed: more entries than a session can hold are refused unparsed, and
    the rest are held against --max_request_memory_bytes at that cost."""

    def register_raw(self, d, token, body, timeout=300):
        with grpc.insecure_channel(d.address, options=[
                ("grpc.max_send_message_length", -1),
                ("grpc.use_local_subchannel_pool", 1)]) as ch:
            call = ch.unary_unary("/optimd.v1.Optimizer/RegisterGroup")
            try:
                return "OK", call(body, timeout=timeout, metadata=(
                    ("x-optimd-session", token),))
            except grpc.RpcError as e:
                return e.code().name, e.details()

    def test_too_many_tensors_are_refused_before_parsing(self):
        with Daemon(flags=["--cpu_threads=1"]) as d:
            client = optimd.Client(d.address)
            self.addCleanup(client.close)
            client.create_session("parse-cost")
            before = peak_rss(d.process.pid)
            # 13 MiB on the wire; parsed and converted it took 1.2 GiB.
            code, details = self.register_raw(
                d, client.token, b"\x0a\x01g" + TINY_TENSOR * 2000000)
            grown = peak_rss(d.process.pid) - before
            self.assertEqual(code, "RESOURCE_EXHAUSTED", details)
            self.assertIn("2000000 entries of "
                          "optimd.v1.RegisterGroupRequest.tensors", details)
            self.assertIn("at most 1048576", details)
            # gRPC's buffer of the bytes, and nothing parsed.
            self.assertLess(grown, 64 << 20)
            # A large valid registration still works, and the session too.
            request = pb.RegisterGroupRequest(group_id="g")
            for i in range(100000):
                request.tensors.add(name="t%d" % i,
                                    param_dtype=pb.DTYPE_FLOAT32,
                                    grad_dtype=pb.DTYPE_FLOAT32, frozen=True)
            code, reply = self.register_raw(
                d, client.token, request.SerializeToString())
            self.assertEqual(code, "OK", reply)
            self.assertEqual(
                [g.group_id for g in client.get_state(
                    metadata_only=True).groups], ["g"])

    def test_unknown_fields_are_counted_before_parsing(self):
        # Protobuf keeps every unknown field as an object of its own: 5
        # million empty ones (field 100, 3 bytes each) in a CreateSession
        # would cost the daemon hundreds of MB once parsed.
        with Daemon(flags=["--cpu_threads=1"]) as d:
            before = peak_rss(d.process.pid)
            body = b"\x0a\x01j\x18\x01\x20\xff\xff\xff\xff\x0f" + \
                b"\xa2\x06\x00" * 5000000
            with grpc.insecure_channel(d.address, options=[
                    ("grpc.max_send_message_length", -1)]) as ch:
                call = ch.unary_unary("/optimd.v1.Optimizer/CreateSession")
                with self.assertRaises(grpc.RpcError) as e:
                    call(body, timeout=120)
            grown = peak_rss(d.process.pid) - before
            self.assertEqual(e.exception.code(),
                             grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("5000000 fields unknown to "
                          "optimd.v1.CreateSessionRequest",
                          e.exception.details())
            self.assertLess(grown, 64 << 20)
            client = optimd.Client(d.address)
            self.addCleanup(client.close)
            self.assertEqual(len(client.list_sessions().sessions), 0)

    def test_requests_are_held_at_their_parsed_cost(self):
        # 300,000 tiny tensors are 2 MiB on the wire, about 200 MB once
        # parsed and converted: against a 64 MiB bound, one at a time is
        # taken (alone, it passes the bound) and those arriving meanwhile
        # are refused naming the flag, where encoded sizes would take all.
        flags = ["--max_request_memory_bytes=%d" % (64 << 20),
                 "--cpu_threads=1"]
        with Daemon(flags=flags) as d:
            client = optimd.Client(d.address)
            self.addCleanup(client.close)
            client.create_session("parse-cost")
            body = b"\x0a\x01g" + TINY_TENSOR * 300000
            results = []
            lock = threading.Lock()

            def send():
                result = self.register_raw(d, client.token, body)
                with lock:
                    results.append(result)
            threads = [threading.Thread(target=send) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            codes = collections.Counter(code for code, _ in results)
            # Taken ones fail on the duplicate name "a" (ALREADY_EXISTS).
            self.assertLessEqual(set(codes),
                                 {"RESOURCE_EXHAUSTED", "ALREADY_EXISTS"},
                                 results)
            self.assertGreater(codes["RESOURCE_EXHAUSTED"], 0, results)
            self.assertGreater(codes["ALREADY_EXISTS"], 0,
                               "none was taken alone: %s" % results)
            for code, details in results:
                if code == "RESOURCE_EXHAUSTED":
                    self.assertIn("--max_request_memory_bytes", details)


class UnixProxy:
    """Forwards connections on a Unix socket of its own to the daemon's,
    byte for byte; break_connections() closes those open now (a network
    fault) while new ones are still taken."""

    def __init__(self, target, path):
        self.address = "unix:" + path
        self._target = target
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(path)
        self._listener.listen(16)
        self._open = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self._target)
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b),
                                 daemon=True).start()

    @staticmethod
    def _pump(src, dst):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def break_connections(self):
        with self._lock:
            broken, self._open = self._open, []
        for s in broken:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self._listener.close()
        self.break_connections()


class BrokenConnectionTest(unittest.TestCase):
    def test_a_broken_connection_is_not_reported_as_a_daemon_gone(self):
        # Rank 0 reaches the daemon through a proxy; its step waits for
        # rank 1 when the proxy breaks the connection. The client finds the
        # daemon still answering and says so (not "state lost"); the
        # session is still there.
        scratch = tempfile.mkdtemp(prefix="optimd-proxy-")
        self.addCleanup(shutil.rmtree, scratch, True)
        with Daemon(flags=["--rank_timeout_s=60"]) as d:
            proxy = UnixProxy(d.socket_path, os.path.join(scratch, "p.sock"))
            self.addCleanup(proxy.close)
            params = [torch.nn.Parameter(torch.ones(8)) for _ in (0, 1)]
            opts = [AdamW([("w", params[r])], lr=0.1, job_id="proxied",
                          address=(proxy.address, d.address)[r], rank=r,
                          world_size=2, gradient_sharding="replicated")
                    for r in (0, 1)]
            for p in params:
                p.grad = torch.ones(8)
            failed = []

            def rank0():
                try:
                    opts[0].step()
                except optimd.OptimdError as e:
                    failed.append(e)
            t = threading.Thread(target=rank0)
            t.start()
            # The step stays unanswered until rank 1 steps, which it does
            # not: the break comes while the call is in flight, whenever.
            t.join(0.3)
            proxy.break_connections()
            t.join(30)
            self.assertEqual(len(failed), 1)
            self.assertIsInstance(failed[0], optimd.DaemonUnavailableError)
            self.assertIn("the daemon still answers", str(failed[0]))
            self.assertNotIn("is lost", str(failed[0]))
            listed = optimd.Client(d.address)
            self.addCleanup(listed.close)
            ranks = {s.rank for s in listed.list_sessions().sessions
                     if s.job_id == "proxied"}
            self.assertEqual(ranks, {0, 1})
            # Rank 1 leaving ends rank 0's step in the daemon (ABORTED), if
            # it got there; rank 0 closes over a new connection.
            opts[1].close()
            opts[0].close()


def _frame(kind, flags, stream, payload=b""):
    """An HTTP/2 frame (RFC 9113, section 4.1)."""
    return (len(payload).to_bytes(3, "big") + bytes([kind, flags]) +
            stream.to_bytes(4, "big") + payload)


def _header(name, value):
    """An HPACK literal header field without indexing, names and values
    below 127 bytes (RFC 7541, section 6.2.2)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


class UnreadReplies:
    """A connection that sends unary calls and never reads their replies
    (past the first reads that take the daemon's settings): the replies
    wait in the daemon's send buffers, as behind a stalled caller."""

    def __init__(self, socket_path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" +
                          _frame(4, 0, 0))
        # The daemon's SETTINGS first, acknowledged: gRPC closes a
        # connection whose peer never does.
        self.sock.settimeout(10)
        head = b""
        while len(head) < 9:
            head += self.sock.recv(9 - len(head))
        assert head[3] == 4, head
        self.sock.sendall(_frame(4, 1, 0))
        self.stream = 1

    def call(self, method, request, token):
        fields = b"".join(_header(k, v) for k, v in (
            (b":method", b"POST"), (b":scheme", b"http"),
            (b":path", b"/optimd.v1.Optimizer/" + method),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"),
            (b"x-optimd-session", token.encode())))
        body = request.SerializeToString()
        message = b"\x00" + len(body).to_bytes(4, "big") + body
        self.sock.sendall(_frame(1, 0x4, self.stream, fields) +
                          _frame(0, 0x1, self.stream, message))
        self.stream += 2

    def close(self):
        self.sock.close()


class UnreadRepliesTest(unittest.TestCase):
    # Each GetState reply holds about 24 MiB (parameter, two moments);
    # eight never read would hold 192 MiB, three times a bound of 64 MiB.
    # The replies past the bound are refused, and so are other callers'
    # reads meanwhile, until the stalled caller goes.

    def stall(self, d, channel, bound):
        """A session of one 2M-element tensor, and a caller that asked for
        its state eight times and reads nothing, once the daemon refuses
        reads for it. Returns the optimizer and the stalled caller."""
        before = peak_rss(d.process.pid)
        p = torch.nn.Parameter(torch.ones(2 << 20))
        opt = AdamW([("w", p)], lr=0.1, address=d.address)
        self.addCleanup(opt.close)
        p.grad = torch.ones_like(p)
        opt.step()
        token = opt.client.token
        stalled = UnreadReplies(d.address[len("unix:"):])
        self.addCleanup(stalled.close)
        for _ in range(8):
            stalled.call(b"GetState", pb.GetStateRequest(), token)
        stub = pb_grpc.OptimizerStub(channel)
        refused = None
        for _ in range(100):  # until the daemon has answered them all
            try:
                stub.GetState(pb.GetStateRequest(), timeout=30,
                              metadata=(("x-optimd-session", token),))
            except grpc.RpcError as e:
                refused = e
                break
            time.sleep(0.05)
        self.assertIsNotNone(refused, "a read past the bound was served")
        self.assertEqual(refused.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertIn("replies not yet read", refused.details())
        self.assertIn("--max_request_memory_bytes", refused.details())
        self.assertLess(peak_rss(d.process.pid) - before, 4 * bound)
        return opt, stalled

    def test_replies_never_read_are_bounded_and_let_go_with_the_caller(self):
        bound = 64 << 20
        with Daemon(flags=["--max_request_memory_bytes=%d" % bound]) as d, \
                grpc.insecure_channel(d.address) as channel:
            opt, stalled = self.stall(d, channel, bound)
            # The stalled caller goes while the client's read waits: the
            # client sends its refused read again meanwhile.
            closer = threading.Timer(0.5, stalled.close)
            closer.start()
            state = opt.client.get_state()
            closer.join()
            self.assertEqual(len(state.groups), 1)

    def test_optimctl_reads_again_once_the_stalled_caller_goes(self):
        optimctl = os.environ.get("OPTIMCTL_BINARY", "")
        self.assertTrue(os.path.exists(optimctl),
                        "set OPTIMCTL_BINARY to optimctl's path")
        bound = 32 << 20
        with Daemon(flags=["--max_request_memory_bytes=%d" % bound]) as d:
            p = torch.nn.Parameter(torch.ones(2 << 20))
            opt = AdamW([("w", p)], lr=0.1, address=d.address)
            self.addCleanup(opt.close)
            stalled = UnreadReplies(d.address[len("unix:"):])
            self.addCleanup(stalled.close)
            stalled.call(b"GetState", pb.GetStateRequest(), opt.client.token)
            # Its reply (24 MiB), made while that call held all the daemon's
            # request memory, is taken past half the bound: every other
            # read then finds that half full, however small. No other call
            # may be in flight while the daemon makes it: wait, not probe.
            time.sleep(1.0)
            command = [optimctl, "--target=" + d.address, "sessions"]
            # While the caller stalls, the C++ client's reads are refused
            # for as long as it waits,
            held = subprocess.run(command + ["--timeout_s=1"],
                                  capture_output=True, text=True, timeout=60)
            self.assertNotEqual(held.returncode, 0, held.stdout)
            self.assertIn("replies not yet read", held.stderr)
            # and it sends them again until the caller goes.
            closer = threading.Timer(0.5, stalled.close)
            closer.start()
            listed = subprocess.run(command + ["--timeout_s=30"],
                                    capture_output=True, text=True,
                                    timeout=90)
            closer.join()
            self.assertEqual(listed.returncode, 0, listed.stderr)
            self.assertEqual(len(listed.stdout.splitlines()), 2,
                             listed.stdout)  # the header and the session


if __name__ == "__main__":
    unittest.main()
