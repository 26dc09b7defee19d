"""The HTTP listener's limits, as a client that does not play by the rules meets them: oversized
headers, bad Content-Length values, deep JSON, a saturated server, and what the Server header says."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_snapshot

from gpuscope.capture.webhook import WebhookError, parse_webhook
from gpuscope.web.server import MAX_HEADER_BYTES, AgentHttpServer, somaxconn
from gpuscope.web.web_config import OPEN
from gpuscope.web.webhook_auth import WebhookAuth

PATH = "/api/v1/alertmanager"


class Webhook:
    """Records the bodies that reach the webhook handler."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def __call__(self, body: bytes) -> tuple[str, dict[str, Any]]:
        self.bodies.append(body)
        try:
            parse_webhook(body, hosts={"node-1"}, port=None)
        except WebhookError as err:
            return "400 Bad Request", {"error": str(err)}
        return "200 OK", {"accepted": 0}


TOKEN = "limits-test-token-0123456789"
AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[AgentHttpServer, Webhook]]:
    webhook = Webhook()
    source = FakeSource(make_snapshot(monotonic=time.monotonic()))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    auth = WebhookAuth(token_file=token_file, users=(), security=lambda: OPEN)
    agent = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=source, webhook=webhook,
                            webhook_auth=auth, max_requests=3)
    agent.start()
    try:
        yield agent, webhook
    finally:
        agent.stop()


def exchange(server: AgentHttpServer, request: bytes, timeout: float = 10.0) -> bytes:
    """Send ``request`` (from a thread: the server may stop reading it) and return the response."""
    with socket.create_connection(server.bound_address, timeout=timeout) as client:
        def send() -> None:
            with contextlib.suppress(OSError):  # the server may answer and close before reading it all
                client.sendall(request)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        response = b""
        while chunk := client.recv(65536):
            response += chunk
        sender.join(timeout)
        return response


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_headers_over_one_mib_get_431_without_being_read(server: tuple[AgentHttpServer, Webhook]) -> None:
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 60_000) for i in range(95))  # 5.7 MB
    response = exchange(server[0], b"GET /metrics HTTP/1.1\r\nHost: node\r\n" + headers + b"\r\n")
    assert status(response) == 431
    small = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"a" * 60_000) for i in range(10))  # 0.6 MB: fine
    assert status(exchange(server[0], b"GET /-/healthy HTTP/1.1\r\nHost: node\r\n" + small + b"\r\n")) == 200
    assert MAX_HEADER_BYTES == 1 << 20


@pytest.mark.parametrize(("length", "expected"), [
    (b"-1", 400), (b"+5", 400), (b"abc", 400), (b"99999999999999999999", 400), (b"1048577", 413),
])
def test_a_bad_content_length_is_refused_before_reading(server: tuple[AgentHttpServer, Webhook],
                                                         length: bytes, expected: int) -> None:
    request = (b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
               + AUTH + b"Content-Length: " + length + b"\r\n\r\n" + b"x" * 100_000)
    assert status(exchange(server[0], request)) == expected
    assert server[1].bodies == []


