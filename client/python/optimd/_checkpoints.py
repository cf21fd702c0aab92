"""Checkpoints of the optimd.torch optimizers (a mixin of
_DaemonOptimizer): written and read by the daemon, to a directory or as a
stream of bytes; with shard_state, each rank's parameter parts shared after
a load.
"""
import torch

from optimd import _zero_state, errors
from optimd.v1 import optimd_pb2 as pb


class Checkpoints:
    """Checkpoints of a _DaemonOptimizer, whose attributes they use."""

    def save_checkpoint(self, directory, background=False):
        """The daemon writes this trainer's optimizer state and parameters to
        <directory>/rank-<rank>.safetensors (atomically; the job id is in
        its metadata, so a new process finds it by rank). With
        background=True it returns once a consistent copy is taken and writes
        it while training goes on; see save_status()."""
        self._write_back_state()  # writes to optimizer.state, as torch's
        self._follow_written_params()  # masters as the parameters now are
        return self._client.save_state(directory, background=background)

    def state_bytes(self, chunk_bytes=4 << 20):
        """Yields the bytes of a checkpoint of this trainer's state (exactly
        what save_checkpoint would write), for a checkpoint store of your
        own. The state is copied at a step boundary when iteration starts."""
        self._write_back_state()
        self._follow_written_params()  # masters as the parameters now are
        chunks = self._client.save_state_stream(chunk_bytes)
        try:
            for chunk in chunks:
                yield chunk.data
        finally:
            # Left early (a KeyboardInterrupt at this yield, whose traceback
            # a notebook keeps, holds this frame): the stream's call is
            # cancelled now, not when the traceback goes.
            chunks.close()

    def load_state_bytes(self, chunks):
        """Loads a checkpoint from an iterable of byte strings (as yielded by
        state_bytes, or read back from your store). The total size is taken
        from the checkpoint's own header."""
        import struct as _struct

        def messages():
            offset = total = 0
            pending = b""
            for data in chunks:
                if total == 0:
                    pending += data
                    if len(pending) < 8:
                        continue
                    (hl,) = _struct.unpack("<Q", pending[:8])
                    header = pending[8:8 + hl]
                    if len(header) < hl:
                        continue
                    import json as _json
                    h = _json.loads(header)
                    end = max([v["data_offsets"][1] for k, v in h.items()
                               if k != "__metadata__"] + [0])
                    total = 8 + hl + end
                    data, pending = pending, b""
                yield pb.StateChunk(offset=offset, total_bytes=total,
                                    data=data)
                offset += len(data)
            if total == 0:
                raise ValueError("the checkpoint bytes end inside its header")
        reply = self._client.load_state_stream(messages())
        self._after_load()
        return reply

    def save_status(self):
        """Progress of the last background save: state, bytes_written,
        total_bytes, error."""
        return self._client.save_status()

    def wait_for_save(self, poll_s=0.05):
        """Blocks until the last background save finished; raises
        optimd.OptimdError if it failed."""
        import time as _time
        while True:
            st = self._client.save_status()
            if st.state != pb.SAVE_STATE_RUNNING:
                if st.state == pb.SAVE_STATE_FAILED:
                    raise errors.OptimdError("background save failed: " +
                                             st.error)
                return st
            _time.sleep(poll_s)

    def load_checkpoint(self, directory):
        """The daemon loads state and parameters from a save_checkpoint
        directory, in place. The groups must be registered as when saved."""
        reply = self._client.load_state(directory)
        self._after_load()
        return reply

    def _after_load(self):
        """A load set the daemon's state: take its learning rates, forget
        fetched state."""
        self._share_parts()
        self._mirror_out()
        groups = self.client.get_state(metadata_only=True).groups
        for group, g in zip(self.param_groups, groups):
            group["lr"] = g.hyperparameters.lr
        self._sent_hyper = None  # the next step sends them all again
        self.state.invalidate(follow=False)

    def _share_parts(self):
        """shard_state: a load wrote only this rank's part of each
        parameter (its checkpoint holds that part); every rank's part is
        broadcast to the others through torch.distributed, so that the
        ranks' parameters agree before the next forward. The partition is
        the daemon's (CreateSessionRequest.shard_state)."""
        if not self._shard_state:
            return
        dist = self._distributed("a load (the parameters' parts)")
        if self._flags is not None:
            torch.cuda.synchronize(self._device)
        for g in self._groups:
            for r in range(self._world_size):
                ranges = _zero_state.part_ranges(g["tensors"], r,
                                                 self._world_size)
                for s, (b, e) in zip(g["tensors"], ranges):
                    if b < e:
                        dist.broadcast(s.pflat[b:e], src=r)
