"""The agent's HTTP listener: a threading ``wsgiref`` server (the standard library only) that serves
``app.AgentApp`` on the configured address, IPv4 and IPv6, and stops at once when asked."""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry

from gpuscope.alerts.model import AlertSource
from gpuscope.common.addresses import parse_host_port
from gpuscope.health import SourceHealth
from gpuscope.snapshot import SnapshotSource
from gpuscope.threads import start_thread
from gpuscope.web.app import AgentApp, WebhookHandler

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_SECONDS = 30.0  # a client that sends nothing for this long loses its thread


class ListenError(OSError):
    """The server could not listen on the configured address (in use, not permitted, unknown host)."""


class _QuietRequestHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing per request: a 15 s scrape interval would flood the journal."""


class _ThreadingWsgiServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client must not block stop()
    block_on_close = False
    timeout = 1.0  # bounds handle_request() when a ready connection is gone before accept()

    def __init__(self, family: socket.AddressFamily, sockaddr: tuple[Any, ...], dual_stack: bool) -> None:
        self.address_family = family
        self._dual_stack = dual_stack
        # serve_forever() notices shutdown() only at its next poll; a wake-up socket makes stop()
        # immediate without waking the thread periodically while idle. (Created first: a failed
        # bind below calls server_close(), which closes it.)
        self._wake_reader, self._wake_writer = socket.socketpair()
        super().__init__(sockaddr, _QuietRequestHandler)

    def serve_until_woken(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_reader, selectors.EVENT_READ)
            while True:
                ready = selector.select()
                if any(key.fileobj is self._wake_reader for key, _ in ready):
                    return
                self.handle_request()

    def wake(self) -> None:
        self._wake_writer.send(b"\0")

    def server_close(self) -> None:
        super().server_close()
        self._wake_reader.close()
        self._wake_writer.close()

    def server_bind(self) -> None:
        if self._dual_stack:
            # Accept IPv4 too (as ::ffff:a.b.c.d), whatever net.ipv6.bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind would resolve the bound address with getfqdn(), a DNS lookup that
        # can take seconds on a node with broken resolv.conf; the raw address is good enough.
        super(WSGIServer, self).server_bind()
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])
        self.setup_environ()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-response are routine; the base class prints a traceback to stderr.
        log.debug("error while serving %s", client_address, exc_info=True)


def _open_server(host: str, port: int, address: str) -> _ThreadingWsgiServer:
    try:
        if not host:
            if socket.has_ipv6:
                try:
                    return _ThreadingWsgiServer(socket.AF_INET6, ("::", port), dual_stack=True)
                except OSError as err:
                    # IPv6 disabled in the kernel (module absent, or disable_ipv6=1): IPv4 only.
                    if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                        raise
            return _ThreadingWsgiServer(socket.AF_INET, ("0.0.0.0", port), dual_stack=False)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        return _ThreadingWsgiServer(family, sockaddr, dual_stack=False)
    except OSError as err:
        hint = _LISTEN_HINTS.get(err.errno or 0, "")
        message = f"cannot listen on {address!r}: {err.strerror or err}{hint}"
        raise (ListenError(message) if err.errno is None else ListenError(err.errno, message)) from err


_LISTEN_HINTS = {
    errno.EADDRINUSE: " (another process, perhaps another gpuscope, holds the port; pick another one)",
    errno.EACCES: " (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
    errno.EADDRNOTAVAIL: " (no local interface has this address)",
}


class AgentHttpServer:
    """Serves the agent's endpoints on ``listen_address`` from a daemon thread.

    ``clock`` is the monotonic clock that readiness compares snapshot ages with (a parameter so
    tests need not sleep). ``alerts`` is the rule engine, None when alerting is disabled.
    """

    def __init__(
        self,
        listen_address: str,
        *,
        registry: CollectorRegistry,
        source: SnapshotSource,
        clock: Callable[[], float] = time.monotonic,
        alerts: AlertSource | None = None,
        webhook: WebhookHandler | None = None,
        expected_gpus: int | None = None,
        health: SourceHealth | None = None,
    ) -> None:
        self._address = listen_address
        address = parse_host_port(listen_address, listen=True)
        self._host, self._port = address.host, address.port
        self._app = AgentApp(registry, source, clock, alerts, webhook, expected_gpus=expected_gpus,
                             health=health)
        self._server: _ThreadingWsgiServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def listen_address(self) -> str:
        return self._address

    @property
    def bound_address(self) -> tuple[str, int]:
        """The host and port actually listened on (the port is real even when 0 was asked for)."""
        if self._server is None:
            raise RuntimeError("the HTTP server is not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Bind and serve on a daemon thread; raises ListenError (an OSError) naming the address."""
        if self._server is not None:
            raise RuntimeError("the HTTP server is already started")
        server = _open_server(self._host, self._port, self._address)
        server.set_app(self._app)
        thread = start_thread("gpuscope-http", server.serve_until_woken)
        self._server, self._thread = server, thread
        log.debug("serving HTTP on %s (bound to %s)", self._address, self.bound_address)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the listening socket; requests in flight finish on their own."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.wake()
        if thread is not None:
            thread.join(timeout)
        server.server_close()


