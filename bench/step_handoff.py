"""How soon a streamed step request reaches gRPC while the trainer's thread
goes on with Python work, as a training loop does after step() (the next
forward launching its kernels). gRPC takes a stream's requests on a Python
thread of its own, which needs the GIL.

Two ways in one run, alternating: "queued" puts the request in the queue
gRPC's thread reads and returns at once (how optimd sent steps before);
"handed off" returns once gRPC's thread has taken it
(optimd._step_stream.StepStream.send). For each: the delay from
step_async() to gRPC's thread taking the request, and what step_async()
costs the trainer's thread. Needs only the CPU backend:

    PYTHONPATH=client/python OPTIMD_BINARY=bazel-bin/server/optimd \\
        python3 bench/step_handoff.py [--busy_ms 5] [--rounds 200]
"""
import argparse
import statistics
import time

from optimd import _step_stream
from optimd.client import Client
from optimd.testing import Daemon


def queued_send(self, request):
    """StepStream.send as it was: the request queued for gRPC's thread, no
    wait for it to be taken (bench/train_bench.py --queued_send too)."""
    import concurrent.futures
    future = concurrent.futures.Future()
    with self._lock:
        self._pending.append(future)
    self._requests.put((request, _NoEvent()))
    return future


class _Queued(_step_stream.StepStream):
    send = queued_send


class _NoEvent:
    def set(self):
        pass


def _measure(client, busy_s, taken):
    """(delay until taken, step_async's own time) of one step, seconds."""
    taken.clear()
    t0 = time.perf_counter()
    future = client._stream.send(client._step_request(assume_finite=True))
    t1 = time.perf_counter()
    while time.perf_counter() - t0 < busy_s:
        pass  # the trainer's Python work
    future.result()
    return taken[0] - t0, t1 - t0


def _stream_of(client, stream_class):
    from optimd.client import SESSION_METADATA_KEY
    return stream_class(client._stub, ((SESSION_METADATA_KEY, client.token),),
                        client.address)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy_ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    taken = []
    outgoing = _step_stream.StepStream._outgoing

    def recording(self):
        for request in outgoing(self):
            taken.append(time.perf_counter())
            yield request
    _step_stream.StepStream._outgoing = recording
    with Daemon() as daemon:
        results = {"queued": ([], []), "handed off": ([], [])}
        streams = {"queued": _Queued, "handed off": _step_stream.StepStream}
        clients = {}
        for name in results:
            clients[name] = Client(daemon.address)
            clients[name].create_session("handoff-" + name.replace(" ", "-"))
            clients[name]._stream = _stream_of(clients[name], streams[name])
        for r in range(args.rounds):
            for name in (("queued", "handed off") if r % 2 else
                         ("handed off", "queued")):
                delay, cost = _measure(clients[name], args.busy_ms / 1e3,
                                       taken)
                results[name][0].append(delay)
                results[name][1].append(cost)
        for c in clients.values():
            c._stream.close()
            c._stream = None
            c.close_session()
            c.close()
    med = {n: (statistics.median(d) * 1e6, statistics.median(c) * 1e6)
           for n, (d, c) in results.items()}
    for name, (delay, cost) in med.items():
        print("%-10s: request taken by gRPC after %8.1f us (median), "
              "step_async costs the caller %6.1f us" % (name, delay, cost))
    print("handed off / queued delay: %.3f; caller cost difference: %+.1f us"
          % (med["handed off"][0] / med["queued"][0],
             med["handed off"][1] - med["queued"][1]))


if __name__ == "__main__":
    main()
