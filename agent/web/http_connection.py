"""One HTTP/1.x request on one connection, answered by a WSGI application, then the connection closes.

The agent's endpoints need little of HTTP: a request line, headers, at most a small body (the
Alertmanager webhook), one response. This reads exactly that, within bounds, and leaves out the
standard library's ``http.server`` and ``wsgiref`` (which import ``email``, ``http.client`` and
``ssl``: some 8 MiB of the agent's memory for code it does not run). It answers as they did:

* the request line at most ``MAX_REQUEST_LINE`` bytes, else 414; the request line and headers
  together at most ``max_header_bytes``, else 431 before any more is read (Go's net/http and
  Prometheus's exporter-toolkit bound them so), at most ``MAX_HEADERS`` header lines, each at most
  ``MAX_REQUEST_LINE`` bytes, else 431;
* a request line that is not ``METHOD TARGET HTTP/x.y``, or a header line that is not ``Name: value``,
  is a 400; HTTP/2 and later a 505; ``Expect: 100-continue`` is answered before the body is read;
* the WSGI environment has what the agent's application reads (method, path and query, the headers
  as ``HTTP_*`` with ``CONTENT_TYPE`` and ``CONTENT_LENGTH``, the body as ``wsgi.input``, the
  scheme); header names holding ``_`` are left out, as wsgiref leaves them out, so that no header can
  pass for another;
* the response is HTTP/1.0 with ``Server: gpuscope`` (no version for a scanner to match) and a
  ``Date``; its status line and headers go out in one write with the body's first part;
* an application that raises before it answered gets a 500; one that raises later has the
  connection closed under it.

The caller bounds the time: the socket's timeout applies to every read and write.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, BinaryIO, cast

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = logging.getLogger(__name__)

SERVER_NAME = "gpuscope"
MAX_REQUEST_LINE = 65536  # the request line, and each header line (http.server's bound)
MAX_HEADERS = 100  # header lines (http.client's bound)
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_REASONS = {
    400: "Bad Request",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    505: "HTTP Version Not Supported",
}
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class RequestError(Exception):
    """A request that is answered with an error status instead of reaching the application."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code} {detail}")
        self.code = code
        self.detail = detail


def http_date(now: float | None = None) -> str:
    """RFC 9110's IMF-fixdate, in English whatever the locale."""
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class _BodyReader:
    """``wsgi.input``: the request body, never read past the end the request declared."""

    def __init__(self, stream: BinaryIO, length: int) -> None:
        self._stream = stream
        self._left = length

    def read(self, size: int = -1) -> bytes:
        return self._take(self._stream.read, size)

    def readline(self, size: int = -1) -> bytes:
        return self._take(self._stream.readline, size)

    def _take(self, reading: Callable[[int], bytes], size: int | None) -> bytes:
        if self._left <= 0:
            return b""
        data = reading(self._left if size is None or size < 0 else min(size, self._left))
        self._left -= len(data)
        return data

    def readlines(self, hint: int = -1) -> list[bytes]:
        return list(iter(self.readline, b""))

    def __iter__(self) -> Any:
        return iter(self.readline, b"")


def serve_connection(connection: socket.socket, address: Any, app: WSGIApplication, *,
                     max_header_bytes: int, https: bool = False,
                     server_address: tuple[str, int] = ("", 0)) -> None:
    """Read one request from ``connection``, answer it with ``app``; the caller closes the socket."""
    reader = cast(BinaryIO, connection.makefile("rb", buffering=65536))
    try:
        try:
            environ = _read_request(reader, max_header_bytes)
        except RequestError as err:
            _send_error(connection, err.code, err.detail)
            return
        if environ is None:
            return  # the client closed without a request
        expect = environ.get("HTTP_EXPECT", "").lower()
        if expect == "100-continue" and environ["SERVER_PROTOCOL"] != "HTTP/1.0":
            connection.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        environ.update({
            "REMOTE_ADDR": str(address[0]) if isinstance(address, tuple) else "",
            "REMOTE_PORT": str(address[1]) if isinstance(address, tuple) and len(address) > 1 else "",
            "SERVER_NAME": server_address[0],
            "SERVER_PORT": str(server_address[1]),
            "SCRIPT_NAME": "",
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "https" if https else "http",
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        })
        if https:
            environ["HTTPS"] = "on"
        environ["wsgi.input"] = _BodyReader(reader, _declared_length(environ))
        _Response(connection).run(app, environ)
    finally:
        reader.close()


def _declared_length(environ: dict[str, Any]) -> int:
    try:
        return max(0, int(environ.get("CONTENT_LENGTH") or 0))
    except ValueError:
        return 0  # the application refuses it; nothing is read


