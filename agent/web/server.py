"""The agent's HTTP listener: serves ``app.AgentApp`` on the configured address, IPv4 and IPv6, each
connection on a thread of its own (``http_connection`` reads the request and writes the response),
and stops at once when asked.

Limits, as Go's net/http and Prometheus's exporter-toolkit set them:

* the request line and headers together at most ``MAX_HEADER_BYTES`` (1 MiB), else 431 before any
  more is read;
* at most ``max_requests`` connections handled at once, each on a thread of its own (one thread that
  is done waits a while for the next connection, see ``workers``); one more is answered 503 at once
  and closed, so a flood costs a short write, not a thread;
* a client that sends nothing for ``REQUEST_TIMEOUT_SECONDS`` is dropped;
* the listen backlog is the kernel's ``somaxconn``, so a burst of scrapers waits in the queue instead
  of having its connections dropped (and retried seconds later);
* the ``Server`` header says ``gpuscope``, not the Python version.

With a web configuration file (``web_config``), connections are TLS: the handshake runs on the
connection's own thread (a slow client never holds up accept), and a saturated server closes a new
connection instead of answering 503 in plain text. ``ssl`` is imported only then.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuscope.alerts.model import AlertSource
from gpuscope.alerts.resolved import ResolvedAlerts
from gpuscope.capture.refusals import RefusalLog
from gpuscope.capture.store import CaptureStore
from gpuscope.common.addresses import parse_host_port
from gpuscope.documents import DEFAULT_PROCESSES, ProcessExposure
from gpuscope.exporters.families import Collector
from gpuscope.health import SourceHealth
from gpuscope.listeners import SocketListeners
from gpuscope.snapshot import SnapshotSource
from gpuscope.web.access import AccessControl
from gpuscope.web.app import WEBHOOK_PATH, AgentApp, WebhookHandler
from gpuscope.web.http_connection import SERVER_NAME, serve_connection
from gpuscope.web.rejections import Rejections
from gpuscope.web.utilization_history import UtilizationHistory
from gpuscope.web.web_config import OPEN, WebConfigWatcher, WebSecurity
from gpuscope.web.webhook_auth import WebhookAuth
from gpuscope.web.workers import ConnectionWorkers

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

__all__ = ["DEFAULT_MAX_REQUESTS", "MAX_HEADER_BYTES", "REQUEST_TIMEOUT_SECONDS", "SERVER_NAME",
           "AgentHttpServer", "ListenError", "somaxconn"]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_SECONDS = 10.0  # a client that sends nothing for this long loses its connection
MAX_HEADER_BYTES = 1 << 20  # the request line and headers together (Go's DefaultMaxHeaderBytes)
DEFAULT_MAX_REQUESTS = 64
_BUSY_RESPONSE = (b"HTTP/1.0 503 Service Unavailable\r\nServer: gpuscope\r\nContent-Type: text/plain; "
                  b"charset=utf-8\r\nContent-Length: 56\r\nConnection: close\r\n\r\n"
                  b"too many requests in progress (web.max_requests); retry\n")


def somaxconn() -> int:
    """The kernel's ceiling on a listen backlog (what Go's listeners ask for), else socket.SOMAXCONN."""
    try:
        with open("/proc/sys/net/core/somaxconn", "rb") as file:
            return max(int(file.read().strip() or 0), socket.SOMAXCONN)
    except (OSError, ValueError):
        return socket.SOMAXCONN


class ListenError(OSError):
    """The server could not listen on the configured address (in use, not permitted, unknown host)."""


class _Listener:
    """The listening socket and what serves its connections."""

    def __init__(self, family: socket.AddressFamily, sockaddr: tuple[Any, ...], dual_stack: bool, *,
                 app: WSGIApplication, max_requests: int = DEFAULT_MAX_REQUESTS,
                 security: Callable[[], WebSecurity] = lambda: OPEN,
                 rejections: Rejections | None = None) -> None:
        self._app = app
        self._slots = threading.BoundedSemaphore(max_requests)
        self._security = security
        self._tls = security().tls  # fixed for the server's life: a reload cannot turn TLS on or off
        self._rejections = rejections or Rejections()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the same port at once
            if dual_stack:
                # Accept IPv4 too (as ::ffff:a.b.c.d), whatever net.ipv6.bindv6only says.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(somaxconn())
            # Accepted from the listeners' thread when ready: a connection gone before accept() must
            # not block it (what is accepted gets the request timeout).
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.socket = sock
        address = sock.getsockname()
        self.server_address: tuple[str, int] = (str(address[0]), int(address[1]))
        self._workers = ConnectionWorkers("gpuscope-http")  # a thread per connection, kept a while

    def accept_ready(self) -> None:
        """Accept the connection waiting (the listeners' handler); one that went away is ignored."""
        try:
            connection, client_address = self.socket.accept()
        except OSError:  # gone before accept(), or taken by another accept
            return
        if not self._slots.acquire(blocking=False):  # saturated: a short answer, no thread
            self._rejections.count("busy")
            if not self._tls:  # over TLS a plain-text answer would be garbage: just close
                try:
                    connection.setblocking(False)
                    connection.send(_BUSY_RESPONSE)
                except OSError:
                    pass
            _close(connection)
            return
        try:
            self._workers.submit(self._serve, connection, client_address)
        except BaseException:
            self._slots.release()
            _close(connection)
            log.debug("could not hand over the connection of %s", client_address, exc_info=True)

    def close(self) -> None:
        self.socket.close()
        self._workers.close()

    def _serve(self, connection: socket.socket, client_address: Any) -> None:
        """Serve one connection on a connection thread, then give its slot back."""
        try:
            connection.settimeout(REQUEST_TIMEOUT_SECONDS)  # bounds the TLS handshake too
            if self._tls:
                self._serve_tls(connection, client_address)
            else:
                serve_connection(connection, client_address, self._app, max_header_bytes=MAX_HEADER_BYTES,
                                 server_address=self.server_address)
        except Exception:
            # Clients that hang up mid-response are routine.
            log.debug("error while serving %s", client_address, exc_info=True)
        finally:
            _close(connection)
            self._slots.release()

    def _serve_tls(self, connection: socket.socket, client_address: Any) -> None:
        import ssl

        from gpuscope.web.tls_context import peer_sans

        security = self._security()
        if security.ssl_context is None:  # unreachable: reloads keep TLS on
            return
        try:
            tls = security.ssl_context.wrap_socket(connection, server_side=True)
        except (ssl.SSLError, OSError) as err:
            self._rejections.count("tls_handshake")
            log.debug("TLS handshake with %s failed: %s", client_address, err)
            return
        try:
            if security.allowed_sans is not None and not security.allowed_sans.intersection(
                    peer_sans(tls.getpeercert())):
                self._rejections.count("tls_handshake")
                log.debug("client certificate of %s names none of client_allowed_sans", client_address)
                return
            serve_connection(tls, client_address, self._app, max_header_bytes=MAX_HEADER_BYTES, https=True,
                             server_address=self.server_address)
        finally:
            _close(tls)


def _close(connection: socket.socket) -> None:
    """Say that no more is coming, then close (what socketserver does with a served request)."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
    connection.close()


def _open_server(host: str, port: int, address: str, **options: Any) -> _Listener:
    try:
        if not host:
            if socket.has_ipv6:
                try:
                    return _Listener(socket.AF_INET6, ("::", port), True, **options)
                except OSError as err:
                    # IPv6 disabled in the kernel (module absent, or disable_ipv6=1): IPv4 only.
                    if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                        raise
            return _Listener(socket.AF_INET, ("0.0.0.0", port), False, **options)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        return _Listener(family, sockaddr, False, **options)
    except OSError as err:
        hint = _LISTEN_HINTS.get(err.errno or 0, "")
        message = f"cannot listen on {address!r}: {err.strerror or err}{hint}"
        raise (ListenError(message) if err.errno is None else ListenError(err.errno, message)) from err


_LISTEN_HINTS = {
    errno.EADDRINUSE: " (is another gpuscope running? choose another address: --web.listen-address, or "
                      "web.listen_address in the configuration)",
    errno.EACCES: " (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
    errno.EADDRNOTAVAIL: " (no local interface has this address)",
}


class AgentHttpServer:
    """Serves the agent's endpoints on ``listen_address``, each connection on a thread of its own.

    ``listeners`` is the thread that waits on the listening socket, shared with the agent's other
    listening sockets; by default one of its own, named gpuscope-http. ``clock`` is the monotonic
    clock that readiness compares snapshot ages with (a parameter so tests need not sleep).
    ``alerts`` is the rule engine, None when alerting is disabled. ``captures``, ``refusals``,
    ``history`` and ``simulated`` feed the status page and the capture endpoints (see ``app.AgentApp``).
    ``per_tick``: the families rendered once per sampling tick, ``registry``: those rendered on every
    request (see ``app.AgentApp``).
    """

    def __init__(
        self,
        listen_address: str,
        *,
        registry: Collector,
        per_tick: Collector | None = None,
        listeners: SocketListeners | None = None,
        source: SnapshotSource,
        clock: Callable[[], float] = time.monotonic,
        alerts: AlertSource | None = None,
        webhook: WebhookHandler | None = None,
        expected_gpus: int | None = None,
        health: SourceHealth | None = None,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        web_config: WebConfigWatcher | None = None,
        webhook_auth: WebhookAuth | None = None,
        processes: ProcessExposure = DEFAULT_PROCESSES,
        captures: CaptureStore | None = None,
        refusals: RefusalLog | None = None,
        history: UtilizationHistory | None = None,
        simulated: str | None = None,
        resolved: ResolvedAlerts | None = None,
    ) -> None:
        self._max_requests = max_requests
        self._address = listen_address
        address = parse_host_port(listen_address, listen=True)
        self._host, self._port = address.host, address.port
        self.web_config = web_config if web_config is not None else WebConfigWatcher(None)
        self.rejections = Rejections()
        app = AgentApp(registry, source, clock, alerts, webhook, webhook_auth=webhook_auth,
                       expected_gpus=expected_gpus, health=health, rejections=self.rejections,
                       processes=processes,
                       captures=captures, refusals=refusals, history=history, simulated=simulated,
                       security=self.web_config.current, per_tick=per_tick, resolved=resolved)
        webhook_on = webhook is not None  # it checks its own credentials
        self._app = AccessControl(app, self.web_config.current, rejections=self.rejections,
                                  skip_auth=lambda path: webhook_on and path == WEBHOOK_PATH)
        self._server: _Listener | None = None
        self._own_listeners = listeners is None
        self._listeners = listeners if listeners is not None else SocketListeners("gpuscope-http")

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
        server = _open_server(self._host, self._port, self._address, app=self._app,
                              max_requests=self._max_requests, security=self.web_config.current,
                              rejections=self.rejections)
        self._server = server
        self._listeners.add(server.socket, server.accept_ready)
        log.debug("serving HTTP on %s (bound to %s)", self._address, self.bound_address)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the listening socket; requests in flight finish on their own."""
        server = self._server
        if server is None:
            return
        self._server = None
        self._listeners.remove(server.socket)
        if self._own_listeners:
            self._listeners.close(timeout)
        server.close()
