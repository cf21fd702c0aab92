"""optimd: the Python client of the optimd optimizer-step daemon.

    import optimd
    client = optimd.Client()            # the daemon's default socket
    from optimd.torch import AdamW      # a drop-in torch.optim.AdamW
"""
import pkgutil

# Generated stubs may live under another sys.path root (Bazel, pip builds).
__path__ = pkgutil.extend_path(__path__, __name__)

from optimd.errors import (AbortedError, AlreadyExistsError,  # noqa: E402
                           DaemonUnavailableError, DeadlineExceededError,
                           FailedPreconditionError, IncompatibleDaemonError,
                           InvalidArgumentError, MissingStateError,
                           NotFoundError, OptimdError,
                           OverlappingParameterError, ParameterChangedError,
                           PermissionDeniedError, ResourceExhaustedError,
                           SessionError)
from optimd.client import (API_REVISION, Client, __version__,  # noqa: E402
                           default_address)

__all__ = [
    "Client", "default_address", "OptimdError", "DaemonUnavailableError",
    "SessionError", "NotFoundError", "AlreadyExistsError",
    "InvalidArgumentError", "ResourceExhaustedError",
    "FailedPreconditionError", "IncompatibleDaemonError",
    "PermissionDeniedError", "DeadlineExceededError", "AbortedError",
    "MissingStateError", "ParameterChangedError", "OverlappingParameterError",
    "__version__",
    "API_REVISION",
]
