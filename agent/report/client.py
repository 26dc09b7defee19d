"""A small client for the Prometheus HTTP query API (Prometheus, Thanos, Mimir): instant queries only.

Standard library only. Every response is bounded before it is read; every failure becomes a
`PrometheusError` whose message names the server and what went wrong.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ssl and urllib.request (5 MiB with OpenSSL) load when a report runs
    import ssl

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_ERROR_BODY_BYTES = 4096  # what an error body may add to a message


class PrometheusError(Exception):
    """The query could not be answered; the message says why, in one line."""


@dataclass(frozen=True)
class Auth:
    """At most one of basic auth (user and password) and a bearer token."""

    user: str | None = None
    password: str | None = None
    bearer_token: str | None = None

    def header(self) -> str | None:
        if self.bearer_token is not None:
            return f"Bearer {self.bearer_token}"
        if self.user is not None:
            pair = f"{self.user}:{self.password or ''}".encode()
            return "Basic " + base64.b64encode(pair).decode()
        return None


def tls_context(ca_file: str | None, insecure_skip_verify: bool) -> ssl.SSLContext:
    """Verify against the system's CAs, or ``ca_file``'s; verify nothing with ``insecure_skip_verify``."""
    import ssl

    context = ssl.create_default_context(cafile=ca_file)
    if insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class PrometheusClient:
    def __init__(self, url: str, *, auth: Auth = Auth(), context: ssl.SSLContext | None = None,
                 timeout: float = 120.0, max_bytes: int = MAX_RESPONSE_BYTES) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise PrometheusError(f"{url!r} is not an http:// or https:// URL")
        if parsed.query or parsed.fragment:
            raise PrometheusError(f"{url!r}: give the server's base URL, without a query or fragment")
        self.url = url.rstrip("/")
        self._auth = auth
        self._context = context if parsed.scheme == "https" else None
        self._timeout = timeout
        self._max_bytes = max_bytes

    def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to at Unix time ``at``: a list of {metric, value}."""
        data = self._post("/api/v1/query", {"query": promql, "time": f"{at:.3f}"})
        if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
            raise PrometheusError(f"{self.url}: expected an instant vector, got {data.get('resultType')!r}")
        result: list[dict[str, Any]] = data["result"]
        return result

    def _post(self, path: str, form: dict[str, str]) -> dict[str, Any]:
        body = urllib.parse.urlencode(form).encode()
        headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
                   "User-Agent": "gpuscope-report"}
        authorization = self._auth.header()
        if authorization is not None:
            headers["Authorization"] = authorization
        import ssl
        from urllib.request import Request, urlopen

        request = Request(self.url + path, data=body, headers=headers, method="POST")
        try:
            with urlopen(request, timeout=self._timeout, context=self._context) as response:
                raw = self._read(response)
        except urllib.error.HTTPError as err:
            raise self._http_error(err) from None
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, ssl.SSLError):
                raise PrometheusError(f"cannot reach {self.url}: TLS: {reason.reason or reason} "
                                      f"(--tls-ca names the CA to trust)") from None
            raise PrometheusError(f"cannot reach {self.url}: {_strerror(reason)}") from None
        except TimeoutError:
            raise PrometheusError(f"{self.url} did not answer within {self._timeout:g} s "
                                  f"(--timeout)") from None
        except OSError as err:
            raise PrometheusError(f"cannot reach {self.url}: {_strerror(err)}") from None
        return self._decode(raw)

    def _read(self, response: Any) -> bytes:
        length = response.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self._max_bytes:
            raise PrometheusError(f"{self.url}: the answer ({length} bytes) is larger than the "
                                  f"{self._max_bytes} bytes allowed; report a shorter range or a "
                                  f"coarser --by")
        raw: bytes = response.read(self._max_bytes + 1)
        if len(raw) > self._max_bytes:
            raise PrometheusError(f"{self.url}: the answer is larger than the {self._max_bytes} bytes "
                                  f"allowed; report a shorter range or a coarser --by")
        return raw

    def _decode(self, raw: bytes) -> dict[str, Any]:
        try:
            document = json.loads(raw)
        except ValueError:
            raise PrometheusError(f"{self.url} did not answer with Prometheus API JSON "
                                  f"(is this the server's base URL?)") from None
        if not isinstance(document, dict) or document.get("status") != "success":
            error = document.get("error") if isinstance(document, dict) else None
            raise PrometheusError(f"{self.url}: the query failed: {error or 'no reason given'}")
        data = document.get("data")
        if not isinstance(data, dict):
            raise PrometheusError(f"{self.url}: the answer has no data")
        return data

    def _http_error(self, err: urllib.error.HTTPError) -> PrometheusError:
        try:
            text = err.read(_ERROR_BODY_BYTES).decode("utf-8", "replace")
        except OSError:
            text = ""
        if err.code in (401, 403):
            given = ("the credentials given were refused" if self._auth.header()
                     else "no credentials were given")
            return PrometheusError(f"{self.url} answered HTTP {err.code}: {given} (--basic-auth-user with "
                                   f"--basic-auth-password-file, or --bearer-token-file)")
        if err.code == 404:
            return PrometheusError(f"{self.url} has no {err.url.removeprefix(self.url)} (HTTP 404): give the "
                                   f"base URL under which /api/v1/query answers")
        try:
            detail = json.loads(text).get("error") or text
        except (ValueError, AttributeError):
            detail = text
        detail = " ".join(str(detail).split())[:500] or err.reason
        if err.code in (400, 422):
            return PrometheusError(f"{self.url} rejected the query (HTTP {err.code}): {detail}")
        return PrometheusError(f"{self.url} answered HTTP {err.code}: {detail}")


def _strerror(reason: object) -> str:
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason)
