"""Property-based tests of Alertmanager's webhook: the payload parser
(gpuscope.capture.webhook.parse_webhook) and ``POST /api/v1/alertmanager`` of the WSGI app, driven with
environ dicts (no sockets).

Fuzzed: Alertmanager v4 payloads built as Alertmanager sends them (firing and resolved alerts, common
labels, instance labels naming this node or others, with or without a port, IPv6 in brackets), then
with any node of the JSON replaced by an arbitrary JSON value, byte-level edits, or arbitrary bytes;
over HTTP also the method, the Authorization, Content-Type, Content-Length and Transfer-Encoding headers.

Asserted: the parser returns exactly the triggers the payload asks of this node, or raises WebhookError
with a message; the app never answers 500, answers 200 only to an authorized, well-formed POST (and
then queues exactly the parser's triggers), reads no body before the request passed every check, and
its JSON replies say what is wrong.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_snapshot

from gpuscope.capture.service import CaptureRequest
from gpuscope.capture.webhook import MAX_ALERTS, WebhookError, WebhookReceiver, WebhookTrigger, parse_webhook
from gpuscope.web.app import WEBHOOK_MAX_BYTES, WEBHOOK_PATH, AgentApp
from gpuscope.web.web_config import OPEN
from gpuscope.web.webhook_auth import WebhookAuth

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile

HOSTS = frozenset({"gpu-node-07", "10.0.0.7", "fd00::7", "localhost"})
PORT = 9847
TOKEN = "webhook-token-0123456789abcdef"

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=8)


# -- payloads as Alertmanager sends them -----------------------------------------------------------------


@st.composite
def instances(draw: st.DrawFn) -> tuple[str, bool]:
    """(an instance label, whether it names this agent)."""
    ours = draw(st.booleans())
    host = draw(st.sampled_from(sorted(HOSTS)) if ours else
                st.sampled_from(["gpu-node-08", "10.0.0.8", "fd00::8", "", "gpu-node-07.example"]))
    host = draw(st.sampled_from([host, host.upper()]))
    port = draw(st.sampled_from([None, PORT, PORT + 1]))
    ours = ours and port in (None, PORT)
    if ":" in host:
        return (f"[{host}]" if port is None else f"[{host}]:{port}"), ours and bool(host)
    return (host if port is None else f"{host}:{port}"), ours and bool(host)


# GPU labels: an index, none, or something that is not an index.
GPU_LABELS = st.one_of(st.none(), st.just(""), st.integers(0, 9999).map(str),
                       st.sampled_from(["-1", "12345", "1.0", "gpu0", " 1", "0x1"]))


@st.composite
def alerts(draw: st.DrawFn) -> tuple[dict[str, Any], WebhookTrigger | None]:
    """(an alert, the trigger it asks of this node or None)."""
    instance, ours = draw(instances())
    status = draw(st.sampled_from(["firing", "resolved"]))
    labels: dict[str, str] = {"instance": instance}
    name = draw(st.one_of(st.none(), st.sampled_from(["GpuLowUtilization", "GpuXidError"]),
                          st.text(max_size=10)))
    if name is not None:
        labels["alertname"] = name
    gpu = draw(GPU_LABELS)
    if gpu is not None:
        labels["gpu"] = gpu
    uuid = draw(st.one_of(st.none(), st.just(""), st.just("GPU-5a1c7d3e")))
    if uuid is not None:
        labels["uuid"] = uuid
    alert = {"status": status, "labels": labels, "annotations": {"summary": "s"},
             "startsAt": "2024-05-31T16:08:37Z", "endsAt": "0001-01-01T00:00:00Z",
             "generatorURL": "http://prometheus/graph", "fingerprint": "c0ffee"}
    if not (ours and status == "firing") or (gpu in (None, "") and not uuid):
        return alert, None
    if not (gpu in (None, "") or (gpu.isascii() and gpu.isdigit() and len(gpu) <= 4)):
        return alert, None  # refused: the whole payload is
    return alert, WebhookTrigger("unnamed" if name is None else name, int(gpu) if gpu else None, uuid or None)


@st.composite
def payloads(draw: st.DrawFn) -> tuple[dict[str, Any], list[WebhookTrigger] | None]:
    """(a v4 payload, the triggers it asks of this node, or None when the parser must refuse it)."""
    drawn = draw(st.lists(alerts(), max_size=5))
    payload = {"version": "4", "groupKey": "{}:{alertname=\"x\"}", "truncatedAlerts": 0,
               "status": "firing", "receiver": "gpuscope", "groupLabels": {}, "commonLabels": {},
               "commonAnnotations": {}, "externalURL": "http://alertmanager:9093",
               "alerts": [alert for alert, _ in drawn]}
    refused = any(a["status"] == "firing" and trigger is None and _names_us_with_bad_gpu(a)
                  for a, trigger in drawn)
    return payload, None if refused else [t for _, t in drawn if t is not None]


def _names_us_with_bad_gpu(alert: dict[str, Any]) -> bool:
    labels = alert["labels"]
    gpu = labels.get("gpu")
    bad = gpu not in (None, "") and not (gpu.isascii() and gpu.isdigit() and len(gpu) <= 4)
    instance = labels["instance"]
    if instance.startswith("["):
        host, _, port = instance[1:].partition("]")
    else:
        host, _, port = instance.partition(":")
    return bad and host.lower() in HOSTS and port.removeprefix(":") in ("", str(PORT))


def replaced(node: Any, path: list[Any], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(node, list):
        return [replaced(child, rest, value) if i == head else child for i, child in enumerate(node)]
    return {**node, head: replaced(node[head], rest, value)}


def node_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[list[Any]]:
    out: list[list[Any]] = [list(prefix)]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in items:
        out += node_paths(child, (*prefix, key))
    return out


@st.composite
def mutated_bodies(draw: st.DrawFn) -> bytes:
    payload, _ = draw(payloads())
    path = draw(st.sampled_from(node_paths(payload)))
    body = json.dumps(replaced(payload, path, draw(JSON_VALUES))).encode()
    for position, removed, inserted in draw(st.lists(st.tuples(
            st.integers(0, 4000), st.integers(0, 4), st.binary(max_size=3) | st.sampled_from(
                [b"[", b"{", b'"', b"\\", b",", b"NaN", b"1e999", b"\xff"])), max_size=2)):
        at = position % (len(body) + 1)
        body = body[:at] + inserted + body[at + removed:]
    return body


BODIES = st.one_of(
    payloads().map(lambda p: json.dumps(p[0]).encode()), mutated_bodies(), st.binary(max_size=200),
    st.sampled_from([b"[" * 10_000, b'{"version": "4", "alerts": ' + b"[" * 40 + b"]" * 40 + b"}",
                     json.dumps({"version": "4", "alerts": [{}] * (MAX_ALERTS + 1)}).encode()]))


def parse(body: bytes) -> list[WebhookTrigger]:
    return parse_webhook(body, hosts=HOSTS, port=PORT)


# -- the parser ------------------------------------------------------------------------------------------


@FUZZ
@given(case=payloads())
def test_a_payload_asks_exactly_its_triggers_of_this_node(
        case: tuple[dict[str, Any], list[WebhookTrigger] | None]) -> None:
    payload, expected = case
    body = json.dumps(payload).encode()
    if expected is None:
        with pytest.raises(WebhookError, match=r"alerts\[\d+\]\.labels\.gpu must be a GPU index"):
            parse(body)
    else:
        assert parse(body) == expected


@FUZZ
@given(body=BODIES)
@example(body=b'{"version": "4", "alerts": [], "commonLabels": {"gpu": 1}}')
@example(body=b'{"version": 4, "alerts": []}')
def test_any_body_gives_triggers_or_a_webhook_error(body: bytes) -> None:
    try:
        triggers = parse(body)
    except WebhookError as err:
        assert str(err)
        return
    assert all(isinstance(t, WebhookTrigger) and (t.gpu is None or 0 <= t.gpu <= 9999)
               and (t.gpu is not None or t.uuid) for t in triggers)


NON_ASCII_DIGITS = st.text(st.characters(whitelist_categories=("Nd", "No")).filter(
    lambda c: c.isdigit() and not c.isascii()), min_size=1, max_size=3)
# str.isdigit() is also true of '\u00b2' or '\u0663', which int() refuses or reads as another digit: such a
# gpu label was a ValueError (a 500 over HTTP); it is a WebhookError (400).


def _other_digits_body(gpu: str) -> bytes:
    return json.dumps({"version": "4", "alerts": [
        {"status": "firing", "labels": {"instance": "gpu-node-07", "gpu": gpu}}]}).encode()


@settings(FUZZ, max_examples=20)
@given(gpu=NON_ASCII_DIGITS)
@example(gpu="\u00b2")  # superscript two
def test_a_gpu_label_of_other_digits_is_a_webhook_error(gpu: str) -> None:
    with pytest.raises(WebhookError, match="must be a GPU index"):
        parse(_other_digits_body(gpu))


# -- POST /api/v1/alertmanager ---------------------------------------------------------------------------


class CountingInput(io.BytesIO):
    """wsgi.input that records whether anything was read."""

    reads = 0

    def read(self, size: int | None = -1) -> bytes:
        self.reads += 1
        return super().read(size)


def make_app(token_file: Path) -> tuple[AgentApp, list[CaptureRequest]]:
    submitted: list[CaptureRequest] = []
    receiver = WebhookReceiver(submitted.append, hosts=HOSTS, port=PORT)
    auth = WebhookAuth(token_file=token_file, users=(), security=lambda: OPEN)
    source = FakeSource(make_snapshot())
    app = AgentApp(CollectorRegistry(), source, lambda: 1000.0, webhook=receiver, webhook_auth=auth)
    return app, submitted


@pytest.fixture(scope="module")
def token_file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gs-fuzz-") as directory:
        path = Path(directory) / "token"
        path.write_text(TOKEN + "\n")
        os.chmod(path, 0o600)
        yield path


def call(app: AgentApp, environ: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        answer["status"], answer["headers"] = status, dict(headers)

    body = b"".join(app(environ, start_response))
    code = int(answer["status"].split(" ", 1)[0])
    if environ.get("REQUEST_METHOD") == "HEAD":  # the length of what GET would send, without it
        assert body == b"" and answer["headers"]["Content-Length"].isdigit()
    else:
        assert answer["headers"]["Content-Length"] == str(len(body))
    return code, answer["headers"], body


# Header values as a WSGI server hands them over: latin-1 text.
LATIN1 = st.characters(max_codepoint=255)
AUTHORIZATIONS = st.one_of(
    st.just(f"Bearer {TOKEN}"), st.just(f"bearer   {TOKEN}  "), st.none(),
    st.sampled_from(["Bearer", "Bearer ", f"Bearer {TOKEN}x", f"Basic {TOKEN}", "Basic", "Basic dXNlcjpwYXNz",
                     f"Token {TOKEN}", "\x00", f"Bearer\t{TOKEN}"]),
    st.text(LATIN1, max_size=30))
CONTENT_TYPES = st.one_of(
    st.sampled_from(["application/json", "application/json; charset=utf-8", "Application/JSON", "text/plain",
                     "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]),
    st.none(), st.text(LATIN1, max_size=20))
LENGTH_TEXTS = st.one_of(st.none(), st.sampled_from(["", "-1", "+5", "1e3", " 5", "\xb2", "9" * 16,
                                                     str(WEBHOOK_MAX_BYTES + 1), "00", "0"]),
                         st.text(LATIN1, max_size=6))


@FUZZ
@given(body=BODIES,
       method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "HEAD", "DELETE", "post", "X"]),
       authorization=AUTHORIZATIONS, content_type=CONTENT_TYPES,
       length=st.one_of(st.just("exact"), LENGTH_TEXTS), chunked=st.booleans())
@example(body=b'{"version": "4", "alerts": []}', method="POST", authorization=f"Bearer {TOKEN}",
         content_type="application/json", length="exact", chunked=False)
def test_the_webhook_never_answers_500(token_file: Path, *, body: bytes, method: str,
                                       authorization: str | None, content_type: str | None,
                                       length: str | None, chunked: bool) -> None:
    app, submitted = make_app(token_file)
    stream = CountingInput(body)
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": WEBHOOK_PATH, "wsgi.input": stream}
    if authorization is not None:
        environ["HTTP_AUTHORIZATION"] = authorization
    if content_type is not None:
        environ["CONTENT_TYPE"] = content_type
    if length is not None:
        environ["CONTENT_LENGTH"] = str(len(body)) if length == "exact" else length
    if chunked:
        environ["HTTP_TRANSFER_ENCODING"] = "chunked"
    code, headers, reply = call(app, environ)
    assert code in (200, 400, 401, 405, 411, 413, 415), (code, reply)
    if method == "HEAD":
        assert reply == b""
    elif code != 405:
        assert headers["Content-Type"] == "application/json"
        document = json.loads(reply)
        assert document.get("error") if code != 200 else isinstance(document.get("accepted"), int)
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    authorized = scheme.lower() == "bearer" and credentials.strip() == TOKEN
    # What only an authorized, well-formed POST gets: its body read, parsed, and its captures queued.
    if code == 401:
        assert not authorized and "WWW-Authenticate" in headers
    if code in (200, 400) and stream.reads:
        length_text = environ["CONTENT_LENGTH"]
        assert method == "POST" and authorized and not chunked
        assert length_text.isascii() and length_text.isdigit()
        assert (content_type or "").partition(";")[0].strip().lower() == "application/json"
        try:
            triggers = parse(body[:int(length_text)])
        except WebhookError as err:
            assert code == 400 and json.loads(reply) == {"error": str(err)}
        else:
            assert code == 200 and [(r.gpu, r.uuid, r.trigger.alertname) for r in submitted] == [
                (t.gpu, t.uuid, t.alertname) for t in triggers]
    else:
        assert stream.reads == 0 and submitted == [], code


@settings(FUZZ, max_examples=10)
@given(gpu=NON_ASCII_DIGITS)
@example(gpu="\u00b2")
def test_the_webhook_answers_other_digits_without_a_500(token_file: Path, gpu: str) -> None:
    app, _ = make_app(token_file)
    body = _other_digits_body(gpu)
    code, _, _ = call(app, {"REQUEST_METHOD": "POST", "PATH_INFO": WEBHOOK_PATH,
                            "wsgi.input": io.BytesIO(body), "HTTP_AUTHORIZATION": f"Bearer {TOKEN}",
                            "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body))})
    assert code == 400