def test_a_chunked_body_needs_a_length(server: tuple[AgentHttpServer, Webhook]) -> None:
    request = (b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
               + AUTH + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert status(exchange(server[0], request)) == 411


def test_deep_json_is_a_400_with_the_reason(server: tuple[AgentHttpServer, Webhook]) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    request = (b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
               + AUTH + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    response = exchange(server[0], request)
    assert status(response) == 400
    assert b"nested 100000 levels deep; at most 32" in response


def test_a_saturated_server_answers_503_at_once_and_recovers(server: tuple[AgentHttpServer, Webhook]) -> None:
    agent = server[0]
    holders = []
    for _ in range(3):  # web.max_requests: 3, each held by a client that never finishes its request
        holder = socket.create_connection(agent.bound_address, timeout=10)
        holder.sendall(b"GET /metrics HTTP/1.1\r\n")
        holders.append(holder)
    time.sleep(0.2)  # accepted, each on its thread
    started = time.monotonic()
    response = exchange(agent, b"GET /-/healthy HTTP/1.0\r\n\r\n")
    assert status(response) == 503 and b"web.max_requests" in response
    assert time.monotonic() - started < 5.0  # not after the 10 s request timeout
    for holder in holders:
        holder.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if status(exchange(agent, b"GET /metrics HTTP/1.0\r\n\r\n")) == 200:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("slots were not given back")


def test_the_server_header_names_no_python_version(server: tuple[AgentHttpServer, Webhook]) -> None:
    requests = (b"GET /metrics HTTP/1.0\r\n\r\n", b"GET /nowhere HTTP/1.0\r\n\r\n",
                b"BREW /pot HTTP/1.0\r\n\r\n")
    for request in requests:
        response = exchange(server[0], request)
        headers = response.split(b"\r\n\r\n", 1)[0].decode().lower()
        assert "server: gpuscope\r\n" in headers + "\r\n" and "python" not in headers, headers


def test_the_listen_backlog_is_the_kernels_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    backlogs: list[int] = []

    class Recording(socket.socket):
        def listen(self, backlog: int = 0) -> None:
            backlogs.append(backlog)
            super().listen(backlog)

    monkeypatch.setattr(socket, "socket", Recording)
    http = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=FakeSource(None))
    http.start()
    http.stop()
    assert backlogs == [somaxconn()] and somaxconn() >= 128


@pytest.mark.parametrize(("request_bytes", "expected"), [
    (b"GET /-/healthy\r\n\r\n", 400),  # HTTP/0.9: not served
    (b"GET /-/healthy HTTP/1.1 extra\r\n\r\n", 400),
    (b"GET /-/healthy HTTPS/1.1\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/1\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/x.y\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/2.0\r\n\r\n", 505),
    (b"GET /-/healthy HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/1.1\r\n: no name\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/1.1\r\nBad Name: x\r\n\r\n", 400),
    (b"GET /-/healthy HTTP/1.1\r\nHost: a\r\n folded: continuation\r\n\r\n", 400),
    (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"GET /-/healthy HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"GET /-/healthy HTTP/1.1\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    (b"GET /-/healthy HTTP/1.0\r\n\r\n", 200),
    (b"GET /-/healthy HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(100)) + b"\r\n", 200),
    (b"GET /%2D/healthy?x=%20 HTTP/1.1\r\nHost: a\r\n\r\n", 200),  # the path is unquoted
])
def test_requests_are_read_within_http_s_rules(server: tuple[AgentHttpServer, Webhook], request_bytes: bytes,
                                               expected: int) -> None:
    response = exchange(server[0], request_bytes)
    assert status(response) == expected, response[:300]
    head = response.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    assert head.startswith("HTTP/1.0 ") and "\r\nServer: gpuscope" in head and "\r\nDate: " in head
    assert status(exchange(server[0], b"GET /-/healthy HTTP/1.1\r\nHost: node\r\n\r\n")) == 200


def test_a_client_that_expects_100_continue_is_told_to_send_its_body(
        server: tuple[AgentHttpServer, Webhook]) -> None:
    body = b'{"version": "4", "alerts": []}'
    with socket.create_connection(server[0].bound_address, timeout=10) as client:
        client.sendall(b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: node\r\n" + AUTH
                       + b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
                       + b"Content-Length: %d\r\n\r\n" % len(body))
        assert client.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.sendall(body)
        response = b""
        while chunk := client.recv(65536):
            response += chunk
    assert status(response) == 200 and server[1].bodies == [body]


def test_a_header_with_an_underscore_cannot_pass_for_one_with_a_dash(
        server: tuple[AgentHttpServer, Webhook]) -> None:
    # Authorization spelled with an underscore is left out (as wsgiref leaves it out): no token, 401.
    body = b'{"version": "4", "alerts": []}'
    request = (b"POST " + PATH.encode() + b" HTTP/1.1\r\nHost: node\r\nContent-Type: application/json\r\n"
               + b"Content-Length: %d\r\nAuthorization_: Bearer " % len(body) + TOKEN.encode()
               + b"\r\n\r\n" + body)
    assert status(exchange(server[0], request)) == 401
    assert server[1].bodies == []
