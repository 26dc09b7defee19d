"""Property-based tests of the agent's HTTP endpoints other than the webhook (GET /, /metrics, /-/healthy,
/-/ready, /api/v1/snapshot, /api/v1/alerts), driving the WSGI app (gpuscope.web.app.AgentApp) with
environ dicts, no sockets.

Fuzzed: the path, the method, the query string (``name[]`` filters among arbitrary parameters and
percent-escapes), the Accept header (near-misses of the text and OpenMetrics content types with their
version and escaping parameters) and Accept-Encoding, against a node whose snapshot uses every label,
with alerts whose values are NaN or infinite.

Asserted: never a 500; an unknown path is 404, a known one 405 with ``Allow`` for another method;
Content-Length is the body's (for HEAD, the GET body's, with no body); /metrics answers 200 in the
content type it announces, gzip when asked, and with ``name[]`` only lines of the unfiltered
exposition; the JSON endpoints answer JSON with no NaN in it.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_full_snapshot

from gpuscope.alerts.model import Alert, TransitionState
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.web.app import WEBHOOK_PATH, AgentApp

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile

ROUTES = ("/", "/metrics", "/-/healthy", "/-/ready", "/api/v1/snapshot", "/api/v1/alerts", "/api/v1/captures")
FAMILIES = ("gpu_utilization_ratio", "gpu_energy_joules", "gpu_energy_joules_total",
            "gpu_process_memory_used_bytes", "gpu_up", "gpu_info", "gpuscope_build_info",
            "gpu_clock_event_active")


class Alerts:
    """An AlertSource whose rule values JSON cannot write (NaN, infinities)."""

    def alerts(self) -> list[Alert]:
        return [Alert(name="GpuLowUtilization", gpu=0, uuid="GPU-0", severity="warning", state="firing",
                      hostname="node", active_since=1.0, firing_since=2.0,
                      values={"nan": math.nan, "inf": math.inf, "ok": 0.5}, summary="s", labels={"a": "b"})]

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        return {}


def make_app() -> AgentApp:
    """The snapshot's families rendered once per tick and format, as the agent serves them (an Accept
    header can name any number of formats: past a few per tick they are rendered per request)."""
    snapshot = make_full_snapshot()
    source = FakeSource(snapshot)
    return AgentApp(CollectorRegistry(), source, lambda: snapshot.monotonic + 0.5, alerts=Alerts(),
                    per_tick=SnapshotCollector(source, include_cmdline=True))


APP = make_app()


def call(environ: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer["status"], answer["headers"] = status, headers

    body = b"".join(APP(environ, start_response))
    names = [name for name, _ in answer["headers"]]
    assert len(names) == len(set(names)), answer["headers"]  # no header twice
    return int(answer["status"].split(" ", 1)[0]), dict(answer["headers"]), body


PATHS = st.one_of(st.sampled_from(ROUTES), st.sampled_from(ROUTES),
                  st.sampled_from(["/metrics/", "/METRICS", "//metrics", "/metrics?x", "", "/-/", "/api/v1/",
                                   "/api/v1/snapshot/..", "/%2e%2e/etc/passwd", "/\x00",
                                   "/api/v1/captures/", "/api/v1/captures/../../etc/passwd",
                                   "/api/v1/captures/0123456789abcdef"]),
                  st.text(st.characters(max_codepoint=255), max_size=30).map(lambda s: "/" + s))
METHODS = st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "get", "",
                           "G E T"])
QUERY_PARTS = st.one_of(
    st.sampled_from(FAMILIES).map(lambda n: f"name[]={n}"),
    st.text(max_size=12).map(lambda n: f"name[]={quote(n)}"),
    st.sampled_from(["limit=5", "limit=0", "limit=-1", "limit=99999999", "limit=%ff",
                     "name[]", "name[]=", "name%5B%5D=gpu_up", "name=gpu_up", "&&", "%", "%zz", "=", "a=b=c",
                     "name[]=%00", "name[]=%ff%fe", ";", "+"]),
    st.text(st.characters(max_codepoint=255), max_size=12),
)
QUERIES = st.lists(QUERY_PARTS, max_size=5).map("&".join)
ACCEPTS = st.one_of(
    st.none(),
    st.lists(st.sampled_from([
        "application/openmetrics-text", "application/openmetrics-text; version=1.0.0",
        "application/openmetrics-text; version=0.0.1", "application/openmetrics-text; version=2.0.0",
        "application/openmetrics-text;version=1.0.0;escaping=values",
        "application/openmetrics-text; escaping=dots", "application/openmetrics-text; escaping=bogus",
        "text/plain", "text/plain; version=0.0.4", "text/plain;version=1.0.0;escaping=underscores",
        "text/plain; version=x", "text/*", "*/*", "*/*;q=0.1", "application/json", ";", "version=", "",
        "application/openmetrics-text; version", "application/openmetrics-text; q=0.5; version=1.0.0",
    ]), max_size=3).map(", ".join),
    st.text(st.characters(max_codepoint=255), max_size=40),
)
ENCODINGS = st.one_of(st.none(),
                      st.sampled_from(["gzip", "GZIP", "gzip;q=0", "deflate, gzip", "br", "*", ""]),
                      st.text(st.characters(max_codepoint=255), max_size=12))


def environ_for(path: str, method: str, query: str, accept: str | None,
                encoding: str | None) -> dict[str, Any]:
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if encoding is not None:
        environ["HTTP_ACCEPT_ENCODING"] = encoding
    return environ


@FUZZ
@given(path=PATHS, method=METHODS, query=QUERIES, accept=ACCEPTS, encoding=ENCODINGS)
@example(path="/metrics", method="GET", query="name[]=gpu_up&name[]=%ff",
         accept="application/openmetrics-text; version=1.0.0; escaping=values", encoding="gzip")
@example(path="/api/v1/alerts", method="GET", query="", accept=None, encoding=None)
def test_no_request_is_answered_500(path: str, method: str, query: str, accept: str | None,
                                    encoding: str | None) -> None:
    if path == WEBHOOK_PATH:
        return  # tests/test_fuzz_webhook.py
    environ = environ_for(path, method, query, accept, encoding)
    code, headers, body = call(environ)
    event(f"{path if path in ROUTES else 'other'} {code}")
    assert code != 500
    route = path or "/"
    if route.startswith("/api/v1/captures/"):  # a download: a bad id, captures off, or not a GET
        assert code in (400, 404, 405), (code, body)
    elif route not in ROUTES:
        assert code == 404
    elif method not in ("GET", "HEAD"):
        assert code == 405 and headers["Allow"] == "GET, HEAD"
    elif route == "/api/v1/captures":  # ?limit= outside 1-1000 is refused with the reason
        assert code in (200, 400), (code, body)
    else:
        assert code in ((200, 503) if route == "/-/ready" else (200,)), (code, body)
    if method == "HEAD":
        assert body == b""
        _, get_headers, get_body = call({**environ, "REQUEST_METHOD": "GET"})
        assert headers == get_headers and headers["Content-Length"] == str(len(get_body))
        return
    assert headers["Content-Length"] == str(len(body))
    if code == 200 and route.startswith("/api/"):
        assert headers["Content-Type"] == "application/json"
        json.loads(body, parse_constant=_no_constant)


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} in a JSON reply")


@FUZZ
@given(query=QUERIES, accept=ACCEPTS, encoding=ENCODINGS)
def test_metrics_filter_keeps_only_lines_of_the_whole_exposition(query: str, accept: str | None,
                                                                   encoding: str | None) -> None:
    code, headers, body = call(environ_for("/metrics", "GET", query, accept, encoding))
    assert code == 200
    content_type = headers["Content-Type"]
    assert content_type.startswith(("text/plain", "application/openmetrics-text"))
    if headers.get("Content-Encoding") == "gzip":
        body = gzip.decompress(body)
    else:
        assert "Content-Encoding" not in headers
    text = body.decode("utf-8")
    if content_type.startswith("application/openmetrics-text"):
        assert text.endswith("# EOF\n")
    _, whole_headers, whole = call(environ_for("/metrics", "GET", "", accept, None))
    assert whole_headers["Content-Type"] == content_type
    assert set(text.splitlines()) <= set(whole.decode("utf-8").splitlines())


# prometheus_client's content negotiation compares a version's parts with numbers: one it cannot read
# (version=1.x) raised TypeError, a 500 on /metrics. Such a header gets what no Accept header gets.
@settings(FUZZ, max_examples=20)
@given(media=st.sampled_from(["text/plain", "application/openmetrics-text"]),
       version=st.text(st.sampled_from("0123456789.x:-"), min_size=1, max_size=8).filter(
           lambda v: any(not part.isdigit() for part in v.split("."))))
@example(media="text/plain", version="1.x")
def test_an_unreadable_version_is_no_500(media: str, version: str) -> None:
    code, headers, _ = call(environ_for("/metrics", "GET", "", f"{media}; version={version}", None))
    assert code == 200 and headers["Content-Type"].startswith(("text/plain", "application/openmetrics-text"))
