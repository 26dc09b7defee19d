"""One push of an encoded request to the receiver, over HTTP (``http/protobuf``) or gRPC, and what
came of it: sent, to be retried (and when the receiver asks for it), or refused for good.

As the OTLP specification has it: HTTP 429, 502, 503 and 504 are retried, honouring ``Retry-After``
(seconds or an HTTP date); any other 4xx or 5xx is not; a connection that fails or times out is
retried. gRPC: UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, ABORTED, CANCELLED, OUT_OF_RANGE
and DATA_LOSS are retried, the other codes are not. A Transport is used by one thread at a time.
"""

from __future__ import annotations

import email.utils
import logging
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gpuscope.otlp.target import ExportTarget

if TYPE_CHECKING:
    import http.client
    import ssl

log = logging.getLogger(__name__)

RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
MAX_RETRY_AFTER_SECONDS = 300.0  # a receiver asking for more is waited for this long, then tried again
_MAX_RESPONSE_BYTES = 64 * 1024
_GRPC_METHOD = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
# What a kept-alive connection that the receiver closed while idle fails with.
_STALE_CONNECTION = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_RETRYABLE_GRPC = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED",
                   "OUT_OF_RANGE", "DATA_LOSS")

Outcome = Literal["sent", "retry", "refused"]


@dataclass(frozen=True)
class PushResult:
    outcome: Outcome
    reason: str  # "200", "503", "connection refused", "UNAVAILABLE": what a log line and a test show
    retry_after: float | None = None  # seconds the receiver asked to wait (Retry-After), if it did


class Transport(Protocol):
    def push(self, body: bytes, timeout: float) -> PushResult: ...

    def close(self) -> None: ...


def build_transport(target: ExportTarget) -> Transport:
    if target.protocol == "grpc":
        return GrpcTransport(target)
    return HttpTransport(target)


def payload(target: ExportTarget, request: bytes) -> bytes:
    """What is queued and sent for a serialised request: gzipped once for HTTP with compression on
    (ten times smaller in the queue too); gRPC compresses on the wire itself."""
    return gzip_bytes(request) if target.compression == "gzip" and target.protocol != "grpc" else request


def gzip_bytes(body: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: a gzip member
    return compressor.compress(body) + compressor.flush()


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After``: delay seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_SECONDS)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    delay = when.timestamp() - (time.time() if now is None else now)
    return min(max(delay, 0.0), MAX_RETRY_AFTER_SECONDS)


class HttpTransport:
    """POSTs ``application/x-protobuf`` over one kept-alive connection (opened again after a failure).
    Proxies from the environment are not used: a Collector is normally on the node or in the cluster."""

    def __init__(self, target: ExportTarget) -> None:
        import http.client
        import urllib.parse

        self._http = http.client
        parts = urllib.parse.urlsplit(target.url)
        self._host = parts.hostname or ""
        self._port = parts.port
        self._path = parts.path or "/"
        self._gzip = target.compression == "gzip"
        self._context = _ssl_context(target) if target.secure else None
        self._headers = {"Content-Type": "application/x-protobuf", "User-Agent": _user_agent(),
                         **({"Content-Encoding": "gzip"} if self._gzip else {}), **dict(target.headers)}
        self._connection: http.client.HTTPConnection | None = None

    def push(self, body: bytes, timeout: float) -> PushResult:
        """``body``: the request as queued, already gzipped where the target compresses (see
        ``payload``), so that a request retried is not compressed again."""
        reused = self._connection is not None
        try:
            status, retry_after = self._post(body, timeout)
        except (OSError, self._http.HTTPException) as err:
            self.close()
            # A kept-alive connection the receiver closed while idle fails at once: one new
            # connection, now, rather than a back-off for what is not the receiver's failure.
            if not (reused and isinstance(err, _STALE_CONNECTION)):
                return PushResult("retry", _describe(err))
            try:
                status, retry_after = self._post(body, timeout)
            except (OSError, self._http.HTTPException) as again:
                self.close()
                return PushResult("retry", _describe(again))
        if 200 <= status < 300:
            return PushResult("sent", str(status))
        if status in RETRYABLE_HTTP:
            return PushResult("retry", str(status), retry_after_seconds(retry_after))
        return PushResult("refused", str(status))

    def _post(self, body: bytes, timeout: float) -> tuple[int, str | None]:
        """(status, Retry-After) of one POST on the kept-alive connection (a new one if none)."""
        connection = self._connect()
        connection.timeout = timeout
        if connection.sock is not None:  # kept alive from the last push
            connection.sock.settimeout(timeout)
        connection.request("POST", self._path, body=body, headers=self._headers)
        response = connection.getresponse()
        response.read(_MAX_RESPONSE_BYTES)  # the ExportMetricsServiceResponse: read, to reuse the socket
        if response.will_close:
            self.close()
        return response.status, response.getheader("Retry-After")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            if self._context is not None:
                self._connection = self._http.HTTPSConnection(self._host, self._port, context=self._context)
            else:
                self._connection = self._http.HTTPConnection(self._host, self._port)
        return self._connection


class GrpcTransport:
    """Calls ``MetricsService/Export`` with the encoded request as it is (no second encoding)."""

    def __init__(self, target: ExportTarget) -> None:
        import grpc

        self._grpc = grpc
        address = target.url.split("://", 1)[1]
        if target.secure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(target.ca_file), private_key=_read(target.key_file),
                certificate_chain=_read(target.cert_file))
            self._channel = grpc.secure_channel(address, credentials)
        else:
            self._channel = grpc.insecure_channel(address)
        self._export: Any = self._channel.unary_unary(_GRPC_METHOD, request_serializer=None,
                                                 response_deserializer=None)
        self._metadata = tuple((name.lower(), value) for name, value in target.headers)
        gzip = target.compression == "gzip"
        self._compression = grpc.Compression.Gzip if gzip else grpc.Compression.NoCompression

    def push(self, body: bytes, timeout: float) -> PushResult:
        try:
            self._export(body, timeout=timeout, metadata=self._metadata, compression=self._compression)
        except self._grpc.RpcError as err:
            code: Any = err.code() if hasattr(err, "code") else None
            name = getattr(code, "name", "UNKNOWN")
            return PushResult("retry" if name in _RETRYABLE_GRPC else "refused", name)
        return PushResult("sent", "OK")

    def close(self) -> None:
        self._channel.close()


def _ssl_context(target: ExportTarget) -> ssl.SSLContext:
    import ssl

    context = ssl.create_default_context(cafile=str(target.ca_file) if target.ca_file else None)
    if target.cert_file is not None and target.key_file is not None:
        context.load_cert_chain(str(target.cert_file), str(target.key_file))
    return context


def _read(path: Any) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()


def _user_agent() -> str:
    from gpuscope.version import __version__

    return f"gpuscope/{__version__} (OTLP)"


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return type(err).__name__
