"""The web configuration file (``web.config_file``, ``--web.config.file``): TLS, basic auth, extra
response headers and a rate limit for the HTTP port, in the YAML schema of Prometheus's
exporter-toolkit, so a file written for node_exporter works here:

```yaml
tls_server_config:
  cert_file: tls.crt                 # relative paths are relative to this file's directory
  key_file: tls.key
  client_auth_type: RequireAndVerifyClientCert   # or VerifyClientCertIfGiven; default NoClientCert
  client_ca_file: ca.crt
  client_allowed_sans: [prometheus.monitoring.svc]
  min_version: TLS12
http_server_config:
  headers: {X-Content-Type-Options: nosniff, X-Frame-Options: deny}
basic_auth_users:
  prometheus: $2y$10$...             # bcrypt
rate_limit: {interval: 100ms, burst: 20}
```

The file and the files it names are checked for changes on new connections (at most once a
second): new certificates, users or headers apply without a restart. A change that cannot be used
is logged and the previous configuration stays in force (``gpuscope_web_config_last_reload_successful``
turns 0); turning TLS on or off needs a restart.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import yaml
from pydantic import Field, SecretStr, ValidationError, field_validator

from gpuscope.common.config_types import ConfigError, Duration, Section, format_errors
from gpuscope.common.unixfs import FileTooLargeError, read_bounded
from gpuscope.web.basic_auth import BasicAuthConfigError, BasicAuthVerifier, check_bcrypt_hash

if TYPE_CHECKING:  # ssl (with OpenSSL, 5 MiB) is loaded only when TLS is configured
    import ssl

log = logging.getLogger(__name__)

MAX_WEB_CONFIG_BYTES = 1 << 20
RELOAD_CHECK_SECONDS = 1.0
HIGH_BCRYPT_COST = 14  # above it, the first check of each password takes a second or more
# The headers an operator may add, with the values each allows (None: any single-line value).
EXTRA_HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

Pem = Annotated[SecretStr, Field(min_length=1)]


class TlsServerConfig(Section):
    cert: str | None = Field(None, min_length=1, description="Server certificate chain, inline PEM.")
    key: Pem | None = Field(None, description="Its private key, inline PEM.")
    client_ca: str | None = Field(None, min_length=1, description="Client CA bundle, inline PEM.")
    cert_file: Path | None = Field(None, description="Server certificate chain (PEM).")
    key_file: Path | None = Field(None, description="Its private key (PEM).")
    client_auth_type: str = Field("NoClientCert", description="NoClientCert, VerifyClientCertIfGiven or "
                                                              "RequireAndVerifyClientCert.")
    client_ca_file: Path | None = Field(None, description="CA bundle that client certificates chain to.")
    client_allowed_sans: list[str] | None = Field(None, description="A client certificate must name one.")
    min_version: str = Field("TLS12", description="TLS10, TLS11, TLS12 or TLS13.")
    max_version: str = Field("TLS13", description="TLS10, TLS11, TLS12 or TLS13.")
    cipher_suites: list[str] = Field(default_factory=list, description="Go's names; TLS 1.2 and older.")
    prefer_server_cipher_suites: bool = True
    curve_preferences: list[str] = Field(default_factory=list, description="One curve: CurveP256, ...")

    @property
    def enabled(self) -> bool:
        """Whether TLS is asked for: any key or certificate setting given (exporter-toolkit's rule)."""
        return any(value is not None for value in (self.cert, self.key, self.client_ca, self.cert_file,
                                                   self.key_file, self.client_ca_file)) or (
            "client_auth_type" in self.model_fields_set)


class HttpServerConfig(Section):
    http2: bool = Field(True, description="Accepted for compatibility; the agent serves HTTP/1.1.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra response headers.")

    @field_validator("headers")
    @classmethod
    def _known_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if name not in EXTRA_HEADERS:
                raise ValueError(f"HTTP header {name!r} cannot be configured; the headers are "
                                 f"{', '.join(EXTRA_HEADERS)}")
            allowed = EXTRA_HEADERS[name]
            if allowed is not None and value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
                raise ValueError(f"{name}: a header value must be one line of printable characters")
        return headers


class RateLimitConfig(Section):
    interval: Duration = Field(0.0, ge=0.0, description="Time between two requests; 0 turns it off.")
    burst: int = Field(0, ge=0, le=1_000_000, description="Requests allowed at once.")


class WebConfigFile(Section):
    tls_server_config: TlsServerConfig = TlsServerConfig()
    http_server_config: HttpServerConfig = HttpServerConfig()
    basic_auth_users: dict[str, SecretStr] = Field(default_factory=dict,
                                                   description="User name -> bcrypt hash of the password.")
    rate_limit: RateLimitConfig = RateLimitConfig()


@dataclass(frozen=True)
class WebSecurity:
    """What the HTTP port enforces, from one reading of the web configuration file."""

    source: str = ""
    ssl_context: ssl.SSLContext | None = None
    allowed_sans: frozenset[str] | None = None
    users: BasicAuthVerifier = field(default_factory=lambda: BasicAuthVerifier({}))
    headers: tuple[tuple[str, str], ...] = ()
    rate_interval: float = 0.0
    rate_burst: int = 0
    watched: tuple[Path, ...] = ()

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    @property
    def authenticates_every_client(self) -> bool:
        """Basic auth users, or required client certificates: what capture downloads over HTTP need."""
        client_certificates = False
        if self.ssl_context is not None:
            import ssl  # loaded already: TLS is on

            client_certificates = self.ssl_context.verify_mode == ssl.CERT_REQUIRED
        return self.users.enabled or client_certificates


OPEN = WebSecurity()  # no web configuration file: plain HTTP, no authentication


def load_web_config(path: Path) -> WebSecurity:
    """Read and check ``path``; ConfigError (source: the file) lists every problem."""
    try:
        text = read_bounded(path, MAX_WEB_CONFIG_BYTES, follow_symlinks=True).decode("utf-8")
        raw = yaml.safe_load(text)
    except FileTooLargeError:
        raise ConfigError(str(path), [f"the web configuration file is larger than {MAX_WEB_CONFIG_BYTES} "
                                      "bytes"]) from None
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read the web configuration file: {err.strerror or err}"]
                          ) from None
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), [f"not UTF-8 text: byte {err.object[err.start]:#04x} at offset "
                                      f"{err.start} cannot be decoded"]) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML: {getattr(err, 'problem', err)}"]) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [f"the top level must be a mapping of keys, not {type(raw).__name__}"])
    try:
        parsed = WebConfigFile.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(str(path), format_errors(err, model=WebConfigFile)) from None
    return _security(path, parsed)


