"""optimd.Client: the low-level Python client of the optimd daemon.

One Client holds one channel and, after create_session, one session whose
token travels in the `x-optimd-session` metadata of every call. Every call
has a deadline. Failures raise optimd.errors.OptimdError subclasses.
"""
import functools
import os
import pwd
import socket
import time
import weakref

import grpc

from optimd import errors
from optimd import _native_steps
from optimd._step_stream import StepStream
from optimd._stream_watchdog import StreamWatchdog
from optimd.v1 import optimd_pb2 as pb
from optimd.v1 import optimd_pb2_grpc as pb_grpc

SESSION_METADATA_KEY = "x-optimd-session"
ADMIN_METADATA_KEY = "x-optimd-admin"
# The client's version, and the API revision it needs of a daemon
# (common/version.h says what each revision added).
__version__ = "0.5.0"
API_REVISION = 12


def default_address():
    """The daemon's default address, as the daemon computes it."""
    env = os.environ.get("OPTIMD_ADDRESS")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return "unix:%s/optimd.sock" % runtime
    return "unix:/tmp/optimd-%d.sock" % os.getuid()


def unix_socket_path(address):
    """The socket file of a "unix:" gRPC address (unix:/path or
    unix:///path, as gRPC reads both), or None for any other address."""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:"):]
    return path[2:] if path.startswith("//") else path


def _check_address(address):
    """Refuses, at once and saying why, what cannot reach a daemon: a bare
    socket path (taken for a TCP address), a socket file that is missing,
    or one this user may not use."""
    if not address.startswith("unix:"):
        if address.startswith("/") or address.endswith(".sock"):
            raise errors.InvalidArgumentError(
                "%r looks like a socket path: write unix:%s (without the "
                "prefix it is a TCP address, which the daemon serves over "
                "TLS only)" % (address, address))
        return
    path = unix_socket_path(address)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise errors.DaemonUnavailableError(
            "no optimd daemon at %s: the socket file %s does not exist; "
            "start one with `optimd --listen=%s`" %
            (address, path, address)) from None
    except PermissionError:
        closed = _closed_directory(path)
        if closed is None:
            raise
        dir_st = os.stat(closed)
        raise errors.DaemonUnavailableError(
            "the daemon socket %s is out of this user's reach: the directory "
            "%s on its path belongs to %s and is closed to this user (mode "
            "%o); run as that user, or start a daemon of your own on another "
            "socket (optimd --listen=unix:/path)" %
            (path, closed, _owner(dir_st.st_uid),
             dir_st.st_mode & 0o777)) from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise errors.DaemonUnavailableError(
            "the daemon socket %s belongs to %s and only it may connect "
            "(mode %o); run as that user, or start a daemon of your own on "
            "another socket (optimd --listen=unix:/path)" %
            (path, _owner(st.st_uid), st.st_mode & 0o777))
    if _refused(path):
        raise errors.DaemonUnavailableError(
            "no optimd daemon at %s: the socket file %s is there but nothing "
            "listens on it (a daemon that ended without removing it); start "
            "one with `optimd --listen=%s`, which replaces the stale file" %
            (address, path, address))


def _owner(uid):
    """'user alice (uid 1000)', or 'user id 1000' for a uid without a
    name."""
    try:
        return "user %s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except KeyError:
        return "user id %d" % uid


def _closed_directory(path):
    """The first directory on `path` this process may not search, or
    None."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        directory = "/".join(parts[:i])
        if directory and not os.access(directory, os.X_OK):
            return directory
    return None


def _refused(path):
    """True only when the socket file is there and nothing listens on it
    (ECONNREFUSED)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()
    return False


