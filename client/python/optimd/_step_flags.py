"""Step flags: the trainer's CUDA stream and the daemon's ordered through
three words of the trainer's GPU memory, with no host waiting for the other
(StepRequest.step_flags in the API): ready, done, and a staged step's
progress (_overlap.py).

Per step n the trainer's stream writes ready = n after backward, the daemon
waits for ready >= n, steps, and writes done = n; the trainer's stream waits
for done >= n before the next forward. So opt.step() returns as soon as the
request is sent, and the trainer's host runs ahead into the next iteration
while the GPU keeps the order.

If the step stream breaks with steps unanswered (the daemon refused one and
ended the stream, or went away), the daemon will not write their done
flags: `release_after_break` waits for the done flag of the last step the
daemon answered (its update writes the parameters first) while the daemon
answers, and briefly for the failed step's (written if the daemon took it),
then sets done (and progress) past every step so that the trainer's stream
never hangs, and the flags are made anew (bound again with sequence 1) at
the next step.
"""
import logging
import time

import torch

from optimd import cuda_ipc
from optimd.v1 import optimd_pb2 as pb

_PAST_EVERY_STEP = 0x7FFFFFFF


class StepFlags:
    """With `stamps`, 32 bytes: the daemon also writes its global-timer
    stamps of each step's start and end into words [4:8] (two int64;
    bench/step_trace.py reads them)."""

    def __init__(self, device, stamps=False):
        self.device = device
        self._size = 32 if stamps else 12
        self._side = cuda_ipc.SideStream(device)
        self._new_words()

    def _new_words(self):
        # A small block of torch's caching allocator (where CUDA IPC can
        # export it): the daemon maps the segment holding it (cached per
        # allocation like any buffer).
        self.words = cuda_ipc.shareable_zeros(self._size, self.device).view(
            torch.int32)
        self.sequence = 0  # the last step sent
        self.first_index = None  # the client's stream index of step 1
        self._bound = False
        self._needs_rebind = False

    def next_step(self, stream_index):
        """(step_flags handle or None, sequence) for the next step; the
        handle travels with the first step after (re)binding."""
        if self._needs_rebind:
            self._new_words()
        self.sequence += 1
        if self._bound:
            return None, self.sequence
        self._bound = True
        self.first_index = stream_index
        handle, offset = cuda_ipc.mem_handle(self.words)
        return pb.BufferHandle(cuda_ipc=pb.CudaIpcBuffer(
            ipc_handle=handle, device=self.device.index or 0, offset=offset,
            size=self._size)), self.sequence

    def mark_ready(self, stream, staged=False):
        """A staged step first resets the progress word (the daemon's writes
        of the step before are done: its done flag was awaited)."""
        if staged:
            cuda_ipc.stream_write_value32(stream, self.words.data_ptr() + 8,
                                          0, self.device)
        cuda_ipc.stream_write_value32(stream, self.words.data_ptr(),
                                      self.sequence, self.device)

    def wait_done(self, stream):
        cuda_ipc.stream_wait_value32(stream, self.words.data_ptr() + 4,
                                     self.sequence, self.device)

    def wait_stage(self, stream, stage):
        """Until the step being run has written stage `stage`'s
        parameters."""
        cuda_ipc.stream_wait_value32(stream, self.words.data_ptr() + 8,
                                     stage + 1, self.device)

    def release_after_break(self, answered, failed, answers, patience_s=5.0,
                            bound_s=600.0):
        """Runs on the step stream's reader thread after it broke.

        `answered`: the last step the daemon answered (0: none). It queued
        that step and those before, whose updates write the parameters and
        then the done flag: the release waits for it as long as the daemon
        answers (`answers()`, asked every `patience_s`), up to `bound_s`, so
        that the trainer's stream never reads parameters the daemon is still
        writing. `failed`: the first step unanswered, whose done flag comes
        only if the daemon took it (it releases a step it refuses once it
        has read it): waited for up to `patience_s` more."""
        done = self.words.data_ptr() + 4
        # Only driver calls on a non-blocking stream: torch's own ops here
        # could queue behind the trainer's blocked stream.
        with cuda_ipc.context_of(self.device):  # this thread's context
            if answered > 0:
                self._await_answered(done, answered, answers, patience_s,
                                     bound_s)
            self._await(done, failed, time.monotonic() + patience_s)
            cuda_ipc.stream_write_value32(self._side, done + 4,
                                          _PAST_EVERY_STEP)
            cuda_ipc.stream_write_value32(self._side, done, _PAST_EVERY_STEP)
            self._side.synchronize()
        self._needs_rebind = True

    def _await(self, done, sequence, deadline):
        """Whether the done flag reached `sequence` before `deadline`."""
        while time.monotonic() < deadline:
            if self._side.read_u32(done) >= sequence:
                return True
            time.sleep(0.001)
        return False

    def _await_answered(self, done, sequence, answers, patience_s, bound_s):
        start = time.monotonic()
        while not self._await(done, sequence, time.monotonic() + patience_s):
            if not answers():
                return  # the daemon is gone, and its writes with it
            if time.monotonic() - start > bound_s:
                logging.getLogger("optimd").warning(
                    "step %d, answered by the daemon, has not written its "
                    "done flag in %.0f s: releasing the trainer's stream "
                    "without it (the step's update may still write the "
                    "parameters)", sequence, bound_s)
                return
