"""The agent's HTTP endpoints: the status page, /metrics, health and readiness probes, the snapshot,
alerts and captures as JSON, capture downloads.

A small WSGI application (the listening side is ``server``). /metrics encodes the families with
gpuscope.exporters.exposition, which writes the bytes prometheus_client's encoders would, several
times faster: the sampling tick's families (``per_tick``) once per tick and format, served as bytes to
every scraper of the tick (``tick_exposition``), then the registry's, which change between ticks, on
every request. Content negotiation (text 0.0.4 or OpenMetrics, and their Content-Type strings) and the
gzip decision follow prometheus_client's, so clients see what every other Python exporter serves; gzip
uses a fast compression level. ``?name[]=NAME`` (repeatable) keeps only the families, or the samples,
with those names (rendered for that request).

/api/v1/snapshot, /api/v1/alerts and /api/v1/captures answer the documents of ``gpuscope.documents``,
the same the control API answers (GetSnapshot, ListAlerts, ListCaptures): one builder each, and one
reading of the listing's parameters (a bad one is 400 here, INVALID_ARGUMENT there). /api/v1/alerts is
``{"enabled": bool, "alerts": [...]}``, ``{"enabled": false, "alerts": []}`` with alerting off: not an
error, so a poller needs no special case. Its path is Prometheus', its shape the agent's own
(docs/alerts.md, "The alerts endpoint", says why and how to convert it). /api/v1/captures lists the
stored captures the same way (``{"enabled", "downloads", "captures", "refused_count"}``, newest first,
``?limit=N``); ``?include_refused=1`` adds ``"refused"``: the capture triggers the agent refused lately.

``/`` is the status page (``status_page``), rendered from what the agent already holds.

/api/v1/captures/<id> sends one capture as a tar file (``capture_download``). Traces hold whatever
the profiler recorded (op and kernel names, Python stacks), more than the telemetry the other
endpoints give, so it answers 403 unless the web configuration authenticates every client (basic
auth users, or required client certificates): without one, the control API's socket, which only the
agent's user and group can open, stays the way to fetch a capture.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from gpuscope.alerts.model import AlertSource
from gpuscope.alerts.resolved import ResolvedAlerts
from gpuscope.capture.refusals import RefusalLog
from gpuscope.capture.store import CaptureIdError, CaptureNotFoundError, CaptureStore, CaptureStoreError
from gpuscope.documents import (
    CAPTURES_PATH,
    DEFAULT_PROCESSES,
    NO_SNAPSHOT_YET,
    ParameterError,
    ProcessExposure,
    alerts_document,
    captures_document,
    encode_document,
    list_parameters,
    snapshot_document,
)
from gpuscope.exporters.exposition import gzip_accepted, negotiate, restrict_families
from gpuscope.exporters.families import Collector
from gpuscope.health import SourceHealth
from gpuscope.snapshot import SnapshotSource
from gpuscope.version import __version__
from gpuscope.web.capture_download import CaptureArchive, capture_archive
from gpuscope.web.rejections import Rejections
from gpuscope.web.status_page import StatusView, render_status_page
from gpuscope.web.tick_exposition import TickExposition
from gpuscope.web.utilization_history import DEFAULT_POINTS, UtilizationHistory, UtilizationSeries
from gpuscope.web.web_config import WebSecurity

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from gpuscope.web.webhook_auth import WebhookAuth

log = logging.getLogger(__name__)

READY_MAX_AGE_INTERVALS = 3  # a snapshot older than this many sampling intervals is stale
# gzip level of /metrics. Levels 1-3 use zlib's fast strategy: on 8 GPUs x 4 processes level 3 takes
# ~0.09 ms against 0.7 ms for prometheus_client's 9, for 4.8 kB instead of 4.2 kB (of 50 kB plain).
GZIP_LEVEL = 3

_TEXT = "text/plain; charset=utf-8"
_JSON = "application/json"
_HTML = "text/html; charset=utf-8"
# The status page runs nothing and loads nothing: a policy that says so keeps an injected tag inert.
_PAGE_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'")

# A handler's answer: status, headers, and the body whole or, for a capture download, streamed.
_Response = tuple[str, list[tuple[str, str]], bytes | CaptureArchive]
# POST /api/v1/alertmanager: the handler takes the body and returns (HTTP status line, JSON reply).
WebhookHandler = Callable[[bytes], tuple[str, dict[str, Any]]]
_JSON_TYPES = ("application/json",)
WEBHOOK_PATH = "/api/v1/alertmanager"
WEBHOOK_MAX_BYTES = 1 << 20
CAPTURE_DOWNLOAD_PREFIX = CAPTURES_PATH + "/"


class AgentApp:
    """The WSGI application: routes a request to one small handler per endpoint."""

    def __init__(self, registry: Collector, source: SnapshotSource, clock: Callable[[], float],
                 alerts: AlertSource | None = None, webhook: WebhookHandler | None = None, *,
                 webhook_auth: WebhookAuth | None = None, expected_gpus: int | None = None,
                 health: SourceHealth | None = None, rejections: Rejections | None = None,
                 processes: ProcessExposure = DEFAULT_PROCESSES,
                 captures: CaptureStore | None = None, history: UtilizationHistory | None = None,
                 simulated: str | None = None, security: Callable[[], WebSecurity] | None = None,
                 wall_clock: Callable[[], float] = time.time, refusals: RefusalLog | None = None,
                 per_tick: Collector | None = None, resolved: ResolvedAlerts | None = None):
        """``per_tick``: the collector whose families are a function of ``source``'s latest snapshot and
        its staleness (SnapshotCollector), served before ``registry``'s from one render per tick and
        format; ``registry``: the families rendered on every request.
        ``processes``: the ``processes`` settings, which decide what the documents say of GPU
        processes (gpuscope.documents). ``captures``: the capture store (None: captures are off).
        ``refusals``: the capture triggers the capture service refused lately. ``resolved``: the alerts
        resolved lately, for the status page's captures. ``history``: the utilization ring a sampler
        listener feeds, for the status page's sparklines. ``simulated``: the scenario's name on a
        simulated node. ``security``: the web configuration in force (capture downloads
        need one that authenticates every client). ``wall_clock``: Unix time, for the ages the page shows."""
        if webhook is not None and webhook_auth is None:
            raise ValueError("the webhook needs its credentials (webhook_auth)")
        self._webhook_auth = webhook_auth
        self._processes = processes
        self._captures = captures
        self._refusals = refusals
        self._resolved = resolved  # the alerts resolved lately, for the status page's captures
        self._history = history
        self._simulated = simulated
        self._security = security
        self._wall_clock = wall_clock
        self._rejections = rejections if rejections is not None else Rejections()
        self._expected_gpus = expected_gpus
        self._health = health
        self._webhook = webhook
        self._registry = registry
        self.tick_exposition = (None if per_tick is None else
                                TickExposition(per_tick, source, gzip_level=GZIP_LEVEL))
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
            CAPTURES_PATH: self._captures_json,
        }

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO") or "/"
        handler = self._routes.get(path)
        if handler is None and path.startswith(CAPTURE_DOWNLOAD_PREFIX):
            handler = self._capture_download
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
            log.exception("error serving %s %s", method, path)
            status, headers, body = _text("500 Internal Server Error", "internal error, see the agent's log")
        if isinstance(body, CaptureArchive):
            headers.append(("Content-Length", str(body.length)))
            start_response(status, headers)
            return [] if method == "HEAD" else body.chunks()
        headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        return [b"" if method == "HEAD" else body]

    def _metrics(self, environ: WSGIEnvironment) -> _Response:
        # HEAD renders too: its Content-Length is the GET body's (__call__ leaves the body out).
        # The tick's families come from one render per tick and format; the registry's (the agent's
        # own state between ticks: refused requests, its CPU and memory, sources' health, captures,
        # alerts) are rendered here on every request, after them, so they are never stale.
        encode, content_type = negotiate(environ.get("HTTP_ACCEPT"))
        names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
        gzipped = gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING") or "")
        headers = [("Content-Type", content_type)]
        if gzipped:
            headers.append(("Content-Encoding", "gzip"))
        ticks = self.tick_exposition
        if ticks is not None and not names:
            rest = encode(self._registry.collect())
            render = ticks.render(content_type, encode)
            return "200 OK", headers, render.gzip(rest) if gzipped else render.plain(rest)
        families = self._registry.collect()
        if ticks is not None:
            families = itertools.chain(ticks.families(), families)
        body = encode(restrict_families(families, frozenset(names)) if names else families)
        if gzipped:
            body = gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
        return "200 OK", headers, body

    def _alertmanager_webhook(self, environ: WSGIEnvironment, method: str) -> _Response:
        """POST /api/v1/alertmanager: Alertmanager's webhook, a capture trigger (see capture/webhook.py).
        Checked in this order, each before the body is read: the webhook is on, the method, the
        credentials, a JSON Content-Type (no form a browser can send cross-site), the length."""
        if self._webhook is None or self._webhook_auth is None:
            return _json("404 Not Found", {"error": "the Alertmanager webhook is off on this agent "
                                                    "(capture.webhook.enabled)"})
        if method != "POST":
            status, headers, body = _text("405 Method Not Allowed", f"method {method} not allowed")
            headers.append(("Allow", "POST"))
            return status, headers, body
        if not self._webhook_auth.allows(environ.get("HTTP_AUTHORIZATION") or ""):
            self._rejections.count("unauthorized")
            status, headers, body = _json("401 Unauthorized",
                                          {"error": "the webhook's credentials are missing or wrong"})
            headers.append(("WWW-Authenticate", self._webhook_auth.challenge()))
            return status, headers, body
        media_type = (environ.get("CONTENT_TYPE") or "").partition(";")[0].strip().lower()
        if media_type not in _JSON_TYPES:
            shown = media_type[:60] or "untyped"
            return _json("415 Unsupported Media Type",
                         {"error": f"the body must be application/json, not {shown!r}"})
        length_text = environ.get("CONTENT_LENGTH") or ""
        if environ.get("HTTP_TRANSFER_ENCODING") or not length_text:
            return _json("411 Length Required", {"error": "the body must come with a Content-Length"})
        if not (length_text.isascii() and length_text.isdigit()) or len(length_text) > 15:
            return _json("400 Bad Request", {"error": f"invalid Content-Length {length_text[:20]!r}"})
        length = int(length_text)
        if length > WEBHOOK_MAX_BYTES:  # refused before reading it
            return _json("413 Content Too Large",
                         {"error": f"payload of {length} bytes exceeds the {WEBHOOK_MAX_BYTES}-byte limit"})
        code, reply = self._webhook(environ["wsgi.input"].read(length))
        return _json(code, reply)

    def _index(self, environ: WSGIEnvironment) -> _Response:
        view = StatusView(
            snapshot=self._source.latest(), stale=self._source.snapshot_is_stale(),
            alerts=None if self._alerts is None else self._alerts.alerts(),
            captures=None if self._captures is None else self._captures.list(),
            refusals=() if self._refusals is None else self._refusals.recent(),
            resolved=() if self._resolved is None else self._resolved.recent(),
            history=self._history.series if self._history is not None else _no_history,
            version=__version__, now=self._wall_clock(), simulated=self._simulated,
            include_processes=self._processes.export, include_users=self._processes.user,
            downloads=self._downloads_allowed(),
            history_points=self._history.points if self._history is not None else DEFAULT_POINTS)
        headers = [("Content-Type", _HTML), ("Cache-Control", "no-store"),
                   ("Content-Security-Policy", _PAGE_POLICY)]
        return "200 OK", headers, render_status_page(view)

    def _captures_json(self, environ: WSGIEnvironment) -> _Response:
        """GET /api/v1/captures[?limit=N][&include_refused=1]: the stored captures' records, newest
        first; with include_refused, the refused triggers too (at most N of them, newest first)."""
        query = parse_qs(environ.get("QUERY_STRING", ""))
        try:
            parameters = list_parameters(limit=_last(query, "limit"),
                                         include_refused=_last(query, "include_refused"))
        except ParameterError as err:
            return _json("400 Bad Request", {"error": str(err)})
        document = captures_document(self._captures, self._refusals, parameters, self._processes,
                                     downloads=self._downloads_allowed())
        return "200 OK", [("Content-Type", _JSON)], encode_document(document)

    def _capture_download(self, environ: WSGIEnvironment) -> _Response:
        """GET /api/v1/captures/<id>: the capture as ``<id>.tar`` (see the module's docstring)."""
        if self._captures is None:
            return _json("404 Not Found", {"error": "captures are off on this agent (capture.enabled)"})
        if not self._downloads_allowed():
            return _json("403 Forbidden", {
                "error": "capture downloads over HTTP need a web configuration file that authenticates "
                         "every client (basic_auth_users, or client_auth_type: RequireAndVerifyClientCert); "
                         "on the node, `gpuscope captures get ID` fetches it over the control API"})
        capture_id = (environ.get("PATH_INFO") or "")[len(CAPTURE_DOWNLOAD_PREFIX):]
        try:
            archive = capture_archive(self._captures, capture_id)  # validates the id before any path
        except CaptureIdError as err:
            return _json("400 Bad Request", {"error": str(err)})
        except CaptureNotFoundError as err:
            return _json("404 Not Found", {"error": str(err)})
        except CaptureStoreError as err:
            log.warning("cannot send capture %s: %s", capture_id, err)
            return _json("500 Internal Server Error",
                         {"error": f"cannot read capture {capture_id}; see the agent's log"})
        headers = [("Content-Type", "application/x-tar"), ("Cache-Control", "no-store"),
                   ("Content-Disposition", f'attachment; filename="{archive.file_name}"')]
        return "200 OK", headers, archive

    def _downloads_allowed(self) -> bool:
        """Whether the web configuration in force authenticates every client (see the docstring)."""
        return self._security is not None and self._security().authenticates_every_client

    def _healthy(self, environ: WSGIEnvironment) -> _Response:
        if self._source.is_alive():
            return _text("200 OK", "OK")
        return _text("503 Service Unavailable", "unhealthy: no sampling tick completed within "
                                                "watchdog.unhealthy_after (the sampler is stuck or stopped)")

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
        dead = self._health.dead_threads() if self._health is not None else []
        if dead:
            return _text("503 Service Unavailable",
                         f"not ready: the {', '.join(dead)} thread(s) died (see the agent's log); restart "
                         "the agent")
        readable = sum(1 for gpu in snapshot.gpus if gpu.up)
        if self._expected_gpus is not None and readable < self._expected_gpus:
            return _text("503 Service Unavailable", f"not ready: {readable} of the {self._expected_gpus} "
                                                    "expected GPUs are readable (nvml.expected_gpus)")
        return _text("200 OK", "OK")

    def _snapshot(self, environ: WSGIEnvironment) -> _Response:
        snapshot = self._source.latest()
        if snapshot is None:
            return _json("503 Service Unavailable", {"error": NO_SNAPSHOT_YET})
        document = snapshot_document(snapshot, self._processes)
        return "200 OK", [("Content-Type", _JSON)], encode_document(document)

    def _alerts_json(self, environ: WSGIEnvironment) -> _Response:
        return "200 OK", [("Content-Type", _JSON)], encode_document(alerts_document(self._alerts))


def _text(status: str, line: str) -> _Response:
    return status, [("Content-Type", _TEXT)], (line + "\n").encode()


def _json(status: str, document: dict[str, Any]) -> _Response:
    return status, [("Content-Type", _JSON)], json.dumps(document).encode()


def _last(query: dict[str, list[str]], name: str) -> str | None:
    """A query parameter's last value; None when the query does not name it."""
    values = query.get(name)
    return values[-1] if values else None


def _no_history(index: int, uuid: str) -> UtilizationSeries:
    return UtilizationSeries((), 0.0)
