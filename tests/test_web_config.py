"""The web configuration file (exporter-toolkit's format): what it accepts, what it refuses and how
it says so, and how a change on disk is picked up or, when it cannot be used, left out."""

from __future__ import annotations

import ssl
from pathlib import Path

import bcrypt
import pytest
from pki import Pki, make_pki

from gpuscope.common.config_types import ConfigError
from gpuscope.web.basic_auth import BasicAuthVerifier, parse_basic_credentials
from gpuscope.web.tls_context import peer_sans
from gpuscope.web.web_config import WebConfigWatcher, load_web_config


def hashed(password: str, cost: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(folder: Path, text: str) -> Path:
    path = folder / "web.yml"
    path.write_text(text)
    return path


def tls_block(pki: Pki, extra: str = "") -> str:
    return (f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
            + "".join(f"  {line}\n" for line in extra.splitlines()))


def problems(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_web_config(path)
    assert caught.value.source == str(path)
    return "\n".join(caught.value.problems)


def test_an_empty_file_asks_for_nothing(tmp_path: Path) -> None:
    security = load_web_config(write(tmp_path, ""))
    assert not security.tls and not security.users.enabled and security.headers == ()


def test_tls_with_relative_paths_from_the_files_directory(tmp_path: Path, pki: Pki) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    for source in (pki.server_cert, pki.server_key):
        (folder / source.name).write_bytes(source.read_bytes())
    security = load_web_config(write(folder, "tls_server_config:\n  cert_file: server.crt\n"
                                             "  key_file: server.key\n"))
    assert security.ssl_context is not None
    assert security.ssl_context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert security.ssl_context.verify_mode == ssl.CERT_NONE
    assert folder / "server.crt" in security.watched


def test_inline_pem_never_touches_the_disk(tmp_path: Path, pki: Pki) -> None:
    cert = pki.server_cert.read_text().replace("\n", "\n    ")
    key = pki.server_key.read_text().replace("\n", "\n    ")
    text = f"tls_server_config:\n  cert: |\n    {cert}\n  key: |\n    {key}\n"
    security = load_web_config(write(tmp_path, text))
    assert security.tls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["web.yml"]


@pytest.mark.parametrize(("extra", "reason"), [
    ("client_auth_type: RequireAnyClientCert", "accepts client certificates without verifying them"),
    ("client_auth_type: RequestClientCert", "accepts client certificates without verifying them"),
    ("client_auth_type: Sometimes", "client_auth_type: unknown value 'Sometimes'"),
    ("client_auth_type: VerifyClientCertIfGiven", "needs client_ca_file"),
    ("client_ca_file: {ca}", "client CAs are configured without a client_auth_type"),
    ("min_version: TLS14", "min_version: unknown TLS version 'TLS14'"),
    ("min_version: TLS13\nmax_version: TLS12", "min_version TLS13 is newer than max_version TLS12"),
    ("cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]", "unknown or insecure suite 'TLS_RSA_WITH_RC4_128_SHA'"),
    ("curve_preferences: [CurveP256, X25519]", "name one curve"),
    ("curve_preferences: [Curve25519]", "unknown curve 'Curve25519'"),
    ("client_allowed_sans: [prometheus]",
     "client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert"),
    ("session_tickets: true", "tls_server_config.session_tickets: unknown key"),
])
def test_tls_settings_that_cannot_be_served_are_refused_by_name(tmp_path: Path, pki: Pki, extra: str,
                                                                 reason: str) -> None:
    assert reason in problems(write(tmp_path, tls_block(pki, extra.format(ca=pki.ca))))


def test_a_key_that_is_not_the_certificates_is_refused(tmp_path: Path, pki: Pki) -> None:
    other = make_pki(tmp_path / "other")
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {pki.server_cert}\n"
                           f"  key_file: {other.server_key}\n")
    assert "cannot be loaded as a pair" in problems(path)


def test_a_missing_certificate_file_is_named(tmp_path: Path, pki: Pki) -> None:
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {tmp_path}/nope.crt\n"
                           f"  key_file: {pki.server_key}\n")
    assert f"cannot read {tmp_path}/nope.crt: No such file or directory" in problems(path)


