"""Steps of one trainer process reach a daemon's GPU in the order of their
ready flags.

The daemon runs every session of a GPU on one stream, each step behind a
wait for its trainer's ready flag. A trainer with two optimizers on one
GPU writes the second one's ready flag on its stream only after the wait
for the first one's done flag (step() leaves the parameters updated in
stream order). Were the second step queued on the daemon's stream first
(its request overtaking the first one's: two connections, two threads on
each side), its wait would hold the first step back for good, and the
first step's done flag is what the trainer's stream waits for before it
writes the second ready flag: a deadlock of both processes.

So before an optimizer sends a flagged step, it waits until the step that
another optimizer of this process sent last to the same daemon and GPU is
answered: the daemon answers a step once it is queued on its stream (a
`wait_for_step` step once it is done, which needs nothing of the steps
after it). An optimizer's own steps are kept in order by their sequence
numbers. The wait costs nothing where the other optimizer's reply has
come, as between the steps of a GAN's two optimizers, which a forward
and a backward apart.
"""
import concurrent.futures
import threading

_lock = threading.Lock()
_last_sent = {}  # (daemon address, device) -> (owner id, reply future)


def wait_for_earlier(key, owner, timeout):
    """Waits (up to `timeout` s) for the reply of the last flagged step
    another optimizer sent under `key`; its error is its own to raise."""
    with _lock:
        entry = _last_sent.get(key)
    if entry is None or entry[0] == id(owner):
        return
    try:
        entry[1].exception(timeout)
    except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
        pass  # that optimizer's own step() or synchronize() reports it


def sent(key, owner, future):
    """Records `future` as the reply of the last flagged step under `key`."""
    with _lock:
        _last_sent[key] = (id(owner), future)


def forget(owner):
    """Drops what `owner` (closed) sent last."""
    with _lock:
        for key in [k for k, (o, _) in _last_sent.items() if o == id(owner)]:
            del _last_sent[key]
