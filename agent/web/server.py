"""The agent's HTTP listener: a threading ``wsgiref`` server (the standard library only) that serves
``app.AgentApp`` on the configured address, IPv4 and IPv6, and stops at once when asked.

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
connection instead of answering 503 in plain text.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry

from gpuscope.alerts.model import AlertSource
from gpuscope.capture.store import CaptureStore
from gpuscope.common.addresses import parse_host_port
from gpuscope.health import SourceHealth
from gpuscope.listeners import SocketListeners
from gpuscope.snapshot import SnapshotSource
from gpuscope.web.access import AccessControl
from gpuscope.web.app import WEBHOOK_PATH, AgentApp, WebhookHandler
from gpuscope.web.rejections import Rejections
from gpuscope.web.tls_context import peer_sans
from gpuscope.web.utilization_history import UtilizationHistory
from gpuscope.web.web_config import OPEN, WebConfigWatcher, WebSecurity
from gpuscope.web.webhook_auth import WebhookAuth
from gpuscope.web.workers import ConnectionWorkers

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_SECONDS = 10.0  # a client that sends nothing for this long loses its connection
MAX_HEADER_BYTES = 1 << 20  # the request line and headers together (Go's DefaultMaxHeaderBytes)
DEFAULT_MAX_REQUESTS = 64
SERVER_NAME = "gpuscope"
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


class _ServerHandler(ServerHandler):
    """wsgiref's handler, sending the status line and headers with the body's first part in one
    write (wsgiref writes each of them apart: four trips through the network stack per response)."""

    server_software = SERVER_NAME
    _head: list[bytes] | None = None  # what send_headers wrote, not yet sent
    _writing_head = False

    def send_headers(self) -> None:
        self._head, self._writing_head = [], True
        try:
            super().send_headers()  # its _write calls land in _head
        finally:
            self._writing_head = False

    def _write(self, data: bytes) -> None:
        head = self._head
        if head is None:
            super()._write(data)
        elif self._writing_head:
            head.append(data)
        else:  # the first part of the body: sent with the head, all at once
            self._head = None
            head.append(data)
            super()._write(b"".join(head))

    def finish_content(self) -> None:
        super().finish_content()
        self._send_head()  # a response without a body: its headers alone

    def close(self) -> None:
        try:
            self._send_head()
        finally:
            super().close()

    def _send_head(self) -> None:
        head, self._head = self._head, None
        if head:
            super()._write(b"".join(head))
            self._flush()


class _HeaderBudget:
    """The connection's reader while the headers are parsed: it refuses to read past the budget, so
    a client cannot make the agent buffer more than MAX_HEADER_BYTES of headers."""

    def __init__(self, inner: Any, budget: int) -> None:
        self.inner = inner
        self._left = budget

    def readline(self, limit: int = -1) -> bytes:
        if self._left <= 0:
            raise http.client.HTTPException(f"the headers are larger than {MAX_HEADER_BYTES} bytes")
        want = self._left + 1 if limit < 0 else min(limit, self._left + 1)
        line: bytes = self.inner.readline(want)
        self._left -= len(line)
        if self._left < 0:
            raise http.client.HTTPException(f"the headers are larger than {MAX_HEADER_BYTES} bytes")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _RequestHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_SECONDS

    def version_string(self) -> str:
        return SERVER_NAME  # not the Python version: nothing for a scanner to match

    def handle(self) -> None:
        """WSGIRequestHandler.handle, with the application's responses naming the server as
        version_string() does (wsgiref's ServerHandler would add its and Python's versions)."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # an error was answered
            return
        handler = _ServerHandler(self.rfile, cast(Any, self.wfile), self.get_stderr(), self.get_environ(),
                                 multithread=False)
        handler.request_handler = self  # type: ignore[attr-defined]  # wsgiref's back-pointer for logging
        handler.run(self.server.get_app())  # type: ignore[attr-defined]

    def parse_request(self) -> bool:
        # Over budget, the base class answers 431 (it reads an HTTPException as "too many headers").
        reader = self.rfile
        request_line: bytes = getattr(self, "raw_requestline", b"")
        self.rfile = cast(Any, _HeaderBudget(reader, MAX_HEADER_BYTES - len(request_line)))
        try:
            return bool(super().parse_request())
        finally:
            self.rfile = reader

    def get_environ(self) -> dict[str, Any]:
        environ: dict[str, Any] = super().get_environ()
        if isinstance(self.connection, ssl.SSLSocket):
            environ["HTTPS"] = "on"  # wsgi.url_scheme: https
            environ["wsgi.url_scheme"] = "https"
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing per request: a 15 s scrape interval would flood the journal."""


class _ThreadingWsgiServer(WSGIServer):
    request_queue_size = somaxconn()

    def __init__(self, family: socket.AddressFamily, sockaddr: tuple[Any, ...], dual_stack: bool, *,
                 max_requests: int = DEFAULT_MAX_REQUESTS,
                 security: Callable[[], WebSecurity] = lambda: OPEN,
                 rejections: Rejections | None = None) -> None:
        self.address_family = family
        self._dual_stack = dual_stack
        self._slots = threading.BoundedSemaphore(max_requests)
        self._security = security
        self._tls = security().tls  # fixed for the server's life: a reload cannot turn TLS on or off
        self._rejections = rejections or Rejections()
        self._workers = ConnectionWorkers("gpuscope-http")  # a thread per connection, kept a while
        super().__init__(sockaddr, _RequestHandler)
        # Accepted from the listeners' thread when ready: a connection gone before accept() must not
        # block it (what is accepted is made blocking again, with the request timeout).
        self.socket.setblocking(False)

    def accept_ready(self) -> None:
        """Accept the connection waiting (the listeners' handler); one that went away is ignored."""
        try:
            request, client_address = self.get_request()
        except OSError:  # gone before accept(), or taken by another accept
            return
        try:
            self.process_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
            self.shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        self._workers.close()

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

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # saturated: a short answer, no thread
            self._rejections.count("busy")
            if not self._tls:  # over TLS a plain-text answer would be garbage: just close
                try:
                    request.setblocking(False)
                    request.send(_BUSY_RESPONSE)
                except OSError:
                    pass
            self.shutdown_request(request)
            return
        try:
            self._workers.submit(self.process_request_thread, request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection on a connection thread, then give its slot back."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        if not self._tls:
            super().finish_request(request, client_address)
            return
        security = self._security()
        if security.ssl_context is None:  # unreachable: reloads keep TLS on
            return
        request.settimeout(REQUEST_TIMEOUT_SECONDS)  # bounds the handshake too
        try:
            connection = security.ssl_context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as err:
            self._rejections.count("tls_handshake")
            log.debug("TLS handshake with %s failed: %s", client_address, err)
            return
        try:
            if security.allowed_sans is not None and not security.allowed_sans.intersection(
                    peer_sans(connection.getpeercert())):
                self._rejections.count("tls_handshake")
                log.debug("client certificate of %s names none of client_allowed_sans", client_address)
                return
            super().finish_request(connection, client_address)
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_WR)
        finally:
            connection.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-response are routine; the base class prints a traceback to stderr.
        log.debug("error while serving %s", client_address, exc_info=True)


def _open_server(host: str, port: int, address: str, **options: Any) -> _ThreadingWsgiServer:
    try:
        if not host:
            if socket.has_ipv6:
                try:
                    return _ThreadingWsgiServer(socket.AF_INET6, ("::", port), True, **options)
                except OSError as err:
                    # IPv6 disabled in the kernel (module absent, or disable_ipv6=1): IPv4 only.
                    if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                        raise
            return _ThreadingWsgiServer(socket.AF_INET, ("0.0.0.0", port), False, **options)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        return _ThreadingWsgiServer(family, sockaddr, False, **options)
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
    ``alerts`` is the rule engine, None when alerting is disabled. ``captures``, ``history`` and
    ``simulated`` feed the status page and the capture endpoints (see ``app.AgentApp``).
    """

    def __init__(
        self,
        listen_address: str,
        *,
        registry: CollectorRegistry,
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
        include_processes: bool = True,
        include_users: bool = True,
        captures: CaptureStore | None = None,
        history: UtilizationHistory | None = None,
        simulated: str | None = None,
    ) -> None:
        self._max_requests = max_requests
        self._address = listen_address
        address = parse_host_port(listen_address, listen=True)
        self._host, self._port = address.host, address.port
        self.web_config = web_config if web_config is not None else WebConfigWatcher(None)
        self.rejections = Rejections()
        app = AgentApp(registry, source, clock, alerts, webhook, webhook_auth=webhook_auth,
                       expected_gpus=expected_gpus, health=health, rejections=self.rejections,
                       include_processes=include_processes, include_users=include_users,
                       captures=captures, history=history, simulated=simulated,
                       security=self.web_config.current)
        webhook_on = webhook is not None  # it checks its own credentials
        self._app = AccessControl(app, self.web_config.current, rejections=self.rejections,
                                  skip_auth=lambda path: webhook_on and path == WEBHOOK_PATH)
        self._server: _ThreadingWsgiServer | None = None
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
        server = _open_server(self._host, self._port, self._address, max_requests=self._max_requests,
                              security=self.web_config.current, rejections=self.rejections)
        server.set_app(self._app)
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
        server.server_close()
