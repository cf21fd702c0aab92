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

So before an optimizer marks a step ready and sends it, it waits until
every step that other optimizers of this process sent on the same GPU is
answered: the daemon answers a step once it is queued on its stream (a
`wait_for_step` step once it is done, which needs nothing of the steps
after it). The GPU alone is the key: two addresses may name one daemon,
and a reply of another daemon is no longer to wait for. An optimizer's own
steps are kept in order by their sequence numbers. The wait costs nothing
where the other optimizers' replies have come, as between the steps of a
GAN's two optimizers, a forward and a backward apart.
"""
import concurrent.futures
import threading
import weakref

_DEFAULT_BOUND = 60.0  # s, where the client has no timeout of its own

_lock = threading.Lock()
# device -> {id(optimizer): (weak reference to it, its last step's reply)}.
# An optimizer's last reply is all to wait for: its replies come in order.
_latest = {}


def _others(device, owner):
    """The unanswered last replies of the other live optimizers on
    `device` (done() looked at outside the lock: it may poll a stream);
    forgets optimizers gone. Nothing to look at where `owner` is alone."""
    with _lock:
        entries = _latest.get(device, {})
        for key in [k for k, (ref, _) in entries.items() if ref() is None]:
            del entries[key]
        others = [future for ref, future in entries.values()
                  if ref() is not owner]
    return [future for future in others if not future.done()]


def wait_for_others(device, owner, timeout):
    """Waits (up to `timeout` s each, a finite bound where None) for the
    replies of the flagged steps other optimizers sent on `device`; their
    errors are theirs to raise. Any failure of the wait is left to those
    optimizers too: this step goes out either way."""
    bound = _DEFAULT_BOUND if timeout is None else timeout
    for future in _others(device, owner):
        try:
            future.exception(bound)
        except Exception:  # noqa: BLE001 (timeouts, a broken stream: theirs)
            pass


def sent(device, owner, future):
    """Records `future` as the reply of the last flagged step `owner` sent
    on `device`."""
    with _lock:
        _latest.setdefault(device, {})[id(owner)] = (weakref.ref(owner),
                                                      future)


def forget(owner):
    """Drops what `owner` (closed) sent."""
    with _lock:
        for entries in _latest.values():
            entry = entries.get(id(owner))
            if entry is not None and entry[0]() is owner:
                del entries[id(owner)]
