"""Where and how to push: the ``otlp`` section together with the standard ``OTEL_EXPORTER_OTLP_*``
variables, resolved once at start into an ExportTarget.

Precedence, per setting, highest first: the ``otlp`` section's key where it is set (in the file, a
``GPUSCOPE_OTLP__*`` variable or a flag), then the metrics-specific variable
(``OTEL_EXPORTER_OTLP_METRICS_TIMEOUT``), then the general one (``OTEL_EXPORTER_OTLP_TIMEOUT``), then
the default. Headers merge by name in the same order: a header the section names replaces the one
of the same name from a variable. Every problem names its key or variable, and never shows a
header's value.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from gpuscope.common.addresses import split_http_url
from gpuscope.common.config_types import ConfigError
from gpuscope.common.unixfs import read_bounded
from gpuscope.otlp.config import OtlpConfig

ENVIRONMENT = "OTEL_EXPORTER_OTLP_* environment variables"
CONFIGURATION = "the otlp section"
METRICS_PATH = "/v1/metrics"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
MAX_HEADER_FILE_BYTES = 64 * 1024
_PROTOCOLS = ("http/protobuf", "grpc")
_COMPRESSIONS = ("none", "gzip")
_T = TypeVar("_T")


@dataclass(frozen=True)
class ExportTarget:
    """One resolved receiver. ``url``: for http/protobuf the URL pushed to; for grpc
    ``http(s)://host:port``. ``headers`` are credentials: kept out of ``repr``."""

    url: str
    protocol: str
    timeout_seconds: float
    compression: str
    headers: tuple[tuple[str, str], ...] = field(repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @property
    def secure(self) -> bool:
        return self.url.startswith("https://")

    @property
    def header_names(self) -> tuple[str, ...]:
        """The names alone: what a log line or a status document may show."""
        return tuple(name for name, _ in self.headers)


def resolve_target(config: OtlpConfig, environ: Mapping[str, str] | None = None, *,
                   read_file: Callable[[Path], bytes] | None = None) -> ExportTarget:
    """The ExportTarget of ``config`` and ``environ`` (default: the process's environment); ConfigError
    naming the key or variable of the first problems found."""
    env = os.environ if environ is None else environ
    read = read_file or (lambda path: read_bounded(path, MAX_HEADER_FILE_BYTES, follow_symlinks=True))
    resolver = _Resolver(config, env)
    protocol = resolver.pick("protocol", "PROTOCOL", _parse_protocol)
    timeout = resolver.pick("timeout", "TIMEOUT", _parse_timeout_ms)
    compression = resolver.pick("compression", "COMPRESSION", _parse_compression)
    url = resolver.endpoint(protocol)
    tls = config.tls
    ca_file = resolver.path("tls", "ca_file", tls.ca_file, "CERTIFICATE")
    cert_file = resolver.path("tls", "cert_file", tls.cert_file, "CLIENT_CERTIFICATE")
    key_file = resolver.path("tls", "key_file", tls.key_file, "CLIENT_KEY")
    if (cert_file is None) != (key_file is None):
        resolver.env_problems.append(
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE: needs OTEL_EXPORTER_OTLP_CLIENT_KEY "
            "(or otlp.tls.key_file) with it, and the other way round")
    headers = resolver.headers(read)
    resolver.raise_problems()
    if url.startswith("http://") and (ca_file or cert_file):
        raise ConfigError(CONFIGURATION, [
            f"otlp.tls: the endpoint {url} is plain http; use https:// for TLS"])
    return ExportTarget(url=url, protocol=protocol, timeout_seconds=timeout, compression=compression,
                        headers=headers, ca_file=ca_file, cert_file=cert_file, key_file=key_file)


class _Resolver:
    def __init__(self, config: OtlpConfig, environ: Mapping[str, str]) -> None:
        self._config = config
        self._env = environ
        self._set = config.model_fields_set
        self.env_problems: list[str] = []
        self.config_problems: list[str] = []

    def variable(self, suffix: str) -> tuple[str, str] | None:
        """(name, value) of the metrics-specific variable, else of the general one, if set non-empty."""
        for name in (f"OTEL_EXPORTER_OTLP_METRICS_{suffix}", f"OTEL_EXPORTER_OTLP_{suffix}"):
            value = self._env.get(name, "").strip()
            if value:
                return name, value
        return None

    def pick(self, key: str, suffix: str, parse: Callable[[str], _T]) -> _T:
        configured: _T = getattr(self._config, key)
        if key in self._set:
            return configured
        found = self.variable(suffix)
        if found is None:
            return configured  # the section's default
        name, value = found
        try:
            return parse(value)
        except ValueError as err:
            self.env_problems.append(f"{name}: {err}")
            return configured

    def endpoint(self, protocol: str) -> str:
        grpc = protocol == "grpc"
        if "endpoint" in self._set and self._config.endpoint is not None:
            where, raw, as_base = "otlp.endpoint", self._config.endpoint, False
        else:
            specific = self._env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip()
            general = self._env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            if specific:
                where, raw, as_base = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", specific, False
            elif general:
                where, raw, as_base = "OTEL_EXPORTER_OTLP_ENDPOINT", general, True
            else:
                return DEFAULT_GRPC_ENDPOINT if grpc else DEFAULT_HTTP_ENDPOINT + METRICS_PATH
        try:
            return endpoint_url(raw, grpc=grpc, as_base=as_base)
        except ValueError as err:
            problems = self.config_problems if where.startswith("otlp.") else self.env_problems
            problems.append(f"{where}: {err}")
            return raw

    def path(self, section: str, key: str, configured: Path | None, suffix: str) -> Path | None:
        if key in getattr(self._config, section).model_fields_set and configured is not None:
            return configured
        found = self.variable(suffix)
        return Path(found[1]) if found else configured

    def headers(self, read: Callable[[Path], bytes]) -> tuple[tuple[str, str], ...]:
        merged: dict[str, tuple[str, str]] = {}  # lower-case name -> (name as written, value)
        for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS"):  # specific wins
            text = self._env.get(name, "").strip()
            if text:
                try:
                    for key, value in parse_headers(text):
                        merged[key.lower()] = (key, value)
                except ValueError as err:
                    self.env_problems.append(f"{name}: {err}")
        for key, source in self._config.headers.items():
            where = f"otlp.headers.{key}"
            try:
                if source.file is not None:
                    where += ".file"
                    value = _header_text(read(source.file).decode("utf-8").strip())
                else:
                    where += ".env"
                    value = _header_text(self._env.get(source.env or "", "").strip(),
                                         empty=f"the variable {source.env} is not set or empty")
            except OSError as err:
                self.config_problems.append(f"{where}: cannot read {source.file}: {err.strerror or err}")
                continue
            except UnicodeDecodeError:
                self.config_problems.append(f"{where}: {source.file} is not UTF-8 text")
                continue
            except ValueError as err:
                self.config_problems.append(f"{where}: {err}")
                continue
            merged[key.lower()] = (key, value)
        return tuple(merged.values())

    def raise_problems(self) -> None:
        if self.config_problems:
            raise ConfigError(CONFIGURATION, self.config_problems + self.env_problems)
        if self.env_problems:
            raise ConfigError(ENVIRONMENT, self.env_problems)


def endpoint_url(raw: str, *, grpc: bool, as_base: bool) -> str:
    """The URL pushed to, from an endpoint as written. HTTP: ``as_base`` (OTEL_EXPORTER_OTLP_ENDPOINT)
    appends /v1/metrics to the path; otherwise a URL without a path gets /v1/metrics and one with a
    path is used as it is. gRPC: scheme, host and port only. ValueError with a hint when unusable."""
    example = "e.g. http://otel-collector:4317" if grpc else "e.g. http://otel-collector:4318"
    checked = split_http_url(raw, example, credentials="use otlp.headers")
    parts, netloc = checked.parts, checked.netloc
    if any(ord(c) < 0x21 for c in parts.path):
        raise ValueError("the path must not hold spaces or control characters")
    if grpc:
        return f"{parts.scheme}://{netloc}"
    path = parts.path
    if as_base:
        path = path.rstrip("/") + METRICS_PATH
    elif path in ("", "/"):
        path = METRICS_PATH
    return urllib.parse.urlunsplit((parts.scheme, netloc, path, "", ""))


def parse_headers(text: str) -> list[tuple[str, str]]:
    """``OTEL_EXPORTER_OTLP_HEADERS``: comma-separated ``key=value`` pairs, values percent-decoded. The
    error names the entry's position, never its text (it may hold a credential)."""
    pairs = []
    for position, entry in enumerate(text.split(","), 1):
        if not entry.strip():
            continue
        key, sep, value = entry.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"entry {position} is not key=value")
        if any(c in key for c in " \t\r\n:"):
            raise ValueError(f"entry {position}: not a header name")
        pairs.append((key, _header_text(urllib.parse.unquote(value.strip()),
                                        empty=f"entry {position} has an empty value")))
    return pairs


def _parse_protocol(value: str) -> str:
    if value not in _PROTOCOLS:
        hint = " (http/json is not supported)" if value == "http/json" else ""
        raise ValueError(f"expected one of {', '.join(_PROTOCOLS)}, got {value!r}{hint}")
    return value


def _parse_timeout_ms(value: str) -> float:
    try:
        milliseconds = float(value)
    except ValueError:
        raise ValueError(f"expected milliseconds, got {value!r}") from None
    if not 0 < milliseconds <= 60_000:
        raise ValueError(f"expected milliseconds above 0 and at most 60000, got {value!r}")
    return milliseconds / 1000.0


def _parse_compression(value: str) -> str:
    if value not in _COMPRESSIONS:
        raise ValueError(f"expected one of {', '.join(_COMPRESSIONS)}, got {value!r}")
    return value


def _header_text(value: str, *, empty: str = "the value is empty") -> str:
    if not value:
        raise ValueError(empty)
    if any(c in value for c in "\r\n\x00"):
        raise ValueError("the value holds a line break or NUL character")
    return value
