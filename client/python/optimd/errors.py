"""Exceptions of the optimd client: one class per daemon status code.

Every RPC failure surfaces as an OptimdError subclass carrying the daemon's
message, never as a raw gRPC traceback. MissingStateError is the client's
own: optimd.torch raises it where torch's optimizer would fail on a missing
state entry.
"""
import grpc


class OptimdError(Exception):
    """A call to the optimd daemon failed."""

    code = None

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class DaemonUnavailableError(OptimdError):
    """No daemon answers at the address (not running, wrong socket)."""

    code = grpc.StatusCode.UNAVAILABLE


class SessionError(OptimdError):
    """The session token is missing, unknown, or was taken over."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotFoundError(OptimdError, KeyError):
    """An unknown group or tensor."""

    code = grpc.StatusCode.NOT_FOUND

    def __str__(self):
        return Exception.__str__(self)


class AlreadyExistsError(OptimdError):
    """A duplicate group id, tensor name, or session."""

    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgumentError(OptimdError, ValueError):
    """The daemon refused a request's contents (sizes, dtypes, layouts...)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(OptimdError):
    """The daemon's --max_state_bytes (or memory) would be exceeded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(OptimdError):
    """The request cannot be served in the current state."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDeniedError(OptimdError, PermissionError):
    """The caller may not do this, e.g. resume a session without the secret
    it was created with."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceededError(OptimdError, TimeoutError):
    """A step waited for the job's other ranks longer than the daemon's
    --rank_timeout_s (the message names the missing ranks); nothing
    changed. Or the call itself outlived the client's timeout."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(OptimdError):
    """The call was given up because of another party: a rank of the job
    closed its session while this step waited for it."""

    code = grpc.StatusCode.ABORTED


class IncompatibleDaemonError(OptimdError):
    """The daemon is older than this client: it does not speak the API
    revision the client needs (the message names both versions)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class MissingStateError(KeyError, ValueError):
    """An optimizer setting needs state the parameters do not have (amsgrad
    turned on after steps: no max_exp_avg_sq). A KeyError, as torch's step
    raises then, and a ValueError, as optimd.torch raised before."""

    def __str__(self):
        return Exception.__str__(self)  # the message, not its repr


class ParameterChangedError(TypeError, RuntimeError):
    """A parameter's shape or dtype changed under the optimizer in a way it
    cannot follow (`p.data = torch.cat(...)` after steps). A TypeError, as
    optimd.torch raised before, and a RuntimeError, as torch's own step
    raises there (its state of the old size meets the new one)."""


class OverlappingParameterError(ValueError, RuntimeError):
    """A parameter two of whose elements share memory (an expanded
    tensor): torch's in-place step raises RuntimeError on it; optimd.torch
    raises this (a RuntimeError and a ValueError) when it is registered."""


_BY_CODE = {
    c.code: c
    for c in (DaemonUnavailableError, SessionError, NotFoundError,
              AlreadyExistsError, InvalidArgumentError,
              ResourceExhaustedError, FailedPreconditionError,
              PermissionDeniedError, DeadlineExceededError, AbortedError)
}


def from_rpc_error(err, address=None, had_session=False, answers=None):
    """Turns a grpc.RpcError into the matching OptimdError. `had_session`:
    the call belonged to an open session, so an unavailable daemon went
    away under it (and with it the state it held) unless `answers()` (asked
    only then) finds it still answering: then only the connection broke."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, OptimdError)
    if cls is DaemonUnavailableError and had_session and answers is not None \
            and answers():
        message = ("the connection to the optimd daemon at %s broke during "
                   "the call (%s); the daemon still answers, so its sessions "
                   "and their state are kept. The call may or may not have "
                   "been applied (a step: the optimizer's state says); "
                   "calls made now go over a new connection" %
                   (address, details))
    elif cls is DaemonUnavailableError and had_session:
        message = ("the optimd daemon at %s went away during the session "
                   "(%s): the optimizer state it held is lost unless it was "
                   "checkpointed (save_checkpoint) or saved at a clean stop "
                   "(--save_dir); restart it and resume (resume=True, or "
                   "load_checkpoint)" % (address, details))
    elif cls is ResourceExhaustedError and "RST_STREAM" in (details or ""):
        # gRPC's own memory bound refused the request before the daemon
        # read it.
        message = ("RESOURCE_EXHAUSTED: the daemon refused the call before "
                   "reading it, for lack of request memory: its gRPC "
                   "buffers for the calls in flight together would pass its "
                   "--max_request_memory_bytes (%s). Nothing was changed; "
                   "send smaller requests (fewer tensors per call) or start "
                   "the daemon with a larger --max_request_memory_bytes" %
                   details)
    elif cls is DaemonUnavailableError and "shutting down" in (details or ""):
        message = ("the optimd daemon%s is shutting down (%s): nothing was "
                   "done; retry once it is started again (with --save_dir "
                   "it saved its sessions: resume=True)" %
                   (" at %s" % address if address else "", details))
    elif cls is DaemonUnavailableError:
        where = " at %s" % address if address else ""
        message = ("no optimd daemon answers%s (%s); start one with "
                   "`optimd --listen=%s`" %
                   (where, details, address or "unix:/path/to.sock"))
    else:
        name = code.name if code is not None else "UNKNOWN"
        message = "%s: %s" % (name, details)
    return cls(message, code)
