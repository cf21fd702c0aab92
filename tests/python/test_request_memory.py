"""The daemon's memory for calls being received is bounded as a whole
(--max_request_memory_bytes, a gRPC ResourceQuota), not only per message:
many large requests at once are refused with RESOURCE_EXHAUSTED and the
daemon does not grow past the bound."""
import collections
import threading
import unittest

import grpc
import torch

from optimd.testing import Daemon
from optimd.torch import AdamW
from optimd.v1 import optimd_pb2 as pb

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


if __name__ == "__main__":
    unittest.main()
