"""The node's Kineto on-demand daemon (the role dynolog plays): learns which PyTorch processes poll,
and hands one of them a trace configuration when a capture asks for it.

A PyTorch process started with ``KINETO_USE_DAEMON=1`` polls the daemon over a Unix datagram socket
(the wire format is in ``protocol``):

* The daemon's address is the abstract name ``@dynolog`` *with* a trailing NUL byte (sun_path
  ``"\\0dynolog\\0"``, address length family + 9). With ``KINETO_IPC_SOCKET_DIR=<dir>`` in the process's
  environment it is the file ``<dir>/dynolog`` instead (and the client's socket is a file in ``<dir>``).
* Each process binds ``@dynoconfigclient<uuid>`` (or ``<dir>/dynoconfigclient<uuid>``) and sends a
  request right at ``import torch``, then every 5 s (``ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS`` in the
  process's ``KINETO_CONFIG`` file changes that). Without a daemon each poll retries for about 10 s
  and logs an error, so a process finds a daemon started later within about 15 s.
* The reply waits about 50 ms on the client's side (5 tries 10 ms apart, per Kineto's source); a
  later reply stays queued and is read at the next poll.
* With ``ACTIVITIES_LOG_FILE=<dir>/trace.json`` the process creates ``<dir>/trace_<pid>.json.tmp``
  (its own pid inserted before the first dot of the name) when it starts recording, fills it once the
  recording ends and what it recorded is converted, and renames it to ``<dir>/trace_<pid>.json``: the
  rename marks a complete trace. It never creates ``<dir>``. Measured on CPU: a 1 s trace of a light
  loop is complete about 4 s after the poll that took the config; a 2 s trace of a busy loop of small
  ops takes 8 to 30 s more (``trace_wait`` says how long the backend waits). The default 5 s warm-up
  would add 5 s, so the agent asks for ``ACTIVITIES_WARMUP_PERIOD_SECS=0``.

The daemon identifies a process by the kernel's credentials of the sender (``SO_PASSCRED``), so the
pid it knows is the one the agent sees (the host pid when the agent runs in the host PID namespace),
whatever the process reports. Replies go only to client sockets named ``dynoconfigclient*`` (in the
socket directory, for file sockets).

Where the trace goes: the agent's own ``trace_dir`` (one fresh, randomly named directory per capture,
never a path taken from a client). The traced process writes it on *its* filesystem, so the agent and
the process must see ``trace_dir`` at the same path: same mount namespace (not a private /tmp), or the
same host directory mounted at the same path in the container. The abstract socket exists per network
namespace: a container without host networking does not reach ``@dynolog`` (mount a shared directory
and set ``KINETO_IPC_SOCKET_DIR`` instead, or use ``gpuscope.workload.serve`` over TCP).

The directories' modes, and why, are in ``directories``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuscope.capture.kineto.directories import (
    default_trace_dir,
    make_capture_dir,
    prepare_socket_dir,
    prepare_trace_dir,
    remove_leftovers,
    remove_quietly,
)
from gpuscope.capture.kineto.errors import KinetoBusyError, KinetoDaemonError, KinetoUnreachableError
from gpuscope.capture.kineto.protocol import (
    CLIENT_PREFIX,
    DEFAULT_POLL_PERIOD_S,
    DEFAULT_SOCKET_NAME,
    MAX_DATAGRAM,
    TRACE_NAME,
    TYPE_CONTEXT,
    TYPE_REQUEST,
    UCRED,
    ConfigRequest,
    ContextMessage,
    Credentials,
    MalformedDatagram,
    daemon_address,
    encode_context_reply,
    encode_message,
    parse_context,
    parse_request,
    sender_credentials,
    split_message,
    trace_config,
)
from gpuscope.common.unixfs import (
    SocketInUseError,
    UnsafePathError,
    clear_stale_socket,
    file_identity,
    same_file,
)
from gpuscope.health import SourceHealth
from gpuscope.listeners import SocketListeners

log = logging.getLogger(__name__)

# Datagrams handled at one call of the listeners' handler: a flood of polls cannot hold up the
# agent's other listening sockets (the HTTP port) for long; the rest are read at the next call.
MAX_DATAGRAMS_AT_ONCE = 64


@dataclass(frozen=True, slots=True)
class Registration:
    """A process that polls the daemon. ``pid`` is the sender's pid as the agent sees it (kernel
    credentials); ``reported_pid`` and ``ancestors`` are what the process reported (its own PID
    namespace). Times are on the daemon's clock."""

    pid: int
    ancestors: tuple[int, ...]
    last_seen: float
    first_seen: float
    reported_pid: int
    uid: int | None = None
    gid: int | None = None
    job_id: int = 0
    profiling: bool = False  # its last poll said its activity profiler is busy
    gpus: tuple[int, ...] = ()
    polls: int = 0


