"""Who may use the HTTP port: the WSGI layer in front of ``app.AgentApp`` that applies the web
configuration's basic auth, extra headers and rate limit.

Every path needs the credentials except the probes, ``/-/healthy`` and ``/-/ready``: a kubelet's
HTTP probe sends no credentials, and they answer only "OK" or why not. The Alertmanager webhook has
credentials of its own (``capture.webhook``), checked by ``webhook_auth``: the users who may read
metrics are not thereby allowed to start profiler captures.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from gpuscope.web.basic_auth import parse_basic_credentials
from gpuscope.web.rejections import Rejections
from gpuscope.web.web_config import WebSecurity

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

OPEN_PATHS = frozenset({"/-/healthy", "/-/ready"})


class TokenBucket:
    """``burst`` requests at once, then one per ``interval`` (exporter-toolkit's rate_limit)."""

    def __init__(self, interval: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.burst = interval, burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.interval)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


class AccessControl:
    """WSGI middleware: ``security()`` is the web configuration in force for this request."""

    def __init__(self, app: WSGIApplication, security: Callable[[], WebSecurity], *,
                 rejections: Rejections, skip_auth: Callable[[str], bool] = lambda path: False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._app = app
        self._security = security
        self._rejections = rejections
        self._skip_auth = skip_auth
        self._clock = clock
        self._bucket: TokenBucket | None = None

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        security = self._security()
        path = environ.get("PATH_INFO") or "/"
        if security.rate_interval > 0 and not self._bucket_for(security).allow():
            self._rejections.count("rate_limited")
            return _refuse(environ, start_response, security, status="429 Too Many Requests",
                           line="too many requests (rate_limit in the web configuration)", extra=[])
        if security.users.enabled and path not in OPEN_PATHS and not self._skip_auth(path):
            credentials = parse_basic_credentials(environ.get("HTTP_AUTHORIZATION") or "")
            if credentials is None or not security.users.verify(*credentials):
                self._rejections.count("unauthorized")
                return _refuse(environ, start_response, security, status="401 Unauthorized",
                               line="unauthorized", extra=[("WWW-Authenticate", 'Basic realm="gpuscope"')])

        def with_headers(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, headers + list(security.headers), exc_info)

        return self._app(environ, with_headers)

    def _bucket_for(self, security: WebSecurity) -> TokenBucket:
        bucket = self._bucket
        if bucket is None or (bucket.interval, bucket.burst) != (security.rate_interval, security.rate_burst):
            bucket = self._bucket = TokenBucket(security.rate_interval, security.rate_burst, self._clock)
        return bucket


def _refuse(environ: WSGIEnvironment, start_response: StartResponse, security: WebSecurity, *,
            status: str, line: str, extra: list[tuple[str, str]]) -> list[bytes]:
    body = (line + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                            *extra, *security.headers])
    return [b"" if environ.get("REQUEST_METHOD") == "HEAD" else body]