def _read_pem(what, path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise errors.InvalidArgumentError(
            "cannot read the %s file %s: %s" % (what, path, e)) from None
    if b"-----BEGIN" not in data:
        raise errors.InvalidArgumentError(
            "the %s file %s is not PEM" % (what, path))
    return data


def _tls_credentials(address, ca, cert, key):
    ca = ca or os.environ.get("OPTIMD_TLS_CA")
    cert = cert or os.environ.get("OPTIMD_TLS_CERT")
    key = key or os.environ.get("OPTIMD_TLS_KEY")
    if not ca:
        raise errors.InvalidArgumentError(
            "a daemon on TCP (%s) speaks TLS only: give the CA certificate "
            "that signed its certificate (tls_ca= or $OPTIMD_TLS_CA)" %
            address)
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem("CA certificate", ca),
        private_key=_read_pem("key", key) if key else None,
        certificate_chain=_read_pem("certificate", cert) if cert else None)


def _daemon_answers(address, channel, timeout=2.0):
    """Whether the daemon at `address` answers a call now (GetMetrics,
    which needs no session): over a fresh channel for a Unix socket, free of
    a broken one's reconnection backoff; over `channel` for TCP (its TLS
    credentials), which reconnects."""
    own = grpc.insecure_channel(address) if address.startswith("unix:") \
        else channel
    try:
        pb_grpc.OptimizerStub(own).GetMetrics(pb.GetMetricsRequest(),
                                              timeout=timeout)
        return True
    except Exception:  # noqa: B902 (a closed channel raises ValueError)
        return False
    finally:
        if own is not channel:
            own.close()


class _Connection:
    """What a Client holds open: its gRPC channel and its step stream.
    Apart from the Client, so that a Client dropped without close() is
    collected and closes them (nothing here refers back to it)."""

    def __init__(self, channel):
        self.channel = channel
        self.stream = None
        # gRPC's connections do not survive fork(): a child closing them
        # (its collection of the Client) would shut the parent's down.
        self.pid = os.getpid()

    def close_stream(self, timeout=10.0):
        if self.stream is not None:
            self.stream.close(timeout=timeout)
            self.stream = None

    def close(self, timeout=10.0):
        """timeout: how long steps in flight may take to be answered; a
        collected Client's waits for none (its finalizer may run on any
        thread, the stream's own included). Nothing in a forked child: the
        connection is its parent's."""
        if os.getpid() != self.pid:
            return
        self.close_stream(timeout)
        self.channel.close()


