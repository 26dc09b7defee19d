"""The control API's Unix socket: held by the agent, served by gRPC in a server process while clients come.

A gRPC server costs a Python process some 20 MiB that it never gives back, seven threads and their
wake-ups, and on most nodes nobody calls the control API for days. So the agent listens on the socket
itself, on the thread that waits on its other listening sockets (``gpuscope.listeners``; no
wake-ups). The first client that connects starts the API's server process
(``gpuscope.control.server_process``), whose socket replaces this one at the same path in one rename,
with the same mode (the same clients may connect; the mode is the API's permission); the connections
accepted here before the switch are relayed to it, byte for byte, until they close. The server process
asks the agent for each call's answer over a private socket, and once nobody has called for
``control.idle_timeout`` the agent takes the socket back, again in one rename, and the process exits:
the agent's memory stays where it was. Starting the process takes the listening sockets' thread about
a second: HTTP connections that come meanwhile wait in the listen queue.

A server process that fails to start leaves the socket with the agent: the clients waiting are closed,
and the next client tries again. One that ends unexpectedly is replaced the same way.

With ``control.tcp`` configured the agent serves the API in its own process from the start instead
(remote clients expect it up).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import threading
from pathlib import Path

from gpuscope.common.unixfs import same_file
from gpuscope.control.config import ControlConfig
from gpuscope.control.errors import ControlServerError
from gpuscope.control.launcher import ServerProcess
from gpuscope.control.methods import ControlMethods
from gpuscope.control.socket_dir import place_socket, prepare_socket_dir
from gpuscope.listeners import SocketListeners
from gpuscope.threads import start_thread

log = logging.getLogger(__name__)

BACKLOG = 64
RELAY_CHUNK = 1 << 16


class OnDemandControlServer:
    """Holds the control socket while no client calls; hands it to a server process while they do."""

    def __init__(self, config: ControlConfig, methods: ControlMethods, *,
                 listeners: SocketListeners | None = None) -> None:
        self._config = config
        self._methods = methods
        self._listener: socket.socket | None = None
        self._identity: tuple[int, int] | None = None  # the listener's socket, while the agent holds it
        self._server: ServerProcess | None = None
        self._own_listeners = listeners is None  # else shared with the agent's other sockets
        self._listeners = listeners if listeners is not None else SocketListeners("gpuscope-control")
        self._lock = threading.Lock()
        self._stopping = False
        self.tcp_port: int | None = None  # no TCP listener: it is served by ControlServer directly

    @property
    def socket_path(self) -> Path:
        return self._config.socket

    def start(self) -> None:
        path = self._config.socket
        prepare_socket_dir(path)
        self._listener, self._identity = _listen(path, self._config.socket_mode)
        self._listeners.add(self._listener, self._first_client)
        log.info("control API (gpuscope.v1.Agent) listening on unix:%s (its server process starts with the "
                 "first client)", path)

    def stop(self, grace: float | None = 1.0) -> None:
        with self._lock:
            self._stopping = True
            server, self._server = self._server, None
        listener = self._listener
        if listener is not None:
            self._listeners.remove(listener)  # returns once a server process's start is over
        if self._own_listeners:
            self._listeners.close(5.0)
        self._methods.stopping.set()  # calls waiting for a capture end now
        if server is not None:
            server.stop()
            self._unlink_if(server.identity)
        self._unlink_if(self._identity)
        self._close_listener()

    # ------------------------------------------------------------ on the listeners' thread

    def _first_client(self) -> None:
        """A client is waiting on the socket: start the server process, relay what came before."""
        listener = self._listener
        if listener is None:
            return
        self._listeners.remove(listener)  # until the server process is up, or has failed
        if self._is_stopping():
            return
        try:
            server = ServerProcess.start(self._config, self._methods, replacing=self._identity,
                                         idle_timeout_s=self._config.idle_timeout,
                                         on_idle=self._server_idle, on_closed=self._server_closed)
        except ControlServerError as err:
            log.warning("control API: cannot serve a client: %s; the next client tries again", err)
            _close_waiting(listener)
            self._listeners.add(listener, self._first_client)
            return
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._server, self._listener, self._identity = server, None, None
        if stopping:
            server.stop()
            return
        log.info("control API: its server process (pid %d) serves unix:%s", server.pid, self._config.socket)
        if server.closed.is_set():  # it ended before it was recorded as the one serving
            self._server_closed(server)
        # Connections queued here before the rename: relayed to the server now at the path.
        listener.setblocking(False)
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # none left (BlockingIOError), or the socket failed
                break
            client.setblocking(True)
            start_thread("gpuscope-control-relay", functools.partial(_relay, client, self._config.socket))
        listener.close()

    # ------------------------------------------------------------ on a server process's bridge thread

    def _server_idle(self, server: ServerProcess) -> None:
        """Nobody has called: take the socket back, then let the process go."""
        if not self._take_back(server, why="idle"):
            return
        server.release()
        log.info("control API: its server process (pid %d) exits after %gs without a call; the agent holds "
                 "unix:%s again", server.pid, self._config.idle_timeout, self._config.socket)

    def _server_closed(self, server: ServerProcess) -> None:
        """The process has exited: if it still served the socket, it ended unexpectedly."""
        if self._take_back(server, why="exited"):
            log.warning("control API: its server process (pid %d) ended with status %s; the agent holds "
                        "unix:%s again and starts another for the next client", server.pid,
                        server.returncode, self._config.socket)

    def _take_back(self, server: ServerProcess, *, why: str) -> bool:
        """Listen at the path again in place of ``server``'s socket; False when it is not the one
        serving (the agent is stopping, or took the socket back already) or the socket cannot be had."""
        with self._lock:
            if self._stopping or server is not self._server:
                return False
            path = self._config.socket
            try:
                if why == "exited" and not same_file(path, server.identity):  # removed meanwhile?
                    prepare_socket_dir(path)
                    listener, identity = _listen(path, self._config.socket_mode)
                else:
                    listener, identity = _listen(path, self._config.socket_mode, replacing=server.identity)
            except ControlServerError as err:
                log.warning("control API: cannot take its socket back from its server process (pid %d): %s",
                            server.pid, err)
                if why == "idle":
                    return False  # it goes on serving, and says so again after another idle time
                self._server = None
                return False
            self._server, self._listener, self._identity = None, listener, identity
        try:
            self._listeners.add(listener, self._first_client)  # outside the lock: the listeners' own first
        except RuntimeError:  # the agent is stopping: its listeners are closed
            return False
        return True

    # ------------------------------------------------------------ helpers

    def _is_stopping(self) -> bool:
        with self._lock:
            return self._stopping

    def _unlink_if(self, identity: tuple[int, int] | None) -> None:
        """Remove the socket at the path if it is ``identity`` (never another agent's)."""
        if identity is not None and same_file(self._config.socket, identity):
            with contextlib.suppress(OSError):
                os.unlink(self._config.socket)

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def _close_waiting(listener: socket.socket) -> None:
    """Close the connections queued on ``listener`` (nothing can serve them now)."""
    listener.setblocking(False)
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            break
        client.close()
    listener.setblocking(True)


def _listen(path: Path, mode: int, *,
            replacing: tuple[int, int] | None = None) -> tuple[socket.socket, tuple[int, int]]:
    """A listening socket at ``path`` with ``mode`` (placed as the gRPC server's is; ``replacing``: the
    identity of the socket it takes the place of)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        identity = place_socket(path, mode, lambda where: listener.bind(str(where)), replacing=replacing)
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
