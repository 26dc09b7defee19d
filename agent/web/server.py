"""The agent's HTTP endpoints: /metrics, health and readiness probes, the snapshot and alerts as JSON.

A small WSGI app on a threading ``wsgiref`` server (no dependency beyond the standard library and
prometheus_client). /metrics collects the registry once per request and encodes the families with
gpuscope.exporters.exposition, which writes the bytes prometheus_client's encoders would, several
times faster. Content negotiation (text 0.0.4 or OpenMetrics, and their Content-Type strings) and
the gzip decision are prometheus_client's own functions, so clients see what every other Python
exporter serves; gzip uses a fast compression level. ``?name[]=NAME`` (repeatable) keeps only the
families, or the samples, with those names.

/api/v1/alerts answers 200 with ``{"enabled": bool, "alerts": [Alert.to_json(), ...]}`` (pending and
firing alerts); with alerting disabled (no AlertSource) it is ``{"enabled": false, "alerts": []}``,
not an error, so a dashboard or script polling it needs no special case.
"""

from __future__ import annotations

import errno
import gzip
import ipaddress
import json
import logging
import math
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import gzip_accepted

from gpuscope.alerts.model import AlertSource
from gpuscope.exporters.exposition import negotiate, restrict_families
from gpuscope.snapshot import SnapshotSource
from gpuscope.version import __version__

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

logger = logging.getLogger(__name__)

READY_MAX_AGE_INTERVALS = 3  # a snapshot older than this many sampling intervals is stale
REQUEST_TIMEOUT_SECONDS = 30.0  # a client that sends nothing for this long loses its thread
# gzip level of /metrics. Levels 1-3 use zlib's fast strategy: on 8 GPUs x 4 processes level 3 takes
# ~0.09 ms against 0.7 ms for prometheus_client's 9, for 4.8 kB instead of 4.2 kB (of 50 kB plain).
GZIP_LEVEL = 3

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"

_Response = tuple[str, list[tuple[str, str]], bytes]
# POST /api/v1/alertmanager: the handler takes the body and returns (HTTP status line, JSON reply).
WebhookHandler = Callable[[bytes], tuple[str, dict[str, Any]]]
WEBHOOK_PATH = "/api/v1/alertmanager"
WEBHOOK_MAX_BYTES = 1 << 20


class ListenError(OSError):
    """The server could not listen on the configured address (in use, not permitted, unknown host)."""


