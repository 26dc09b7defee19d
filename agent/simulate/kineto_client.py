"""A simulated process's side of PyTorch's Kineto on-demand protocol: it polls the node's daemon (the
agent) as a PyTorch process started with ``KINETO_USE_DAEMON=1`` does, and hands over the trace
configs the daemon answers with.

Like libkineto, the client binds ``dynoconfigclient<uuid>`` next to the daemon's address (abstract for
``@dynolog``, a file in the socket directory otherwise) and sends a request with its pid and its
parent's, then every ``poll_period_s`` (PyTorch's default, 5 s; every second until a daemon first
answers, so that a daemon started after the process finds it soon). Unlike libkineto, the socket is
*connected* to the daemon's address, so the kernel delivers datagrams from the daemon's socket only:
nobody else can hand this process a config (which names a file to write).

The wire format is ``gpuscope.capture.kineto.protocol``'s, the daemon's own.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuscope.capture.kineto.protocol import (
    TYPE_REQUEST,
    MalformedDatagram,
    client_address,
    encode_request,
    parse_config,
    socket_address,
    split_message,
)

log = logging.getLogger(__name__)

POLL_PERIOD_S = 5.0  # PyTorch's ON_DEMAND_CONFIG_UPDATE_INTERVAL_SECS default
SEARCH_PERIOD_S = 1.0  # until a daemon answers for the first time
REPLY_WAIT_S = 0.2  # PyTorch waits about 50 ms; a later reply is read at the next poll
MAX_REPLY_BYTES = 64 * 1024
MAX_DURATION_S = 600.0  # the agent asks for 30 s at most; anything longer is refused here


class TraceConfigError(ValueError):
    """A trace config this process cannot follow; the message says why."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """What a trace config asks for: record for ``duration_s`` after ``warmup_s``, then write the trace
    to ``log_file`` with this process's pid inserted before the first dot of its name."""

    log_file: Path
    duration_s: float
    warmup_s: float

    @classmethod
    def from_config(cls, config: dict[str, str]) -> TraceRequest:
        try:
            log_file = Path(config["ACTIVITIES_LOG_FILE"])
            duration_s = int(config.get("ACTIVITIES_DURATION_MSECS", "500")) / 1000
            warmup_s = float(int(config.get("ACTIVITIES_WARMUP_PERIOD_SECS", "0")))
        except (KeyError, ValueError) as err:
            raise TraceConfigError(f"not a trace config this process can follow: {err}") from None
        if not log_file.is_absolute() or ".." in log_file.parts:
            raise TraceConfigError(f"ACTIVITIES_LOG_FILE must be a plain absolute path, got "
                                   f"{str(log_file)!r}")
        if not 0 < duration_s <= MAX_DURATION_S or not 0 <= warmup_s <= MAX_DURATION_S:
            raise TraceConfigError(f"duration {duration_s:g} s or warm-up {warmup_s:g} s out of range")
        return cls(log_file, duration_s, warmup_s)

    def trace_path(self, pid: int) -> Path:
        """``<dir>/trace_<pid>.json`` for ``<dir>/trace.json``, as Kineto names it."""
        stem, dot, rest = self.log_file.name.partition(".")
        return self.log_file.with_name(f"{stem}_{pid}{dot}{rest}")