@dataclass(slots=True)
class _Client:
    registration: Registration
    address: str | bytes


@dataclass(eq=False, slots=True)
class PendingTrace:
    """A trace configuration queued for one process, until it is delivered and the trace written."""

    pid: int
    directory: Path
    config: bytes
    created: float
    delivered: float | None = None
    # Set (under the daemon's lock) just before the config is sent: the process may take it and exit
    # before ``delivered`` is set, and a capture that sees it gone must not say it never took it.
    sending: bool = False
    busy: str | None = None  # why the process cannot take it (it is profiling already)
    finished: bool = False
    event: threading.Event = field(default_factory=threading.Event)  # set on delivery or busy


class KinetoDaemon:
    """The node's Kineto on-demand daemon: learns which PyTorch processes poll, hands them trace
    configs. Thread-safe; ``start`` binds the socket and starts one receiving thread.

    ``socket_dir=None`` listens on the abstract ``@<socket_name>``; a directory listens on the file
    ``<socket_dir>/<socket_name>`` for processes started with ``KINETO_IPC_SOCKET_DIR=<socket_dir>``.
    PyTorch always addresses ``dynolog``: other names are for tests. ``trace_dir`` must be visible at
    the same path to the traced processes (see the module's docstring); by default a directory of
    the agent's own under the temporary directory. Both directories are absolute paths, made at
    ``start`` when missing. A registration expires ``expire_after_s`` after the process's last poll
    (3 poll periods)."""

    def __init__(self, *, socket_name: str = DEFAULT_SOCKET_NAME, socket_dir: str | Path | None = None,
                 trace_dir: str | Path | None = None, clock: Callable[[], float] = time.monotonic,
                 expire_after_s: float = 3 * DEFAULT_POLL_PERIOD_S, max_clients: int = 4096,
                 health: SourceHealth | None = None, listeners: SocketListeners | None = None) -> None:
        self.health = health
        self._own_listeners = listeners is None  # else shared with the agent's other sockets
        self._listeners = listeners if listeners is not None else SocketListeners(
            "gpuscope-kineto", health=health, source="captures")
        if not socket_name or "/" in socket_name or "\x00" in socket_name or len(socket_name) > 100:
            raise ValueError(f"invalid Kineto daemon socket name {socket_name!r}")
        self.socket_name = socket_name
        self.socket_dir = Path(socket_dir) if socket_dir is not None else None
        self.trace_dir = Path(trace_dir) if trace_dir is not None else default_trace_dir()
        for name, path in (("socket_dir", self.socket_dir), ("trace_dir", self.trace_dir)):
            if path is not None and not path.is_absolute():
                raise ValueError(f"the Kineto daemon's {name} must be an absolute path, got {str(path)!r}")
        self.clock = clock
        self.expire_after_s = expire_after_s
        self.max_clients = max_clients
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._pending: dict[int, PendingTrace] = {}
        self._last_finished: dict[int, float] = {}  # pid → when its last delivered trace ended
        self._sock: socket.socket | None = None
        self._bound_inode: tuple[int, int] | None = None
        self._socket_dir_id: tuple[int, int] | None = None
        self._stats: dict[str, int] = dict.fromkeys(
            ("datagrams", "requests", "contexts", "malformed", "replies", "send_errors",
             "configs_delivered", "clients_dropped", "errors"), 0)

    # -- life cycle -----------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """Where the daemon listens: ``@dynolog`` (abstract) or the socket file's path."""
        return daemon_address(self.socket_dir, self.socket_name)

    @property
    def running(self) -> bool:
        return self._sock is not None and self._listeners.alive

    def start(self) -> None:
        """Binds the socket and starts serving. KinetoDaemonError when the address is already taken
        (another daemon, e.g. dynolog, serves this host) or a directory is unusable: the agent then
        runs without PyTorch on-demand captures."""
        if self._sock is not None:
            raise KinetoDaemonError("the Kineto daemon is already started")
        prepare_trace_dir(self.trace_dir)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self._bind(sock)
            sock.setblocking(False)  # read when the listeners' thread finds it ready
        except BaseException:
            sock.close()
            raise
        remove_leftovers(self.trace_dir)  # only now: a second daemon refused above must not touch them
        self._sock = sock
        self._listeners.add(sock, self._receive)
        log.info("Kineto on-demand daemon listening on %s (traces under %s)", self.address, self.trace_dir)

    def stop(self, timeout: float = 1.0) -> None:
        """Stops serving, closes (and for a file socket removes) the socket; idempotent. Waits for
        the datagrams being handled; ``timeout`` bounds the wait for a thread of its own to end."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._listeners.remove(sock)
        if self._own_listeners:
            self._listeners.close(timeout)
        if sock is not None:
            sock.close()
        if self.socket_dir is not None:
            path = self.socket_dir / self.socket_name
            if same_file(path, self._bound_inode):  # ours still, not a successor's
                with contextlib.suppress(OSError):
                    path.unlink()
            self._bound_inode = None
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for trace in pending:
            trace.finished = True
            trace.event.set()  # a capture waiting for its delivery ends now
            remove_quietly(trace.directory)
        self._socket_dir_id = None

    def __enter__(self) -> KinetoDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _bind(self, sock: socket.socket) -> None:
        if self.socket_dir is None:
            try:
                # Kineto addresses "\0dynolog\0": the trailing NUL is part of the abstract name.
                sock.bind(f"\0{self.socket_name}\0")
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise KinetoDaemonError(
                        f"the abstract socket @{self.socket_name} is already bound in this network "
                        "namespace: another Kineto daemon (dynolog?) serves this host; PyTorch "
                        "on-demand captures through gpuscope are disabled") from None
                raise KinetoDaemonError(f"cannot bind @{self.socket_name}: {err}") from err
            return
        directory = self.socket_dir
        directory_st = prepare_socket_dir(directory)
        path = directory / self.socket_name
        try:
            clear_stale_socket(path, socket.SOCK_DGRAM)  # left by a daemon that is gone: removed
            sock.bind(str(path))
            os.chmod(path, 0o666)  # processes of any user may poll
            self._bound_inode = file_identity(path)
            self._socket_dir_id = (directory_st.st_dev, directory_st.st_ino)
        except SocketInUseError:
            raise KinetoDaemonError(f"{path} is served by another Kineto daemon (dynolog?); PyTorch "
                                    "on-demand captures through gpuscope are disabled") from None
        except UnsafePathError as err:
            raise KinetoDaemonError(str(err.strerror), setting="socket_dir") from err
        except OSError as err:
            raise KinetoDaemonError(f"cannot bind the Kineto daemon socket in {directory}: {err}",
                                    setting="socket_dir") from err

    # -- state ----------------------------------------------------------------------------------------

    def registered(self) -> dict[int, Registration]:
        """The processes that polled recently (pid → registration); expired ones are dropped."""
        with self._lock:
            self._expire(self.clock())
            return {pid: client.registration for pid, client in self._clients.items()}

    def stats(self) -> dict[str, int]:
        """Counters since start: datagrams, requests, contexts, malformed, replies, send_errors, ..."""
        with self._lock:
            return dict(self._stats)

    def request_trace(self, pid: int, duration_ms: int, *, warmup_s: int = 0) -> PendingTrace:
        """Queues a trace of ``duration_ms`` for ``pid``, handed over at its next poll.
        KinetoUnreachableError when it is not registered (or the daemon is not running),
        KinetoBusyError when a trace of it is already in flight or it is profiling itself."""
        if not self.running:
            raise KinetoUnreachableError(
                f"the Kineto daemon is not running (it would listen on {self.address})")
        with self._lock:
            self._expire(self.clock())
            client = self._clients.get(pid)
            if client is None:
                raise KinetoUnreachableError(
                    f"pid {pid} is not registered with the Kineto daemon (not started with "
                    f"KINETO_USE_DAEMON=1, or it has not polled {self.address} lately)")
            if pid in self._pending:
                raise KinetoBusyError(f"a capture of pid {pid} is already in flight")
            registration = client.registration
            # Its last poll said its profiler is busy: it is, unless that poll was before the end of
            # our own last trace of it (then the next poll decides).
            if registration.profiling and registration.last_seen > self._last_finished.get(pid, -1e300):
                raise KinetoBusyError(
                    f"pid {pid} is already profiling (its Kineto activity profiler is busy)")
            directory = make_capture_dir(self.trace_dir, pid, registration.uid, registration.gid)
            config = trace_config(directory / TRACE_NAME, duration_ms, warmup_s)
            trace = PendingTrace(pid=pid, directory=directory, config=config, created=self.clock())
            self._pending[pid] = trace
            return trace

    def finish(self, trace: PendingTrace) -> None:
        """Ends a trace request: undelivered, it is withdrawn; its directory is removed (a process
        still writing into it then fails to open its file, harmlessly)."""
        with self._lock:
            trace.finished = True
            if self._pending.get(trace.pid) is trace:
                del self._pending[trace.pid]
            if trace.delivered is not None:
                self._last_finished[trace.pid] = self.clock()
        remove_quietly(trace.directory)

    def _expire(self, now: float) -> None:
        stale = [pid for pid, client in self._clients.items()
                 if now - client.registration.last_seen > self.expire_after_s]
        for pid in stale:
            del self._clients[pid]
            self._last_finished.pop(pid, None)

    # -- on the listeners' thread -------------------------------------------------------------------------

    def _receive(self) -> None:
        """Handle the datagrams that came (the listeners' handler: the socket is ready), at most
        MAX_DATAGRAMS_AT_ONCE of them: the rest come at the next call, after the other sockets'."""
        sock = self._sock
        if sock is None:
            return
        ancillary = socket.CMSG_SPACE(UCRED.size)
        for _ in range(MAX_DATAGRAMS_AT_ONCE):
            try:
                data, ancdata, flags, address = sock.recvmsg(MAX_DATAGRAM + 1, ancillary)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                self._count("errors")
                log.debug("Kineto daemon: receive failed: %s", err)
                return
            self._count("datagrams")
            try:
                self._handle(sock, data, ancdata, flags, address)
            except Exception:  # a bad datagram must never stop the daemon
                self._count("errors")
                log.exception("Kineto daemon: error handling a datagram")

    def _handle(self, sock: socket.socket, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int,
                address: str | bytes) -> None:
        try:
            kind, body = split_message(data, flags)
            if not self._reply_allowed(address):
                raise MalformedDatagram(f"sender address {address!r} is not a Kineto client socket")
            if kind == TYPE_REQUEST:
                self._on_request(sock, parse_request(body), sender_credentials(ancdata), address)
            elif kind == TYPE_CONTEXT:
                self._on_context(sock, parse_context(body), sender_credentials(ancdata), address)
            else:
                raise MalformedDatagram(f"unknown message type {kind[:32]!r}")
        except MalformedDatagram as err:
            self._count("malformed")
            log.debug("Kineto daemon: ignored a malformed datagram: %s", err)

    def _on_request(self, sock: socket.socket, request: ConfigRequest, cred: Credentials | None,
                    address: str | bytes) -> None:
        now = self.clock()
        reply = b""
        with self._lock:
            self._stats["requests"] += 1
            client = self._touch(cred, request.pids[0], now, address, job_id=request.job_id,
                                 ancestors=request.pids[1:], profiling=request.profiler_busy)
            trace = self._pending.get(client.registration.pid) if client is not None else None
            if trace is not None and trace.delivered is None and not trace.finished:
                if not request.profiler_busy:
                    reply = trace.config
                    trace.sending = True
                else:
                    trace.busy = (f"pid {trace.pid} is already profiling (its Kineto activity profiler "
                                  "is busy)")
                    trace.event.set()
        sent = self._send(sock, encode_message(TYPE_REQUEST, reply), address)
        if reply and trace is not None:
            with self._lock:
                if sent and not trace.finished:
                    trace.delivered = self.clock()
                    self._stats["configs_delivered"] += 1
                    trace.event.set()
                trace.sending = False
            log.info("Kineto daemon: trace config handed to pid %d", trace.pid)

    def _on_context(self, sock: socket.socket, context: ContextMessage, cred: Credentials | None,
                    address: str | bytes) -> None:
        now = self.clock()
        with self._lock:
            self._stats["contexts"] += 1
            client = self._touch(cred, context.pid, now, address, job_id=context.job_id, gpu=context.gpu)
            count = sum(1 for c in self._clients.values() if context.gpu in c.registration.gpus)
            if client is None:
                count += 1
        self._send(sock, encode_context_reply(count), address)

    def _touch(self, cred: Credentials | None, reported_pid: int, now: float, address: str | bytes,
               *, job_id: int, ancestors: tuple[int, ...] | None = None, profiling: bool | None = None,
               gpu: int | None = None) -> _Client | None:
        """Creates or refreshes the registration of the sender (lock held)."""
        pid = cred[0] if cred is not None and cred[0] > 0 else reported_pid
        client = self._clients.get(pid)
        if client is None:
            self._expire(now)
            if len(self._clients) >= self.max_clients:
                self._stats["clients_dropped"] += 1
                return None
            registration = Registration(
                pid=pid, ancestors=ancestors or (), last_seen=now, first_seen=now, reported_pid=reported_pid,
                uid=cred[1] if cred is not None else None, gid=cred[2] if cred is not None else None,
                job_id=job_id, profiling=bool(profiling), gpus=(gpu,) if gpu is not None else (), polls=0)
            client = _Client(registration, address)
            self._clients[pid] = client
            log.info("Kineto daemon: pid %d registered (reports pid %d, ancestors %s)", pid, reported_pid,
                     list(ancestors or ()))
        reg = client.registration
        gpus = reg.gpus if gpu is None or gpu in reg.gpus else (*reg.gpus, gpu)
        client.registration = Registration(
            pid=pid, ancestors=ancestors if ancestors is not None else reg.ancestors, last_seen=now,
            first_seen=reg.first_seen, reported_pid=reported_pid,
            uid=cred[1] if cred is not None else reg.uid, gid=cred[2] if cred is not None else reg.gid,
            job_id=job_id, profiling=reg.profiling if profiling is None else profiling, gpus=gpus,
            polls=reg.polls + (1 if profiling is not None else 0))
        client.address = address
        return client

    def _reply_allowed(self, address: str | bytes) -> bool:
        """Replies go to Kineto client sockets only: ``@dynoconfigclient*`` (abstract) or
        ``<socket_dir>/dynoconfigclient*`` (file), never elsewhere."""
        if self.socket_dir is None:
            if not isinstance(address, bytes):
                return False
            return address.startswith(b"\0" + CLIENT_PREFIX.encode()) and len(address) <= 108
        if not isinstance(address, str) or not address or self._socket_dir_id is None:
            return False
        path = Path(address)
        if not path.name.startswith(CLIENT_PREFIX):
            return False
        try:
            st = os.stat(path.parent)  # the socket directory, however the client spells it
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._socket_dir_id

    def _send(self, sock: socket.socket, message: bytes, address: str | bytes) -> bool:
        try:
            sock.sendto(message, socket.MSG_DONTWAIT, address)
        except OSError as err:
            self._count("send_errors")
            log.debug("Kineto daemon: reply to %r failed: %s", address, err)
            return False
        self._count("replies")
        return True

    def _count(self, name: str) -> None:
        with self._lock:
            self._stats[name] += 1
