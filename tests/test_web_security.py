"""The HTTP port with a web configuration file, as clients meet it on loopback: TLS (and client
certificates, with Python's ssl and with curl), basic auth on every endpoint but the probes, extra
headers, the rate limit, certificate renewal without a restart, and the webhook's own credentials."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from pki import Pki, make_pki
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_snapshot

from gpuscope.web.self_metrics import WebCollector
from gpuscope.web.server import AgentHttpServer
from gpuscope.web.web_config import WebConfigWatcher
from gpuscope.web.webhook_auth import WebhookAuth

PASSWORD = "correct horse battery staple"
WEBHOOK_TOKEN = "webhook-token-0123456789abcdef"
WEBHOOK = "/api/v1/alertmanager"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), client_dns_names=("prometheus.monitoring",))


def user_hash(password: str) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()


class Webhook:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def __call__(self, body: bytes) -> tuple[str, dict[str, Any]]:
        self.bodies.append(body)
        return "200 OK", {"accepted": 0}


@contextmanager
def serving(tmp_path: Path, web_yml: str, *, webhook_users: tuple[str, ...] = (),
            webhook_token: bool = False, max_requests: int = 64) -> Iterator[tuple[AgentHttpServer, Webhook]]:
    config = tmp_path / "web.yml"
    config.write_text(web_yml)
    watcher = WebConfigWatcher(config)
    webhook = Webhook()
    auth = None
    if webhook_users or webhook_token:
        token_file = None
        if webhook_token:
            token_file = tmp_path / "webhook-token"
            token_file.write_text(WEBHOOK_TOKEN)
            token_file.chmod(0o600)
        auth = WebhookAuth(token_file=token_file, users=webhook_users, security=watcher.current)
    registry = CollectorRegistry()
    source = FakeSource(make_snapshot(monotonic=time.monotonic()))
    server = AgentHttpServer("127.0.0.1:0", registry=registry, source=source,
                             webhook=webhook if auth else None, webhook_auth=auth, web_config=watcher,
                             max_requests=max_requests)
    registry.register(WebCollector(server.rejections, watcher))
    server.start()
    try:
        yield server, webhook
    finally:
        server.stop()


def client_context(pki: Pki, *, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


def request(server: AgentHttpServer, path: str, *, context: ssl.SSLContext | None = None,
            user: tuple[str, str] | None = None, method: str = "GET", body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = server.bound_address
    connection: http.client.HTTPConnection
    if context is not None:
        connection = http.client.HTTPSConnection("localhost", port, context=context, timeout=10)
    else:
        connection = http.client.HTTPConnection(host, port, timeout=10)
    all_headers = dict(headers or {})
    if user is not None:
        all_headers["Authorization"] = "Basic " + base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
    try:
        connection.request(method, path, body=body, headers=all_headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def tls_yml(pki: Pki, extra: str = "") -> str:
    return f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n{extra}"


def rejected(server: AgentHttpServer, reason: str) -> int:
    return server.rejections.counts()[reason]


def test_tls_with_basic_auth_protects_all_but_the_probes(tmp_path: Path, pki: Pki) -> None:
    yml = tls_yml(pki, f"basic_auth_users:\n  prometheus: {user_hash(PASSWORD)}\n"
                       "http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
    with serving(tmp_path, yml) as (server, _):
        context = client_context(pki)
        status, headers, body = request(server, "/metrics", context=context, user=("prometheus", PASSWORD))
        assert status == 200 and b"gpuscope_http_rejected_requests_total" in body
        assert headers["x-content-type-options"] == "nosniff"
        for path in ("/metrics", "/", "/api/v1/snapshot", "/api/v1/alerts", "/nowhere", WEBHOOK):
            for user in (None, ("prometheus", "wrong"), ("grafana", PASSWORD)):
                status, headers, body = request(server, path, context=context, user=user)
                assert status == 401, (path, user, status)
                assert headers["www-authenticate"] == 'Basic realm="gpuscope"'
                assert headers["x-content-type-options"] == "nosniff" and b"gpuscope" not in body
        assert rejected(server, "unauthorized") == 18
        for path in ("/-/healthy", "/-/ready"):  # a kubelet's probe sends no credentials
            assert request(server, path, context=context)[0] == 200
        status, _, body = request(server, "/metrics", context=context, user=("prometheus", PASSWORD))
        assert b'gpuscope_http_rejected_requests_total{reason="unauthorized"} 18.0' in body


def test_plain_http_to_a_tls_port_gets_no_answer(tmp_path: Path, pki: Pki) -> None:
    with serving(tmp_path, tls_yml(pki)) as (server, _):
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            request(server, "/metrics")
        deadline = time.monotonic() + 5
        while rejected(server, "tls_handshake") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rejected(server, "tls_handshake") == 1
        assert request(server, "/metrics", context=client_context(pki))[0] == 200  # still serving


def test_client_certificates_are_required_and_verified(tmp_path: Path, pki: Pki) -> None:
    other = make_pki(tmp_path / "other-ca", client_dns_names=("prometheus.monitoring",))
    yml = tls_yml(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n")
    with serving(tmp_path, yml) as (server, _):
        good = client_context(pki, cert=(pki.client_cert, pki.client_key))
        assert request(server, "/metrics", context=good)[0] == 200
        for context in (client_context(pki), client_context(pki, cert=(other.client_cert, other.client_key))):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                request(server, "/metrics", context=context)
        assert request(server, "/-/healthy", context=good)[0] == 200


def test_curl_with_a_client_certificate(tmp_path: Path, pki: Pki) -> None:
    curl = shutil.which("curl")
    if curl is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed; scripts/test.sh installs it")
        pytest.skip("curl is not installed")
    yml = tls_yml(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
                       "  client_allowed_sans: [prometheus.monitoring]\n")
    with serving(tmp_path, yml) as (server, _):
        url = f"https://localhost:{server.bound_address[1]}/metrics"
        ok = subprocess.run([curl, "-sS", "--fail", "--cacert", str(pki.ca), "--cert", str(pki.client_cert),
                             "--key", str(pki.client_key), url], capture_output=True, timeout=30, check=False)
        assert ok.returncode == 0 and b"gpuscope_http_rejected_requests_total" in ok.stdout, ok.stderr
        refused = subprocess.run([curl, "-sS", "--fail", "--cacert", str(pki.ca), url], capture_output=True,
                                 timeout=30, check=False)
        assert refused.returncode != 0 and b"gpuscope_http_rejected_requests_total" not in refused.stdout


def test_a_certificate_without_an_allowed_san_is_refused(tmp_path: Path, pki: Pki) -> None:
    yml = tls_yml(pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca}\n"
                       "  client_allowed_sans: [grafana.monitoring]\n")
    with serving(tmp_path, yml) as (server, _):
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            request(server, "/metrics", context=client_context(pki, cert=(pki.client_cert, pki.client_key)))
        assert rejected(server, "tls_handshake") == 1


def test_the_rate_limit_answers_429(tmp_path: Path) -> None:
    with serving(tmp_path, "rate_limit:\n  interval: 1h\n  burst: 3\n") as (server, _):
        statuses = [request(server, "/-/healthy")[0] for _ in range(5)]
        assert statuses == [200, 200, 200, 429, 429]
        assert rejected(server, "rate_limited") == 2


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path, pki: Pki) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    with serving(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n") as (server, _):
        assert request(server, "/-/healthy", context=client_context(pki))[0] == 200
        renewed = make_pki(tmp_path / "renewed")
        shutil.copy(renewed.server_key, key)
        shutil.copy(renewed.server_cert, cert)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert request(server, "/-/healthy", context=client_context(renewed))[0] == 200
                break
            except ssl.SSLError:
                assert time.monotonic() < deadline, "the renewed certificate was not loaded"
                time.sleep(0.2)
        with pytest.raises(ssl.SSLError):
            request(server, "/-/healthy", context=client_context(pki))


def test_a_saturated_tls_server_closes_new_connections(tmp_path: Path, pki: Pki) -> None:
    with serving(tmp_path, tls_yml(pki), max_requests=1) as (server, _):
        holder = socket.create_connection(server.bound_address, timeout=10)  # no handshake: holds the slot
        try:
            time.sleep(0.2)
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
                request(server, "/-/healthy", context=client_context(pki))
            assert rejected(server, "busy") >= 1
        finally:
            holder.close()


def post_webhook(server: AgentHttpServer, *, user: tuple[str, str] | None = None, token: str | None = None,
                 content_type: str = "application/json",
                 context: ssl.SSLContext | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, _, body = request(server, WEBHOOK, method="POST", body=b'{"version": "4", "alerts": []}',
                              headers=headers, user=user, context=context)
    return status, json.loads(body) if body.startswith(b"{") else body


def test_the_webhook_is_off_unless_configured(tmp_path: Path) -> None:
    with serving(tmp_path, "") as (server, webhook):
        status, reply = post_webhook(server)
        assert status == 404 and "capture.webhook.enabled" in reply["error"] and webhook.bodies == []


def test_the_webhook_demands_its_token_and_json(tmp_path: Path) -> None:
    with serving(tmp_path, "", webhook_token=True) as (server, webhook):
        for token in (None, "wrong-token-0123456789", WEBHOOK_TOKEN + "x", WEBHOOK_TOKEN[:-1]):
            status, _ = post_webhook(server, token=token)
            assert status == 401
        status, headers, _ = request(server, WEBHOOK, method="POST", body=b"{}",
                                     headers={"Content-Type": "application/json"})
        assert headers["www-authenticate"] == "Bearer"
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            status, reply = post_webhook(server, token=WEBHOOK_TOKEN, content_type=content_type)
            assert status == 415 and content_type in reply["error"]  # what a cross-site form can send
        assert webhook.bodies == [] and rejected(server, "unauthorized") == 5
        charset = "application/json; charset=utf-8"
        assert post_webhook(server, token=WEBHOOK_TOKEN, content_type=charset)[0] == 200
        assert len(webhook.bodies) == 1


def test_the_webhook_takes_its_own_users_not_every_scraper(tmp_path: Path, pki: Pki) -> None:
    yml = tls_yml(pki, f"basic_auth_users:\n  prometheus: {user_hash(PASSWORD)}\n"
                       f"  alertmanager: {user_hash('am-password')}\n")
    with serving(tmp_path, yml, webhook_users=("alertmanager",)) as (server, webhook):
        context = client_context(pki)
        assert post_webhook(server, user=("prometheus", PASSWORD), context=context)[0] == 401
        assert post_webhook(server, user=("alertmanager", "nope"), context=context)[0] == 401
        assert webhook.bodies == []
        assert post_webhook(server, user=("alertmanager", "am-password"), context=context)[0] == 200
        assert request(server, "/metrics", context=context, user=("alertmanager", "am-password"))[0] == 200