class KinetoClient:
    """Polls the daemon at ``daemon`` (``@dynolog`` or a socket file's path) from a background thread
    and calls ``on_trace`` with each trace config it hands over. ``busy()`` says whether the process is
    recording: its polls then say so, and the daemon hands it nothing."""

    def __init__(self, daemon: str, *, on_trace: Callable[[TraceRequest], None], busy: Callable[[], bool],
                 poll_period_s: float = POLL_PERIOD_S, search_period_s: float = SEARCH_PERIOD_S) -> None:
        self.daemon = daemon
        self._target = socket_address(daemon)
        self._on_trace = on_trace
        self._busy = busy
        self._poll_period_s = poll_period_s
        self._search_period_s = search_period_s
        self._pids = (os.getpid(), os.getppid())
        self._address = client_address(daemon, str(uuid.uuid4()))
        self._sock: socket.socket | None = None  # bound once the daemon's socket directory exists
        self._connected = False
        self._found = False
        self.answered = False  # the daemon has answered a poll (it knows this process from then on)
        self._stop = threading.Event()
        # Binding makes the socket file; close() removes it. Both under this lock, so that no bind
        # can come after close() (whose join may give up on a thread slowed by a busy machine).
        self._bind_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kineto-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop polling and remove the client's socket file, if it made one."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * REPLY_WAIT_S)
        with self._bind_lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            if not self._address.startswith("\0"):
                with contextlib.suppress(OSError):
                    os.unlink(self._address)

    def poll(self) -> TraceRequest | None:
        """One poll: the trace config the daemon answers with (or one it sent after an earlier poll's
        wait had ended), else None. Never raises for a daemon that is missing or restarted."""
        sock = self._connect()
        if sock is None:
            return None
        request = self._take_queued(sock)
        try:
            sock.send(encode_request(self._pids, profiler_busy=self._busy()))
        except OSError as err:  # the daemon went away (or is restarting): find it again next time
            log.debug("Kineto daemon %s: %s", self.daemon, err)
            self._connected = False
            return request
        self._found = True  # a daemon is there: poll at its pace from now on
        if request is None:
            request = self._receive(sock, REPLY_WAIT_S)
        return request

    def wait_for_request(self, period_s: float, on_answered: Callable[[], None]) -> TraceRequest:
        """Poll in this thread every ``period_s`` until the daemon hands over a trace config, as a
        scripted job does; ``on_answered`` is called once, after the daemon's first answer (from then
        on the daemon knows this process)."""
        announced = False
        while True:
            request = self.poll()
            if self.answered and not announced:
                on_answered()
                announced = True
            if request is not None:
                return request
            time.sleep(period_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                request = self.poll()
            except Exception:  # a bug here must not end the process: it only stops being capturable
                log.exception("polling the Kineto daemon failed")
                request = None
            if request is not None:
                self._on_trace(request)
            self._stop.wait(self._poll_period_s if self._found else self._search_period_s)

    def _connect(self) -> socket.socket | None:
        """The client socket, bound and connected to the daemon; None while there is no daemon (its
        socket directory or socket is missing, or nobody serves it)."""
        with self._bind_lock:
            if self._stop.is_set():
                return None
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                try:
                    sock.bind(self._address)
                except OSError as err:
                    sock.close()
                    log.debug("cannot bind %r: %s", self._address, err)
                    return None
                self._sock = sock
            sock = self._sock
        if not self._connected:
            try:
                sock.connect(self._target)
            except OSError as err:  # also a socket that close() has just closed
                if err.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                    log.debug("cannot reach the Kineto daemon %s: %s", self.daemon, err)
                return None
            self._connected = True
        return sock

    def _take_queued(self, sock: socket.socket) -> TraceRequest | None:
        """A reply that came after an earlier poll had stopped waiting for it."""
        found = None
        while True:
            reply = self._receive(sock, 0.0)
            if reply is None:
                return found
            found = reply

    def _receive(self, sock: socket.socket, timeout: float) -> TraceRequest | None:
        sock.settimeout(timeout if timeout > 0 else None)
        try:
            if timeout > 0:
                data = sock.recv(MAX_REPLY_BYTES)
            else:
                data = sock.recv(MAX_REPLY_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, TimeoutError):
            return None
        except OSError as err:
            log.debug("Kineto daemon %s: %s", self.daemon, err)
            return None
        self.answered = True
        try:
            kind, body = split_message(data, 0)
            if kind != TYPE_REQUEST or not body:
                return None
            return TraceRequest.from_config(parse_config(body))
        except (MalformedDatagram, TraceConfigError) as err:
            log.warning("ignored a reply of the Kineto daemon %s: %s", self.daemon, err)
            return None