class Client:
    """A connection to one optimd daemon. Not thread-safe. close() it (or
    use it as a context manager); one dropped without close() closes its
    step stream and channel when collected."""

    def __init__(self, address=None, timeout=60.0, connect_timeout=10.0,
                 tls_ca=None, tls_cert=None, tls_key=None, admin_token=None):
        """address: "unix:/path" (default: the daemon's default socket) or
        "host:port", which the daemon serves over TLS only: tls_ca is the
        PEM file of the CA that signed its certificate, tls_cert/tls_key
        this client's, when the daemon requires one (default: the files
        named by $OPTIMD_TLS_CA, $OPTIMD_TLS_CERT, $OPTIMD_TLS_KEY).
        admin_token: the daemon's admin token (its --admin_token_file),
        which admin calls (list_sessions, evict_session) over TCP need, and
        create_session over TCP to a daemon without --tls_client_ca."""
        self.address = address or default_address()
        self.timeout = timeout
        self._admin = ((ADMIN_METADATA_KEY, admin_token),) if admin_token \
            else ()
        _check_address(self.address)
        options = [("grpc.max_send_message_length", -1),
                   ("grpc.max_receive_message_length", -1)]
        if self.address.startswith("unix:"):
            self._channel = grpc.insecure_channel(self.address,
                                                  options=options)
        else:
            self._channel = grpc.secure_channel(
                self.address, _tls_credentials(self.address, tls_ca,
                                               tls_cert, tls_key),
                options=options)
        try:
            grpc.channel_ready_future(self._channel).result(
                timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise errors.DaemonUnavailableError(
                "no optimd daemon answers at %s (waited %.0f s); start one "
                "with `optimd --listen=%s`" %
                (self.address, connect_timeout, self.address)) from None
        self._stub = pb_grpc.OptimizerStub(self._channel)
        self._connection = _Connection(self._channel)
        # Not at interpreter exit: the daemon sees the process end then.
        self._closer = weakref.finalize(self, self._connection.close, 0.0)
        self._closer.atexit = False
        self.token = None
        self.backend = None
        # Steps go over one StepStream per session by default: it saves a
        # call setup per step (about half the round trip; bench/RESULTS.md).
        self.use_step_stream = True
        # Called on the reader thread when a step stream ends other than by
        # close() (steps unanswered or not: an answered CUDA step may not
        # have run): on_stream_broken(first_request_index, replies_ok,
        # error); request indices count every streamed step from 0.
        self.on_stream_broken = None
        # Called before each call that has the daemon read or write the
        # trainer's memory outside a step (_TOUCHES_TRAINER_MEMORY): the
        # optimd.torch optimizers wait there for the trainer's CUDA stream.
        self.before_trainer_memory = None
        # Called before each call other than a step: the optimd.torch
        # optimizers tell there the parameter writes a step would have
        # carried (_DaemonOptimizer._send_written_params).
        self.before_other_call = None
        self._streamed = 0

    @property
    def _stream(self):
        return self._connection.stream

    @_stream.setter
    def _stream(self, stream):
        self._connection.stream = stream

    def close(self):
        if self._closer.detach() is not None:
            self._connection.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def owned_here(self):
        """Whether this process made the connection (not a forked child of
        the process that did)."""
        return os.getpid() == self._connection.pid

    def _check_usable(self):
        """A closed client, or one a forked child inherited, raises at once
        (the child's calls would wait forever on its parent's connection,
        or close the parent's session)."""
        if not self.owned_here:
            raise errors.FailedPreconditionError(
                "this connection to the optimd daemon at %s was made by "
                "process %d; process %d, a fork of it, cannot use it (gRPC "
                "connections do not survive fork): make the optimizer in the "
                "child, or start workers with the 'spawn' method" % (
                    self.address, self._connection.pid, os.getpid()))
        if not self._closer.alive:
            raise errors.FailedPreconditionError(
                "this connection to the optimd daemon at %s was closed "
                "(close() of the Client, or of the optimizer holding it): "
                "make a new optimizer and load_state_dict() into it to go on"
                % self.address)

    def _before(self, method, trainer_memory=True):
        """Steps still in flight come first: the daemon orders a session's
        calls by arrival, and a reply must not overtake them; then, for a
        call on the trainer's memory (`trainer_memory` False: one that
        neither reads nor writes it), before_trainer_memory."""
        self._check_usable()
        if self._stream is not None:
            self._stream.drain()
        if self.before_other_call and method != "Step":
            self.before_other_call()
        if trainer_memory and method in _TOUCHES_TRAINER_MEMORY and \
                self.before_trainer_memory:
            self.before_trainer_memory()

    def _call(self, method, request, admin=False, trainer_memory=True,
              timeout=None):
        """One call (timeout: the client's unless given)."""
        timeout = self.timeout if timeout is None else timeout
        self._before(method, trainer_memory)
        metadata = ((SESSION_METADATA_KEY, self.token),) if self.token else ()
        if admin:
            metadata += self._admin
        try:
            try:
                return getattr(self._stub, method)(
                    request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as err:
                if not _never_sent(err):
                    raise
                first = err
            if _refuses_connections(self.address):
                raise first  # no daemon listens there: gone, no wait
            # The connection broke under an earlier call (gRPC resets one
            # its quota refused) and this one never left: once more, waiting
            # a little for the connection, which a live daemon gives back.
            try:
                return getattr(self._stub, method)(
                    request, timeout=_RECONNECT_S if timeout is None
                    else min(timeout, _RECONNECT_S),
                    metadata=metadata, wait_for_ready=True)
            except grpc.RpcError as again:
                gone = (grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED)
                raise first if again.code() in gone else again
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._refuse_if_older(method)
            raise errors.from_rpc_error(
                err, self.address, had_session=bool(self.token),
                answers=self.daemon_answers) from None

    def _incompatible(self, reply, what=""):
        """IncompatibleDaemonError naming the daemon's version (of a
        CreateSession or GetMetrics `reply`) and this client's."""
        return errors.IncompatibleDaemonError(
            "the daemon at %s is optimd %s (API revision %d)%s; this client, "
            "optimd %s, needs API revision %d or later: upgrade the daemon" %
            (self.address, reply.daemon_version or "older than 0.2.0",
             reply.api_revision, what, __version__, API_REVISION))

    def _refuse_if_older(self, method):
        """After an UNIMPLEMENTED `method`: a daemon too old to know it
        raises IncompatibleDaemonError naming both versions (a call without
        a session was never checked against the revision)."""
        try:
            reply = self._stub.GetMetrics(pb.GetMetricsRequest(),
                                          timeout=self.timeout)
        except grpc.RpcError:
            return
        if reply.api_revision < API_REVISION:
            raise self._incompatible(
                reply, " and does not implement %s" % method) from None

    def daemon_answers(self, timeout=2.0):
        """Whether the daemon answers a call now (GetMetrics, which needs no
        session), over a connection of its own: after a failed call, tells a
        broken connection from a daemon that went away."""
        return _daemon_answers(self.address, self._channel, timeout)

    # Sessions.
    def create_session(self, job_id, rank=0, world_size=1, device=-1,
                       resume=False, ready_event=b"", resume_secret="",
                       gradient_sharding=0, nccl_unique_id=b"",
                       shard_state=False):
        """Opens (or resumes) a session; the daemon watches this process and
        orphans the session if the process ends without closing it.
        `gradient_sharding` (pb.GRADIENT_SHARDING_*): the job's ranks agree
        on each step's gradient norm and skip; on CUDA, ranks other than 0
        pass the `nccl_unique_id` of rank 0's reply. `shard_state`: ZeRO,
        each rank's session keeps state for its part of the parameters
        (CreateSessionRequest.shard_state)."""
        reply = self._call("CreateSession", pb.CreateSessionRequest(
            job_id=job_id, rank=rank, world_size=world_size, device=device,
            resume=resume, ready_event=ready_event, trainer_pid=os.getpid(),
            resume_secret=resume_secret,
            gradient_sharding=gradient_sharding,
            nccl_unique_id=nccl_unique_id, shard_state=shard_state),
            admin=True)  # over TCP without client certificates it needs one
        if reply.api_revision < API_REVISION:
            # Too old to speak what this client sends: leave no session.
            self.token = reply.session_token
            try:
                self.close_session()
            except errors.OptimdError:
                pass
            raise self._incompatible(reply)
        self.token = reply.session_token
        self.backend = reply.backend
        return reply

    def _close_stream(self):
        self._connection.close_stream()

    def close_session(self):
        self._close_stream()
        reply = self._call("CloseSession", pb.CloseSessionRequest())
        self.token = None
        return reply

    # Groups.
    def register_group(self, request):
        return self._call("RegisterGroup", request)

    def unregister_group(self, group_id):
        return self._call("UnregisterGroup",
                          pb.UnregisterGroupRequest(group_id=group_id))

    def update_buffers(self, request, trainer_memory=True):
        """trainer_memory False: the update only marks gradients absent,
        so it need not wait for the trainer's stream."""
        return self._call("UpdateBuffers", request,
                          trainer_memory=trainer_memory)

    # Steps and state.
    def step(self, step=0, lr_overrides=None, grad_scale=0.0,
             max_grad_norm=0.0, wait=False, assume_finite=False,
             buffer_updates=(), step_flags=None, sequence=0,
             memory_released=False):
        """One step; returns its reply. buffer_updates: UpdateBuffersRequest
        messages applied first (gradients that moved or went away since the
        last step); step_flags, sequence, memory_released: see
        StepRequest."""
        request = self._step_request(
            step, lr_overrides, grad_scale, max_grad_norm, wait,
            assume_finite, buffer_updates, step_flags, sequence,
            memory_released=memory_released)
        if not self.use_step_stream:
            return self._call("Step", request)
        return self._result(self._send_step(request))

    def step_async(self, **kw):
        """As step(), but returns the future of the reply at once (over the
        step stream): done(), result() and exception() as a
        concurrent.futures.Future's. Replies come in order."""
        return self._send_step(self._step_request(**kw))

    @staticmethod
    def _step_request(step=0, lr_overrides=None, grad_scale=0.0,
                      max_grad_norm=0.0, wait=False, assume_finite=False,
                      buffer_updates=(), step_flags=None, sequence=0,
                      staged=False, memory_released=False):
        request = pb.StepRequest(step=step, grad_scale=grad_scale,
                                 max_grad_norm=max_grad_norm, wait=wait,
                                 assume_finite=assume_finite,
                                 buffer_updates=buffer_updates,
                                 sequence=sequence, staged=staged,
                                 memory_released=memory_released)
        if step_flags is not None:
            request.step_flags.CopyFrom(step_flags)
        for group_id, value in (lr_overrides or {}).items():
            if isinstance(value, dict):
                request.overrides.add(group_id=group_id, **value)
            else:
                request.overrides.add(group_id=group_id, lr=value)
        return request

    def _send_step(self, request):
        self._check_usable()
        if self._stream is not None and self._stream.broken:
            self._stream.close()
            self._stream = None
        if self._stream is None:
            first = self._streamed
            callback = self.on_stream_broken

            def broken(replies_ok, error):
                if callback is not None:
                    callback(first, replies_ok, error)
            self._stream = self._open_step_stream(broken)
        self._streamed += 1
        return self._stream.send(request)

    def _open_step_stream(self, broken):
        """The step stream: liboptimd_step_channel's where it is loaded and
        the daemon is on a Unix socket (no Python thread per step),
        grpcio's otherwise."""
        # The stream's threads may outlive a dropped Client: they hold
        # nothing of it.
        answers = functools.partial(_daemon_answers, self.address,
                                    self._channel)
        lib = _native_steps.load()
        if lib is not None and self.address.startswith("unix:"):
            return _native_steps.NativeStepStream(
                lib, self.address, self.token, self.address, broken,
                answers=answers)
        return StepStream(
            self._stub, ((SESSION_METADATA_KEY, self.token),),
            self.address, broken, answers=answers)

    @property
    def native_steps(self):
        """Whether steps go through liboptimd_step_channel.so."""
        return isinstance(self._stream, _native_steps.NativeStepStream)

    @staticmethod
    def _result(future):
        return future.result()

    @property
    def steps_streamed(self):
        """Steps sent over step streams so far (the next one's index)."""
        return self._streamed

    def get_params(self, group_ids=()):
        return self._call("GetParams",
                          pb.GetParamsRequest(group_ids=list(group_ids)))

    def _read(self, method, request, admin=False):
        """_call for a call that changes nothing. Refused because the
        daemon's replies not yet read hold its memory bound (other callers'
        large reads at the same moment), it is sent again after a pause,
        for up to the client's timeout in all."""
        deadline = None if self.timeout is None else \
            time.monotonic() + self.timeout
        pause = 0.05
        while True:
            left = None if deadline is None else \
                max(deadline - time.monotonic(), 0.001)
            try:
                return self._call(method, request, admin=admin, timeout=left)
            except errors.ResourceExhaustedError as err:
                if "replies not yet read" not in str(err) or (
                        deadline is not None and
                        time.monotonic() + pause > deadline):
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def get_state(self, group_ids=(), metadata_only=False, tensor_names=()):
        return self._read("GetState", pb.GetStateRequest(
            group_ids=list(group_ids), metadata_only=metadata_only,
            tensor_names=list(tensor_names)))

    def set_state(self, request):
        return self._call("SetState", request)

    def save_state(self, directory, background=False):
        return self._call("SaveState", pb.SaveStateRequest(
            directory=os.path.abspath(directory), background=background))

    def save_state_stream(self, chunk_bytes=0):
        """Yields the checkpoint file's bytes in chunks (SaveStateStream)."""
        self._before("SaveStateStream")
        metadata = ((SESSION_METADATA_KEY, self.token),)
        call = self._stub.SaveStateStream(
            pb.SaveStateStreamRequest(chunk_bytes=chunk_bytes),
            metadata=metadata)
        # Each wait for a chunk is bounded by the client's timeout; the
        # whole stream is not (a large state read slowly takes long).
        watchdog = StreamWatchdog(call, self.timeout)
        chunks = iter(call)
        try:
            while True:
                try:
                    chunk = watchdog.next_of(chunks)
                except StopIteration:
                    return
                yield chunk
        except grpc.RpcError as err:
            if watchdog.fired:
                raise errors.DeadlineExceededError(
                    "the daemon at %s sent no chunk of the state for %g s "
                    "(the client's timeout); it may be stopped or wedged: "
                    "check it (optimd's log, its health endpoint), or give "
                    "a larger timeout=" % (self.address, self.timeout)) \
                    from None
            raise errors.from_rpc_error(err, self.address) from None
        finally:
            watchdog.stop()
            # Left early (an exception, KeyboardInterrupt included, or the
            # reader stopped): the call is cancelled, so that the daemon
            # lets its snapshot of the state go now (it holds at most two
            # per session).
            call.cancel()

    def load_state_stream(self, chunks):
        """Sends StateChunk messages (in order) to LoadStateStream."""
        self._before("LoadStateStream")
        try:
            return self._stub.LoadStateStream(
                iter(chunks), timeout=self.timeout,
                metadata=((SESSION_METADATA_KEY, self.token),))
        except grpc.RpcError as err:
            raise errors.from_rpc_error(err, self.address) from None

    def save_status(self):
        return self._call("GetSaveStatus", pb.GetSaveStatusRequest())

    def load_state(self, directory):
        return self._call("LoadState", pb.LoadStateRequest(
            directory=os.path.abspath(directory)))

    # Admin.
    def list_sessions(self):
        return self._read("ListSessions", pb.ListSessionsRequest(),
                          admin=True)

    def evict_session(self, job_id, rank=0):
        return self._call("EvictSession", pb.EvictSessionRequest(
            job_id=job_id, rank=rank), admin=True)

    def get_metrics(self):
        return self._read("GetMetrics", pb.GetMetricsRequest())


# How long a call that never left (its connection broken) waits for the
# connection before the daemon counts as gone.
_RECONNECT_S = 2.0

# The calls in which the daemon reads or writes the trainer's parameter
# memory outside a step: registration (masters made from the parameters),
# new buffers, loads and resumes (parameters written), state writes, saves
# (parameters that are their own masters read).
_TOUCHES_TRAINER_MEMORY = frozenset((
    "RegisterGroup", "UpdateBuffers", "GetParams", "SetState", "LoadState",
    "LoadStateStream", "SaveState", "SaveStateStream"))


def _refuses_connections(address):
    """Whether nothing listens at `address` now: its Unix socket file is
    gone or refuses a connection, or its TCP port refuses one at every
    address the host name gives (a daemon that stopped or died), as
    opposed to a connection gRPC dropped. A probe that cannot tell (a
    timeout, another scheme) says False."""
    path = unix_socket_path(address)
    if path is not None:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        connect = functools.partial(probe.connect, path)
    elif "://" in address or ":" not in address:
        return False
    else:
        host, _, port = address.rpartition(":")
        if not port.isdigit():
            return False
        probe = None
        connect = functools.partial(socket.create_connection,
                                    (host.strip("[]"), int(port)), 0.5)
    try:
        connected = connect()
        if probe is None:
            connected.close()
    except (FileNotFoundError, ConnectionRefusedError):
        return True
    except OSError:
        return False
    finally:
        if probe is not None:
            probe.close()
    return False


def _never_sent(err):
    """Whether RpcError `err` says the call never reached a daemon (no
    connection), so that sending it again cannot apply it twice."""
    return err.code() == grpc.StatusCode.UNAVAILABLE and \
        "failed to connect" in (err.details() or "")
