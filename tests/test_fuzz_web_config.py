"""Property-based tests of the HTTP port's own inputs: the web configuration file
(gpuscope.web.web_config.load_web_config), basic-auth credentials (parse_basic_credentials) and the
Authorization header as the access layer meets it (AccessControl in front of AgentApp, driven with
environ dicts, no sockets).

Fuzzed: arbitrary bytes; documents built like exporter-toolkit's (TLS keys, users, headers, a rate
limit) with any value replaced by an arbitrary YAML value; arbitrary Authorization headers,
including well-formed basic credentials for the right and for unknown users.

Asserted: the loader returns a configuration or raises ConfigError naming the file, never another
exception; the credentials parser returns None or a (user, password) pair that re-encodes to the
header; the access layer answers 401 (with its challenge) or lets the request through, never 500, and
lets through exactly the right password of a configured user.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from snapshots import FakeSource, make_snapshot

from gpuscope.common.config_types import ConfigError
from gpuscope.web.access import AccessControl
from gpuscope.web.app import AgentApp
from gpuscope.web.basic_auth import parse_basic_credentials
from gpuscope.web.rejections import Rejections
from gpuscope.web.web_config import WebSecurity, load_web_config

FUZZ = settings(max_examples=150)  # and tests/conftest.py\'s profile

PASSWORD = "s3cret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()

YAML_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=10), kids, max_size=3),
    max_leaves=6)
BASE: dict[str, Any] = {
    "tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key", "min_version": "TLS12",
                          "client_auth_type": "NoClientCert", "cipher_suites": [], "curve_preferences": []},
    "http_server_config": {"http2": True, "headers": {"X-Frame-Options": "deny"}},
    "basic_auth_users": {"prometheus": HASH},
    "rate_limit": {"interval": "1s", "burst": 5},
}


@st.composite
def mutated_documents(draw: st.DrawFn) -> dict[str, Any]:
    """BASE with one leaf, section or key replaced, and some sections dropped."""
    document: dict[str, Any] = {key: dict(value) for key, value in BASE.items()
                                if draw(st.booleans())}
    if not document:
        return document
    section = draw(st.sampled_from(sorted(document)))
    key = draw(st.one_of(st.sampled_from(sorted(document[section]) or ["x"]), st.text(max_size=12)))
    document[section][key] = draw(YAML_VALUES)
    return document


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-web")


def load(folder: Path, data: bytes) -> WebSecurity | None:
    path = folder / "web.yml"
    path.write_bytes(data)
    try:
        return load_web_config(path)
    except ConfigError as err:
        assert err.source == str(path) and err.problems and all(err.problems), err
        return None


@FUZZ
@given(data=st.one_of(st.binary(max_size=200), mutated_documents().map(
    lambda d: yaml.safe_dump(d, allow_unicode=True).encode())))
@example(data=b"basic_auth_users: {a: b}\n")
@example(data=b"tls_server_config: {client_auth_type: x}\n")
@example(data=b"rate_limit: {interval: 1e400}\n")
@example(data=b"http_server_config: {headers: {X-Frame-Options: [deny]}}\n")
def test_the_loader_returns_a_configuration_or_a_config_error(folder: Path, data: bytes) -> None:
    security = load(folder, data)
    if security is not None:
        assert not security.tls  # no certificate exists in the folder: TLS can never load
        assert all("\n" not in value and "\r" not in value for _, value in security.headers)


@FUZZ
@given(header=st.one_of(st.text(max_size=40),
                        st.builds(lambda scheme, raw: f"{scheme} {base64.b64encode(raw).decode()}",
                                  st.sampled_from(["Basic", "basic", "BASIC", "Bearer"]),
                                  st.binary(max_size=30))))
@example(header="Basic Og==")  # ":" only
def test_credentials_are_a_pair_or_none(header: str) -> None:
    parsed = parse_basic_credentials(header)
    if parsed is not None:
        user, password = parsed
        assert ":" not in user
        encoded = base64.b64encode(f"{user}:{password}".encode()).decode()
        assert header.strip().partition(" ")[2].strip() == encoded


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AccessControl]:
    path = tmp_path_factory.mktemp("fuzz-access") / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {HASH}\n")
    security = load_web_config(path)
    app = AgentApp(CollectorRegistry(), FakeSource(make_snapshot(monotonic=time.monotonic())), time.monotonic)
    yield AccessControl(app, lambda: security, rejections=Rejections())


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@FUZZ
@given(authorization=st.one_of(
    st.none(), st.text(max_size=60),
    st.builds(basic, st.sampled_from(["prometheus", "grafana", "", "Prometheus"]),
              st.sampled_from([PASSWORD, PASSWORD + " ", "", "x" * 100]) | st.text(max_size=12))),
    path=st.sampled_from(["/metrics", "/", "/api/v1/snapshot", "/-/healthy", "/-/ready", "/nowhere"]))
@example(authorization=basic("prometheus", PASSWORD), path="/metrics")
def test_access_is_401_or_through_never_500(guarded: AccessControl, authorization: str | None,
                                            path: str) -> None:
    environ: dict[str, Any] = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": ""}
    if authorization is not None:
        environ["HTTP_AUTHORIZATION"] = authorization
    answer: list[Any] = []
    body = b"".join(guarded(environ, lambda status, headers, exc_info=None: answer.append((status, headers))))
    status, headers = answer[0]
    code = int(status.split()[0])
    assert code != 500, body
    right = parse_basic_credentials(authorization or "") == ("prometheus", PASSWORD)
    if path in ("/-/healthy", "/-/ready") or right:
        assert code != 401
    else:
        assert code == 401 and dict(headers)["WWW-Authenticate"] == 'Basic realm="gpuscope"'