def parse_listen_address(value: str) -> tuple[str, int]:
    """Split ``:PORT``, ``HOST:PORT`` or ``[IPV6]:PORT`` into (host, port); host "" means all interfaces.

    Raises ValueError naming ``value`` when it is not one of these forms.
    """
    expected = "expected ':PORT', 'HOST:PORT' or '[IPV6]:PORT', e.g. ':9847' or '127.0.0.1:9847'"
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise ValueError(f"invalid listen address {value!r}: {expected}")
        port_text = rest[1:]
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError("not IPv6")
        except ValueError:
            raise ValueError(
                f"invalid listen address {value!r}: {host!r} in brackets is not an IPv6 address"
            ) from None
    else:
        host, colon, port_text = value.rpartition(":")
        if not colon:
            raise ValueError(f"invalid listen address {value!r}: no port; {expected}")
        if ":" in host:
            raise ValueError(
                f"invalid listen address {value!r}: put an IPv6 address in brackets, e.g. '[::1]:9847'"
            )
        if host and not _HOSTNAME.fullmatch(host):
            raise ValueError(f"invalid listen address {value!r}: {host!r} is not a host name or address")
    if not (port_text.isascii() and port_text.isdigit()) or int(port_text) > 65535:
        raise ValueError(f"invalid listen address {value!r}: port must be a number from 0 to 65535")
    return host, int(port_text)


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
        logger.debug("error while serving %s", client_address, exc_info=True)


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
    ) -> None:
        self._address = listen_address
        self._host, self._port = parse_listen_address(listen_address)
        self._app = _AgentApp(registry, source, clock, alerts, webhook)
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
        thread = threading.Thread(target=server.serve_until_woken, name="gpuscope-http", daemon=True)
        thread.start()
        self._server, self._thread = server, thread
        logger.debug("serving HTTP on %s (bound to %s)", self._address, self.bound_address)

    def stop(self) -> None:
        """Stop serving and close the listening socket; requests in flight finish on their own."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.wake()
        if thread is not None:
            thread.join(timeout=5)
        server.server_close()


class _AgentApp:
    """The WSGI application: routes a request to one small handler per endpoint."""

    def __init__(self, registry: CollectorRegistry, source: SnapshotSource, clock: Callable[[], float],
                 alerts: AlertSource | None = None, webhook: WebhookHandler | None = None):
        self._webhook = webhook
        self._registry = registry
        self._source = source
        self._clock = clock
        self._alerts = alerts
        self._routes: dict[str, Callable[[WSGIEnvironment], _Response]] = {
            "/": self._index,
            "/metrics": self._metrics,
            "/-/healthy": self._healthy,
            "/-/ready": self._ready,
            "/api/v1/snapshot": self._snapshot,
            "/api/v1/alerts": self._alerts_json,
        }

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO") or "/"
        handler = self._routes.get(path)
        try:
            if path == WEBHOOK_PATH:
                status, headers, body = self._alertmanager_webhook(environ, method)
            elif handler is None:
                status, headers, body = _text("404 Not Found", f"not found: {path}")
            elif method not in ("GET", "HEAD"):
                status, headers, body = _text("405 Method Not Allowed", f"method {method} not allowed")
                headers.append(("Allow", "GET, HEAD"))
            else:
                status, headers, body = handler(environ)
        except Exception:
            logger.exception("error serving %s %s", method, path)
            status, headers, body = _text("500 Internal Server Error", "internal error, see the agent's log")
        headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        return [b"" if method == "HEAD" else body]

    def _metrics(self, environ: WSGIEnvironment) -> _Response:
        # HEAD renders too: its Content-Length is the GET body's (__call__ leaves the body out).
        encode, content_type = negotiate(environ.get("HTTP_ACCEPT"))
        families = self._registry.collect()
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        body = encode(restrict_families(families, frozenset(names)) if names else families)
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING") or ""):
            body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
            headers.append(("Content-Encoding", "gzip"))
        return "200 OK", headers, body

    def _alertmanager_webhook(self, environ: WSGIEnvironment, method: str) -> _Response:
        """POST /api/v1/alertmanager: Alertmanager's webhook, a capture trigger (see capture/webhook.py)."""
        if method != "POST":
            status, headers, body = _text("405 Method Not Allowed", f"method {method} not allowed")
            headers.append(("Allow", "POST"))
            return status, headers, body
        if self._webhook is None:
            return _json("503 Service Unavailable", {"error": "captures are disabled on this agent"})
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _json("400 Bad Request", {"error": "invalid Content-Length"})
        if length > WEBHOOK_MAX_BYTES:  # refused before reading it
            return _json("413 Content Too Large",
                         {"error": f"payload of {length} bytes exceeds the {WEBHOOK_MAX_BYTES}-byte limit"})
        code, reply = self._webhook(environ["wsgi.input"].read(length))
        return _json(code, reply)

    def _index(self, environ: WSGIEnvironment) -> _Response:
        return "200 OK", [("Content-Type", "text/html; charset=utf-8")], _INDEX_HTML

    def _healthy(self, environ: WSGIEnvironment) -> _Response:
        if self._source.is_alive():
            return _text("200 OK", "OK")
        return _text("503 Service Unavailable", "unhealthy: the sampling thread is not running")

    def _ready(self, environ: WSGIEnvironment) -> _Response:
        snapshot = self._source.latest()
        if snapshot is None:
            return _text("503 Service Unavailable", "not ready: no snapshot yet (the first tick is not done)")
        if not snapshot.nvml_up:
            return _text("503 Service Unavailable", "not ready: NVML is not available")
        age = self._clock() - snapshot.monotonic
        limit = READY_MAX_AGE_INTERVALS * self._source.interval_seconds
        if age >= limit:
            return _text(
                "503 Service Unavailable",
                f"not ready: the latest snapshot is {age:.1f} s old (limit {limit:g} s); "
                "the sampler may be stuck in an NVML call",
            )
        return _text("200 OK", "OK")

    def _snapshot(self, environ: WSGIEnvironment) -> _Response:
        snapshot = self._source.latest()
        if snapshot is None:
            body = json.dumps({"error": "no snapshot yet: the first sampling tick has not finished"})
            return "503 Service Unavailable", [("Content-Type", _JSON)], body.encode()
        return "200 OK", [("Content-Type", _JSON)], json.dumps(snapshot.to_json()).encode()

    def _alerts_json(self, environ: WSGIEnvironment) -> _Response:
        alerts = [] if self._alerts is None else [alert.to_json() for alert in self._alerts.alerts()]
        document = {"enabled": self._alerts is not None, "alerts": alerts}
        try:
            body = json.dumps(document, allow_nan=False)
        except ValueError:  # a NaN or infinite rule value: JSON has no literal for it, null is honest
            body = json.dumps(_finite(document), allow_nan=False)
        return "200 OK", [("Content-Type", _JSON)], body.encode()


def _text(status: str, line: str) -> _Response:
    return status, [("Content-Type", _TEXT)], (line + "\n").encode()


def _json(status: str, document: dict[str, Any]) -> _Response:
    return status, [("Content-Type", _JSON)], json.dumps(document).encode()


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite(value) for value in obj]
    return obj


_INDEX_HTML = f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>gpuscope</title></head>
<body>
<h1>gpuscope {__version__}</h1>
<p>GPU telemetry agent.</p>
<ul>
<li><a href="/metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="/-/healthy">/-/healthy</a>: liveness of the sampler</li>
<li><a href="/-/ready">/-/ready</a>: readiness (fresh snapshot, NVML up)</li>
<li><a href="/api/v1/snapshot">/api/v1/snapshot</a>: the latest snapshot as JSON</li>
<li><a href="/api/v1/alerts">/api/v1/alerts</a>: the agent's pending and firing alerts as JSON</li>
<li><code>POST /api/v1/alertmanager</code>: Alertmanager webhook (v4), triggers captures</li>
</ul>
</body>
</html>
""".encode()
