"""What a RegisterGroup of many small tensors costs the daemon before it is
refused: the daemon's peak resident memory (VmHWM) before and after one
request of N tensors of the smallest encoding (name "a", float32: 7 bytes
each on the wire), sent as raw bytes; bytes per tensor and the ratio to the
encoded size. Above 1,048,576 tensors (what a session holds) the daemon
refuses the request from its bytes, before parsing it; below, it holds the
request's estimated parsed cost against --max_request_memory_bytes.

    OPTIMD_BINARY=bazel-bin/server/optimd PYTHONPATH=client/python \\
        /usr/bin/python3 bench/request_parse_cost.py --tensors 1000000 2000000
"""
import argparse

import grpc

from optimd.client import Client
from optimd.testing import Daemon

# TensorSpec{name: "a", param_dtype: DTYPE_FLOAT32} as
# RegisterGroupRequest.tensors (field 4).
ONE_TENSOR = b"\x22\x05\x0a\x01\x61\x18\x01"


def peak_rss(pid):
    """The process's peak resident memory in bytes."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM for %d" % pid)


def one_request(n):
    """A fresh daemon, one session, one RegisterGroup of n tensors."""
    with Daemon(flags=["--cpu_threads=1"]) as d:
        client = Client(d.address)
        client.create_session("parse-cost")
        channel = grpc.insecure_channel(
            d.address, options=[("grpc.max_send_message_length", -1)])
        body = b"\x0a\x01g" + ONE_TENSOR * n  # group_id "g"
        before = peak_rss(d.process.pid)
        register = channel.unary_unary("/optimd.v1.Optimizer/RegisterGroup")
        try:
            register(body, timeout=600,
                     metadata=(("x-optimd-session", client.token),))
            outcome = "accepted"
        except grpc.RpcError as err:
            outcome = err.code().name
        after = peak_rss(d.process.pid)
        channel.close()
        client.close()
    return len(body), before, after, outcome


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, nargs="+",
                        default=[1000000, 2000000])
    args = parser.parse_args()
    print("%10s %10s %12s %12s %10s %7s  %s" % (
        "tensors", "encoded", "rss before", "rss after", "per tensor",
        "ratio", "outcome"))
    for n in args.tensors:
        size, before, after, outcome = one_request(n)
        grown = after - before
        print("%10d %9.1fM %11.0fM %11.0fM %9.0fB %6.0fx  %s" % (
            n, size / 2**20, before / 2**20, after / 2**20, grown / n,
            grown / size, outcome))


if __name__ == "__main__":
    main()