def _read_request(reader: BinaryIO, max_header_bytes: int) -> dict[str, Any] | None:
    line = reader.readline(MAX_REQUEST_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_REQUEST_LINE:
        raise RequestError(414, f"the request line is longer than {MAX_REQUEST_LINE} bytes")
    budget = max_header_bytes - len(line)
    request_line = line.decode("iso-8859-1").rstrip("\r\n")
    words = request_line.split()
    if len(words) != 3:
        raise RequestError(400, f"bad request line {request_line[:100]!r}")
    method, target, version = words
    protocol = _protocol(version)
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "SERVER_PROTOCOL": protocol}
    path, _, query = target.partition("?")
    environ["PATH_INFO"] = urllib.parse.unquote(path, "iso-8859-1")
    environ["QUERY_STRING"] = query
    for name, value in _read_headers(reader, budget):
        key = name.upper().replace("-", "_")
        if "_" in name:
            continue  # as wsgiref: X_Forwarded could otherwise pass for X-Forwarded
        if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            environ.setdefault(key, value)
            continue
        key = "HTTP_" + key
        environ[key] = f"{environ[key]},{value}" if key in environ else value
    return environ


def _protocol(version: str) -> str:
    if not version.startswith("HTTP/"):
        raise RequestError(400, f"bad request version {version[:20]!r}")
    major, dot, minor = version[5:].partition(".")
    if not (dot and major.isdigit() and minor.isdigit() and major.isascii() and minor.isascii()
            and len(major) < 10 and len(minor) < 10):
        raise RequestError(400, f"bad request version {version[:20]!r}")
    if int(major) >= 2:
        raise RequestError(505, f"HTTP version {version[5:20]} is not supported")
    if int(major) < 1:
        raise RequestError(400, f"bad request version {version[:20]!r}")
    return f"HTTP/{int(major)}.{int(minor)}"


def _read_headers(reader: BinaryIO, budget: int) -> Iterable[tuple[str, str]]:
    headers: list[tuple[str, str]] = []
    while True:
        if budget <= 0:
            raise RequestError(431, "the headers are larger than the server accepts")
        line = reader.readline(min(MAX_REQUEST_LINE, budget) + 1)
        budget -= len(line)
        if budget < 0:
            raise RequestError(431, "the headers are larger than the server accepts")
        if len(line) > MAX_REQUEST_LINE:
            raise RequestError(431, f"a header line is longer than {MAX_REQUEST_LINE} bytes")
        if line in (b"\r\n", b"\n", b""):
            return headers
        if len(headers) >= MAX_HEADERS:
            raise RequestError(431, f"more than {MAX_HEADERS} headers")
        text = line.decode("iso-8859-1").rstrip("\r\n")
        name, colon, value = text.partition(":")
        if not colon or not name or not _TOKEN.issuperset(name):
            raise RequestError(400, f"bad header line {text[:100]!r}")
        headers.append((name, value.strip(" \t")))


def _send_error(connection: socket.socket, code: int, detail: str) -> None:
    reason = _REASONS.get(code, "Error")
    body = f"{code} {reason}: {detail}\n".encode()
    head = (f"HTTP/1.0 {code} {reason}\r\nServer: {SERVER_NAME}\r\nDate: {http_date()}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    with contextlib.suppress(OSError):  # the client may be gone
        connection.sendall(head.encode("latin-1") + body)


class _Response:
    """start_response and the writes of one response: the head goes out with the first body part."""

    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection
        self._status: str | None = None
        self._headers: list[tuple[str, str]] = []
        self._head_sent = False

    def start_response(self, status: str, headers: list[tuple[str, str]],
                       exc_info: Any = None) -> Callable[[bytes], None]:
        if exc_info is not None:
            try:
                if self._head_sent:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self._status is not None:
            raise AssertionError("start_response called twice without exc_info")
        self._status, self._headers = status, list(headers)
        return self._write

    def run(self, app: WSGIApplication, environ: dict[str, Any]) -> None:
        try:
            body = app(environ, self.start_response)
            try:
                self._finish(body)
            finally:
                close = getattr(body, "close", None)
                if close is not None:
                    close()
        except OSError:
            raise  # the connection broke: nothing more can be said on it
        except Exception:
            log.warning("error while serving %s %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"),
                        exc_info=True)
            if not self._head_sent:
                self._status = None
                _send_error(self._connection, 500, "the server could not answer this request")

    def _finish(self, body: Iterable[bytes]) -> None:
        if isinstance(body, list | tuple):  # known in full: its length is known
            if self._status is None:
                raise AssertionError("the application returned without calling start_response")
            if not self._head_sent and not any(k.lower() == "content-length" for k, _ in self._headers):
                self._headers.append(("Content-Length", str(sum(len(p) for p in body))))
        wrote = False
        for part in body:  # a stream (a capture's archive) goes out as it comes
            self._write(part)
            wrote = True
        if not wrote:
            self._write(b"")

    def _write(self, data: bytes) -> None:
        if self._status is None:
            raise AssertionError("write() before start_response")
        if self._head_sent:
            if data:
                self._connection.sendall(data)
            return
        self._head_sent = True
        lines = [f"HTTP/1.0 {self._status}\r\n"]
        names = {name.lower() for name, _ in self._headers}
        lines += [f"{name}: {value}\r\n" for name, value in self._headers]
        if "date" not in names:
            lines.append(f"Date: {http_date()}\r\n")
        if "server" not in names:
            lines.append(f"Server: {SERVER_NAME}\r\n")
        lines.append("\r\n")
        self._connection.sendall("".join(lines).encode("latin-1") + data)