def _security(path: Path, parsed: WebConfigFile) -> WebSecurity:
    problems: list[str] = []
    base = path.parent
    tls = parsed.tls_server_config
    context = None
    watched = [path]
    if tls.enabled:
        from gpuscope.web.tls_context import TlsConfigError, build_server_context

        files = {name: _resolve(base, getattr(tls, name)) for name in ("cert_file", "key_file",
                                                                         "client_ca_file")}
        watched += [p for p in files.values() if p is not None]
        try:
            context = build_server_context(
                cert_file=files["cert_file"], key_file=files["key_file"], cert=tls.cert,
                key=tls.key.get_secret_value() if tls.key is not None else None,
                client_ca_file=files["client_ca_file"], client_ca=tls.client_ca,
                client_auth_type=tls.client_auth_type, min_version=tls.min_version,
                max_version=tls.max_version, cipher_suites=tls.cipher_suites,
                curve_preferences=tls.curve_preferences,
                prefer_server_cipher_suites=tls.prefer_server_cipher_suites)
        except TlsConfigError as err:
            problems.append(f"tls_server_config: {err}")
        if tls.client_allowed_sans is not None and tls.client_auth_type != "RequireAndVerifyClientCert":
            problems.append("tls_server_config.client_allowed_sans: needs client_auth_type "
                            "RequireAndVerifyClientCert (otherwise a client may send no certificate)")
    elif tls.client_allowed_sans is not None:
        problems.append("tls_server_config.client_allowed_sans: set without TLS (no cert_file)")
    users: dict[str, str] = {}
    for user, secret in parsed.basic_auth_users.items():
        hashed = secret.get_secret_value()
        try:
            cost = check_bcrypt_hash(user, hashed)
        except BasicAuthConfigError as err:
            problems.append(str(err))
            continue
        if ":" in user or not user:
            problems.append(f"basic_auth_users: {user!r} cannot be a user name (empty, or holds ':')")
            continue
        if cost > HIGH_BCRYPT_COST:
            log.warning("basic_auth_users.%s: bcrypt cost %d makes each new password check take seconds; "
                        "10 is usual", user, cost)
        users[user] = hashed
    if problems:
        raise ConfigError(str(path), problems)
    rate = parsed.rate_limit
    return WebSecurity(
        source=str(path), ssl_context=context,
        allowed_sans=frozenset(tls.client_allowed_sans) if tls.client_allowed_sans is not None else None,
        users=BasicAuthVerifier(users), headers=tuple(parsed.http_server_config.headers.items()),
        rate_interval=rate.interval, rate_burst=rate.burst, watched=tuple(watched))


def _resolve(base: Path, path: Path | None) -> Path | None:
    return None if path is None else base / path


def _fingerprint(paths: tuple[Path, ...]) -> tuple[Any, ...]:
    """What changes when a file is replaced or rewritten (a Kubernetes Secret swaps a symlink)."""
    out: list[Any] = []
    for path in paths:
        try:
            info = os.stat(path)
            out.append((info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns))
        except OSError as err:
            out.append(err.errno)
    return tuple(out)


class WebConfigWatcher:
    """The web configuration in force, re-read when its file or a file it names changes."""

    def __init__(self, path: Path | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._security = OPEN if path is None else load_web_config(path)  # ConfigError at start
        self._fingerprint = _fingerprint(self._security.watched)
        self._checked_at = clock()
        self.last_reload_successful = True
        self.reloads_failed = 0

    def current(self) -> WebSecurity:
        """The configuration to apply to a new connection (a cheap call: stat()s once a second)."""
        if self.path is None or self._clock() - self._checked_at < RELOAD_CHECK_SECONDS:
            return self._security
        with self._lock:
            if self._clock() - self._checked_at >= RELOAD_CHECK_SECONDS:
                self._checked_at = self._clock()
                fingerprint = _fingerprint(self._security.watched)
                if fingerprint != self._fingerprint:
                    self._fingerprint = fingerprint
                    self._reload(self.path)
            return self._security

    def _reload(self, path: Path) -> None:
        try:
            security = load_web_config(path)
        except ConfigError as err:
            self._failed(f"the web configuration {path} changed but cannot be used; the previous one "
                         f"stays in force: {'; '.join(err.problems)}")
            return
        if security.tls != self._security.tls:
            self._failed(f"the web configuration {path} turns TLS {'on' if security.tls else 'off'}: restart "
                         "the agent for that; the previous configuration stays in force")
            return
        # Files named by the new configuration are watched from now on.
        self._fingerprint = _fingerprint(security.watched)
        self._security = security
        self.last_reload_successful = True
        log.info("web configuration %s reloaded", path)

    def _failed(self, message: str) -> None:
        self.last_reload_successful = False
        self.reloads_failed += 1
        log.error("%s", message)
