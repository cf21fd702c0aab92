"""Autograd's count of in-place writes (a tensor's `_version`) for the
parameters the daemon updates. torch's optimizers update parameters in
place, which moves the count, so that a backward through a graph that saved
a parameter before the step fails ("modified by an inplace operation")
rather than computing with the new values. The daemon's writes are unseen
by autograd: the client moves the count itself, once per step."""

import torch

# torch 2: metadata only, a list at once where the installed torch takes
# one (older ones take a tensor at a time).
_increment = getattr(getattr(torch.autograd, "graph", None),
                     "increment_version", None)


class VersionBumper:
    """Moves the write counts of a fixed list of tensors."""

    def __init__(self, tensors):
        self._tensors = list(tensors)
        self._views = None  # torch 1: empty views (_bump_through_views)
        self._one_at_a_time = False

    def bump(self):
        if not self._tensors:
            return
        if _increment is None:
            self._bump_through_views()
        elif self._one_at_a_time:
            for t in self._tensors:
                _increment(t)
        else:
            try:
                _increment(self._tensors)
            except (TypeError, RuntimeError):  # torch 2.1-2.4: one tensor
                self._one_at_a_time = True
                self.bump()

    def _bump_through_views(self):
        """An in-place op on an empty view of each tensor: a view shares
        its base's count, and no element is touched."""
        if self._views is None:
            self._views = [t.detach().as_strided((0,), (1,))
                           for t in self._tensors]
        with torch.no_grad():
            torch._foreach_zero_(self._views)
