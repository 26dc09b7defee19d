"""The ``otlp`` section of the configuration: where the readings are pushed, how often, with what
credentials. Off by default.

A key left unset here may come from the standard ``OTEL_EXPORTER_OTLP_*`` variables (target.py);
a key set here (file, ``GPUSCOPE_OTLP__*`` variable or flag) wins over them, as the OpenTelemetry
specification has code's configuration win over the environment. Header values are never written
in the configuration itself: each names a file or an environment variable that holds it, so the
configuration can be shown without showing a credential.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gpuscope.common.config_types import Duration, FilePath, Section

DEFAULT_INTERVAL_SECONDS = 10.0
DEFAULT_TIMEOUT_SECONDS = 10.0  # the specification's default (OTEL_EXPORTER_OTLP_TIMEOUT, 10000 ms)
DEFAULT_MAX_QUEUE = 60  # pushes kept while the receiver is away: 10 minutes at the default interval
# An HTTP header name (RFC 9110 token); gRPC metadata keys are lower-case tokens too.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_ENVIRONMENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Protocol = Literal["http/protobuf", "grpc"]
Compression = Literal["none", "gzip"]


class HeaderValue(Section):
    """Where one header's value is read: a file (its content, surrounding white space removed) or an
    environment variable. Exactly one of the two."""

    file: FilePath | None = Field(None, description="File holding the value (e.g. a mounted Secret).")
    env: str | None = Field(None, description="Environment variable holding the value.")

    @field_validator("env")
    @classmethod
    def _environment_name(cls, name: str | None) -> str | None:
        if name is not None and not _ENVIRONMENT_NAME.fullmatch(name):
            raise ValueError(f"not an environment variable name: {name!r}")
        return name

    @model_validator(mode="after")
    def _one_source(self) -> HeaderValue:
        if (self.file is None) == (self.env is None):
            raise ValueError("set exactly one of file (a file holding the value) or env (a variable "
                             "holding it); a value is never written in the configuration itself")
        return self


class OtlpTlsConfig(Section):
    ca_file: FilePath | None = Field(None, description=(
        "CA certificates (PEM) that the receiver's certificate must chain to; unset: the system's."))
    cert_file: FilePath | None = Field(None, description="Client certificate (PEM), for mutual TLS.")
    key_file: FilePath | None = Field(None, description="The client certificate's private key (PEM).")

    @model_validator(mode="after")
    def _pair(self) -> OtlpTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: set both for a client certificate, or "
                             "neither")
        return self


class OtlpConfig(Section):
    enabled: bool = Field(False, description="Push the readings to an OTLP receiver.")
    endpoint: str | None = Field(None, description=(
        "The receiver: for http/protobuf the URL pushed to (a URL without a path gets /v1/metrics), for "
        "grpc http(s)://host:port. Unset: OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else http://localhost:4318 (grpc: http://localhost:4317)."))
    protocol: Protocol = Field("http/protobuf", description="http/protobuf or grpc.")
    interval: Duration = Field(DEFAULT_INTERVAL_SECONDS, ge=1.0, le=3600.0, description=(
        "Time between pushes; each push carries the latest snapshot."))
    timeout: Duration = Field(DEFAULT_TIMEOUT_SECONDS, gt=0.0, le=60.0, description="Deadline of one push.")
    compression: Compression = Field("gzip", description=(
        "gzip or none: the request body (a push is some ten times smaller gzipped, in the queue too)."))
    headers: dict[str, HeaderValue] = Field(default_factory=dict, description=(
        "Request headers (gRPC metadata), each read from a file or an environment variable."))
    tls: OtlpTlsConfig = Field(default_factory=OtlpTlsConfig)
    max_queue: int = Field(DEFAULT_MAX_QUEUE, ge=1, le=10_000, description=(
        "Pushes kept while the receiver cannot take them; past that the oldest is dropped and counted."))

    @field_validator("headers")
    @classmethod
    def _header_names(cls, headers: dict[str, HeaderValue]) -> dict[str, HeaderValue]:
        bad = [name for name in headers if not _HEADER_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"not a header name: {bad[0]!r}")
        return headers