def test_the_supported_tls_settings_apply(tmp_path: Path, pki: Pki) -> None:
    extra = (f"client_auth_type: RequireAndVerifyClientCert\nclient_ca_file: {pki.ca}\nmin_version: TLS13\n"
             "cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]\n"
             "curve_preferences: [CurveP384]\nclient_allowed_sans: [prometheus]")
    security = load_web_config(write(tmp_path, tls_block(pki, extra)))
    context = security.ssl_context
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert context.minimum_version == ssl.TLSVersion.TLSv1_3
    tls12 = {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 == {"ECDHE-ECDSA-AES128-GCM-SHA256"}
    assert security.allowed_sans == frozenset({"prometheus"})


@pytest.mark.parametrize(("text", "reason"), [
    ("http_server_config:\n  headers:\n    X-Powered-By: me\n",
     "HTTP header 'X-Powered-By' cannot be configured"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
     "X-Frame-Options must be one of deny, sameorigin"),
    ("http_server_config:\n  headers:\n    Content-Security-Policy: \"a\\r\\nSet-Cookie: x\"\n", "one line"),
    ("basic_auth_users:\n  prometheus: hunter2\n", "basic_auth_users.prometheus: not a bcrypt hash"),
    ("basic_auth_users:\n  prometheus: $2y$10$" + "a" * 53 + "\n", "salt is not valid"),
    ("rate_limit:\n  interval: fast\n", "rate_limit.interval"),
    ("tls_server_confg: {}\n", "tls_server_confg: unknown key"),
    ("- a list\n", "the top level must be a mapping of keys, not list"),
    ("a: [\n", "not valid YAML"),
])
def test_other_settings_that_cannot_be_used_are_refused_by_name(tmp_path: Path, text: str,
                                                                reason: str) -> None:
    assert reason in problems(write(tmp_path, text))


def test_a_file_that_is_not_utf8_or_too_large_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_bytes(b"basic_auth_users:\n  \xff: x\n")
    assert "not UTF-8 text: byte 0xff at offset 20" in problems(path)
    path.write_bytes(b"#" * (2 << 20))
    assert "larger than 1048576 bytes" in problems(path)
    assert "cannot read the web configuration file: No such file" in problems(tmp_path / "absent.yml")


def test_headers_users_and_rate_limit_are_read(tmp_path: Path) -> None:
    text = ("http_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n"
            "    X-Content-Type-Options: nosniff\n"
            f"basic_auth_users:\n  prometheus: {hashed('s3cret')}\n"
            "rate_limit:\n  interval: 100ms\n  burst: 5\n")
    security = load_web_config(write(tmp_path, text))
    assert security.headers == (("X-Frame-Options", "deny"), ("X-Content-Type-Options", "nosniff"))
    assert security.users.verify("prometheus", "s3cret")
    assert not security.users.verify("prometheus", "S3cret")
    assert not security.users.verify("grafana", "s3cret")
    assert (security.rate_interval, security.rate_burst) == (0.1, 5)


def test_verification_outcomes_are_cached_and_bounded() -> None:
    verifier = BasicAuthVerifier({"u": hashed("p")})
    calls = []
    original = verifier._bcrypt_matches

    def counting(password: bytes, hashed_password: bytes | None) -> bool:
        calls.append(password)
        return original(password, hashed_password)

    verifier._bcrypt_matches = counting  # type: ignore[method-assign]
    assert [verifier.verify("u", "p") for _ in range(5)] == [True] * 5
    assert [verifier.verify("u", "wrong") for _ in range(5)] == [False] * 5
    assert len(calls) == 2  # one bcrypt check per distinct (user, password)
    for i in range(300):
        verifier.verify("u", f"guess-{i}")
    assert len(verifier._cache) == 256
    assert not verifier.verify("u", "x" * 73)  # beyond bcrypt's 72 bytes: refused, not truncated


@pytest.mark.parametrize(("header", "expected"), [
    ("Basic dTpw", ("u", "p")), ("basic  dTpwOnE= ", ("u", "p:q")), ("Basic dQ==", None), ("Basic !!", None),
    ("Bearer dTpw", None), ("", None), ("Basic //79", None),
])
def test_basic_credentials_are_parsed_strictly(header: str, expected: tuple[str, str] | None) -> None:
    assert parse_basic_credentials(header) == expected


def test_peer_sans_are_written_as_go_writes_them() -> None:
    cert = {"subjectAltName": (("DNS", "prometheus"), ("IP Address", "2001:DB8:0:0:0:0:0:1\n"),
                               ("email", "a@b"), ("URI", "spiffe://x"), ("othername", "<unsupported>"))}
    assert peer_sans(cert) == ["prometheus", "2001:db8::1", "a@b", "spiffe://x"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_change_applies_and_a_broken_change_keeps_the_previous(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  a: {hashed('one')}\n")
    clock = Clock()
    watcher = WebConfigWatcher(path, clock=clock)
    first = watcher.current()
    assert first.users.users() == {"a"}
    write(tmp_path, f"basic_auth_users:\n  b: {hashed('two')}\n")
    clock.now = 0.5
    assert watcher.current() is first  # checked at most once a second
    clock.now = 1.5
    assert watcher.current().users.users() == {"b"} and watcher.last_reload_successful
    write(tmp_path, "basic_auth_users:\n  c: plain\n")
    clock.now = 3.0
    assert watcher.current().users.users() == {"b"}
    assert not watcher.last_reload_successful
    assert "changed but cannot be used; the previous one stays in force" in caplog.text
    write(tmp_path, f"basic_auth_users:\n  c: {hashed('three')}\n")
    clock.now = 4.5
    assert watcher.current().users.users() == {"c"} and watcher.last_reload_successful


def test_tls_cannot_be_turned_off_by_a_reload(tmp_path: Path, pki: Pki,
                                              caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, tls_block(pki))
    clock = Clock()
    watcher = WebConfigWatcher(path, clock=clock)
    write(tmp_path, "# TLS removed\n")
    clock.now = 2.0
    assert watcher.current().tls and not watcher.last_reload_successful
    assert "turns TLS off: restart the agent" in caplog.text


def test_a_renewed_certificate_is_loaded(tmp_path: Path, pki: Pki) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    clock = Clock()
    path = write(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    watcher = WebConfigWatcher(path, clock=clock)
    before = watcher.current()
    renewed = make_pki(tmp_path / "renewed")
    cert.write_bytes(renewed.server_cert.read_bytes())  # the key not yet: a pair that does not match
    clock.now = 2.0
    assert watcher.current() is before and not watcher.last_reload_successful
    key.write_bytes(renewed.server_key.read_bytes())
    clock.now = 4.0
    after = watcher.current()
    assert after is not before and watcher.last_reload_successful
