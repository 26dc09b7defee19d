"""The agent's HTTP endpoints: the status page, /metrics, health and readiness probes, the snapshot,
alerts and captures as JSON, capture downloads.

A small WSGI application (the listening side is ``server``). /metrics collects the registry once per
request and encodes the families with gpuscope.exporters.exposition, which writes the bytes
prometheus_client's encoders would, several times faster. Content negotiation (text 0.0.4 or
OpenMetrics, and their Content-Type strings) and the gzip decision follow prometheus_client's, so
clients see what every other Python exporter serves; gzip uses a fast compression level.
``?name[]=NAME`` (repeatable) keeps only the families, or the samples, with those names.

/api/v1/alerts answers 200 with ``{"enabled": bool, "alerts": [Alert.to_json(), ...]}`` (pending and
firing alerts); with alerting disabled (no AlertSource) it is ``{"enabled": false, "alerts": []}``,
not an error, so a dashboard or script polling it needs no special case. The path is Prometheus', the
shape is not: it is the agent's own schema, shared with the control API's ListAlerts (docs/alerts.md,
"The alerts endpoint", says why and how to convert it). /api/v1/captures lists the stored captures
the same way (``{"enabled", "downloads", "captures", "refused_count"}``, newest first);
``?include_refused=1`` adds ``"refused"``: the capture triggers the agent refused lately (the newest
first, each with its reason and ``allowed_at``, when a trigger like it would next be allowed).
``refused_count`` counts the refusals since the agent started, those no longer kept included.

``/`` is the status page (``status_page``), rendered from what the agent already holds.

/api/v1/captures/<id> sends one capture as a tar file (``capture_download``). Traces hold whatever
the profiler recorded (op and kernel names, Python stacks), more than the telemetry the other
endpoints give, so it answers 403 unless the web configuration authenticates every client (basic
auth users, or required client certificates): without one, the control API's socket, which only the
agent's user and group can open, stays the way to fetch a capture.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from gpuscope.alerts.model import AlertSource
from gpuscope.alerts.resolved import ResolvedAlerts
from gpuscope.capture.refusals import RefusalLog, RefusedTrigger
from gpuscope.capture.store import CaptureIdError, CaptureNotFoundError, CaptureStore, CaptureStoreError
from gpuscope.exporters.exposition import gzip_accepted, negotiate, restrict_families
from gpuscope.exporters.families import Collector
from gpuscope.health import SourceHealth
from gpuscope.snapshot import SnapshotSource
from gpuscope.version import __version__
from gpuscope.web.capture_download import CaptureArchive, capture_archive
from gpuscope.web.rejections import Rejections
from gpuscope.web.status_page import CAPTURES_PATH, StatusView, render_status_page
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
DEFAULT_CAPTURE_LIST = 100  # /api/v1/captures without ?limit=
_FLAGS = {"0": False, "1": True, "false": False, "true": True}  # the values of a yes/no query parameter
MAX_CAPTURE_LIST = 1000


class AgentApp:
    """The WSGI application: routes a request to one small handler per endpoint."""

    def __init__(self, registry: Collector, source: SnapshotSource, clock: Callable[[], float],
                 alerts: AlertSource | None = None, webhook: WebhookHandler | None = None, *,
                 webhook_auth: WebhookAuth | None = None, expected_gpus: int | None = None,
                 health: SourceHealth | None = None, rejections: Rejections | None = None,
                 include_processes: bool = True, include_users: bool = True,
                 captures: CaptureStore | None = None, history: UtilizationHistory | None = None,
                 simulated: str | None = None, security: Callable[[], WebSecurity] | None = None,
                 wall_clock: Callable[[], float] = time.time, refusals: RefusalLog | None = None,
                 resolved: ResolvedAlerts | None = None):
        """``captures``: the capture store (None: captures are off). ``refusals``: the capture triggers
        the capture service refused lately. ``history``: the utilization
        ring a sampler listener feeds, for the status page's sparklines. ``simulated``: the scenario's
        name on a simulated node. ``security``: the web configuration in force (capture downloads
        need one that authenticates every client). ``wall_clock``: Unix time, for the ages the page shows."""
        if webhook is not None and webhook_auth is None:
            raise ValueError("the webhook needs its credentials (webhook_auth)")
        self._webhook_auth = webhook_auth
        self._include_processes = include_processes
        self._include_users = include_users
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
            include_processes=self._include_processes, include_users=self._include_users,
            downloads=self._downloads_allowed(),
            history_points=self._history.points if self._history is not None else DEFAULT_POINTS)
        headers = [("Content-Type", _HTML), ("Cache-Control", "no-store"),
                   ("Content-Security-Policy", _PAGE_POLICY)]
        return "200 OK", headers, render_status_page(view)

    def _captures_json(self, environ: WSGIEnvironment) -> _Response:
        """GET /api/v1/captures[?limit=N][&include_refused=1]: the stored captures' records, newest
        first; with include_refused, the refused triggers too (at most N of them, newest first)."""
        query = parse_qs(environ.get("QUERY_STRING", ""))
        limit_text = query.get("limit", [str(DEFAULT_CAPTURE_LIST)])[-1]
        include_text = query.get("include_refused", ["0"])[-1]
        if include_text not in _FLAGS:
            allowed = ", ".join(sorted(_FLAGS))
            return _json("400 Bad Request", {"error": f"include_refused must be one of {allowed}, "
                                                      f"not {include_text[:20]!r}"})
        well_formed = limit_text.isascii() and limit_text.isdigit() and len(limit_text) <= 6
        limit = int(limit_text) if well_formed else 0
        if not 1 <= limit <= MAX_CAPTURE_LIST:
            return _json("400 Bad Request", {"error": f"limit must be a whole number from 1 to "
                                                      f"{MAX_CAPTURE_LIST}, not {limit_text[:20]!r}"})
        listed = []
        for record in [] if self._captures is None else self._captures.list()[:limit]:
            entry = record.to_json()
            if not self._include_processes:  # processes.export: false: no pid leaves the agent
                for key in ("pids", "targets", "target"):
                    entry.pop(key, None)
            entry["download"] = CAPTURE_DOWNLOAD_PREFIX + record.id
            listed.append(entry)
        document: dict[str, Any] = {
            "enabled": self._captures is not None,
            "downloads": self._captures is not None and self._downloads_allowed(), "captures": listed,
            "refused_count": 0 if self._refusals is None else self._refusals.total}
        if _FLAGS[include_text]:
            document["refused"] = [self._refusal_json(refused) for refused in
                                   ([] if self._refusals is None else self._refusals.recent(limit))]
        return "200 OK", [("Content-Type", _JSON)], _finite_json(document)

    def _refusal_json(self, refused: RefusedTrigger) -> dict[str, Any]:
        entry = refused.to_json()
        if not self._include_processes:  # processes.export: false: no pid leaves the agent
            entry.pop("pid", None)
        return entry

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
        if self._security is None:
            return False
        security = self._security()
        client_certificates = False
        if security.ssl_context is not None:
            import ssl  # loaded already: TLS is on

            client_certificates = security.ssl_context.verify_mode == ssl.CERT_REQUIRED
        return security.users.enabled or client_certificates

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
            body = json.dumps({"error": "no snapshot yet: the first sampling tick has not finished"})
            return "503 Service Unavailable", [("Content-Type", _JSON)], body.encode()
        document = snapshot.to_json()
        if not self._include_processes:  # processes.export: false
            for gpu in document["gpus"]:
                gpu["processes"] = []
        return "200 OK", [("Content-Type", _JSON)], json.dumps(document).encode()

    def _alerts_json(self, environ: WSGIEnvironment) -> _Response:
        alerts = [] if self._alerts is None else [alert.to_json() for alert in self._alerts.alerts()]
        document = {"enabled": self._alerts is not None, "alerts": alerts}
        return "200 OK", [("Content-Type", _JSON)], _finite_json(document)


def _text(status: str, line: str) -> _Response:
    return status, [("Content-Type", _TEXT)], (line + "\n").encode()


def _json(status: str, document: dict[str, Any]) -> _Response:
    return status, [("Content-Type", _JSON)], json.dumps(document).encode()


def _finite_json(document: dict[str, Any]) -> bytes:
    try:
        return json.dumps(document, allow_nan=False).encode()
    except ValueError:  # a NaN or infinite value (a rule's): JSON has no literal for it, null is honest
        return json.dumps(_finite(document), allow_nan=False).encode()


def _no_history(index: int, uuid: str) -> UtilizationSeries:
    return UtilizationSeries((), 0.0)


def _finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_finite(value) for value in obj]
    return obj
