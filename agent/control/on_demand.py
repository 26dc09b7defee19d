"""The control API's Unix socket, served by gRPC from its first client on.

A gRPC server costs the agent some 20 MiB, seven threads and their wake-ups, whether anyone calls it
or not, and on most nodes nobody does for days. So the agent first listens on the socket itself, on
the thread that waits on its other listening sockets (``gpuscope.listeners``; no wake-ups): the
first client that connects starts the real server, whose socket replaces this one at the same path
in one rename, with the same mode (the same clients may connect; the mode is the API's permission).
From then on clients reach gRPC directly; the connections accepted here before the switch are
relayed to it, byte for byte, until they close. Starting gRPC takes the listening sockets' thread a
fraction of a second, once: HTTP connections that come meanwhile wait in the listen queue.

With ``control.tcp`` configured the server starts at once instead (remote clients expect it up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gpuscope.common.unixfs import same_file
from gpuscope.control.config import ControlConfig
from gpuscope.control.errors import ControlServerError
from gpuscope.control.socket_dir import place_socket, prepare_socket_dir
from gpuscope.listeners import SocketListeners
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

BACKLOG = 64
RELAY_CHUNK = 1 << 16


class StartableServer(Protocol):
    def start(self, *, replacing: tuple[int, int] | None = None) -> None: ...

    def stop(self, grace: float | None = 1.0) -> None: ...


class OnDemandControlServer:
    """Holds the control socket until a client comes, then hands it to the server ``build`` makes."""

    def __init__(self, config: ControlConfig, build: Callable[[], StartableServer], *,
                 listeners: SocketListeners | None = None) -> None:
        self._config = config
        self._build = build
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None
        self._server: StartableServer | None = None
        self._own_listeners = listeners is None  # else shared with the agent's other sockets
        self._listeners = listeners if listeners is not None else SocketListeners("gpuscope-control")
        self._lock = threading.Lock()
        self._stopping = False
        self.tcp_port: int | None = None  # no TCP listener: it is served by ControlServer directly

    @property
    def socket_path(self) -> Path:
        return self._config.socket

    @property
    def active(self) -> bool:
        """Whether the gRPC server runs (a client has come)."""
        return self._server is not None

    def start(self) -> None:
        path = self._config.socket
        prepare_socket_dir(path)
        self._listener, self._identity = _listen(path, self._config.socket_mode)
        self._listeners.add(self._listener, self._first_client)
        log.info("control API (gpuscope.v1.Agent) listening on unix:%s (gRPC starts with the first client)",
                 path)

    def stop(self, grace: float | None = 1.0) -> None:
        with self._lock:
            self._stopping = True
        listener = self._listener
        if listener is not None:
            self._listeners.remove(listener)  # returns once a first client's start is over
        if self._own_listeners:
            self._listeners.close(5.0)
        with self._lock:
            server = self._server
        if server is not None:
            server.stop(grace)
        elif self._identity is not None and same_file(self._config.socket, self._identity):
            with contextlib.suppress(OSError):
                os.unlink(self._config.socket)
        self._close_listener()

    # ------------------------------------------------------------ on the listeners' thread

    def _first_client(self) -> None:
        """A client is waiting on the socket: start gRPC at its path, relay what came before."""
        listener = self._listener
        if listener is None:
            return
        self._listeners.remove(listener)  # once: gRPC takes over the path, or the API stays off
        try:
            with self._lock:
                if self._stopping:
                    return
                server = self._build()
                server.start(replacing=self._identity)
                self._server = server
        except (ControlServerError, OSError) as err:
            log.warning("control API disabled: cannot start it for its first client: %s", err)
            return  # the listener stays: clients connect, and are closed at stop
        log.info("control API: gRPC started for its first client")
        # Connections queued here before the rename: relayed to the server now at the path.
        listener.setblocking(False)
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # none left (BlockingIOError), or the socket failed
                break
            client.setblocking(True)
            start_thread("gpuscope-control-relay", functools.partial(_relay, client, self._config.socket))
        self._close_listener()

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def _listen(path: Path, mode: int) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` with ``mode`` (placed as the gRPC server's is)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        identity = place_socket(path, mode, lambda where: listener.bind(str(where)))
        listener.listen(BACKLOG)
    except OSError as err:
        listener.close()
        raise ControlServerError(f"cannot set up the control socket {path}: {err.strerror or err}") from err
    except ControlServerError:
        listener.close()
        raise
    return listener, identity


def _relay(client: socket.socket, path: Path) -> None:
    """Copy bytes both ways between ``client`` and the server at ``path`` until both sides close."""
    with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as upstream:
        try:
            upstream.connect(str(path))
        except OSError as err:
            log.warning("control API: cannot relay an early client to %s: %s", path, err)
            return
        peers = {client.fileno(): (client, upstream), upstream.fileno(): (upstream, client)}
        poller = select.poll()
        for fd in peers:
            poller.register(fd, select.POLLIN)
        while peers:
            for fd, _ in poller.poll():
                source, sink = peers[fd]
                try:
                    data = source.recv(RELAY_CHUNK)
                    if data:
                        sink.sendall(data)
                        continue
                    sink.shutdown(socket.SHUT_WR)  # pass the end of the stream on
                except OSError:
                    pass
                poller.unregister(fd)
                del peers[fd]
