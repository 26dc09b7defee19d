"""A loopback OTLP/HTTP receiver for the tests: records every request (its headers and the decoded
ExportMetricsServiceRequest) and answers as told, one scripted answer per request, then 200; or
never answers while ``hang`` is set (a Collector that accepted the connection and stalls)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    request: Any  # ExportMetricsServiceRequest


@dataclass
class Receiver:
    url: str
    answers: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # (status, headers), in turn
    received: list[Received] = field(default_factory=list)
    hang: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)  # set: hanging requests give up
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def metrics(self, index: int = -1) -> dict[str, Any]:
        """The metrics of one request by name (the last by default)."""
        request = self.received[index].request
        return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}

    def count(self) -> int:
        with self.lock:
            return len(self.received)


class _Handler(BaseHTTPRequestHandler):
    receiver: Receiver

    def do_POST(self) -> None:
        receiver = self.receiver
        if receiver.hang.is_set():
            receiver.release.wait(30)
            return  # the connection closes unanswered
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        with receiver.lock:
            receiver.received.append(Received(self.path, dict(self.headers.items()), request))
            status, headers = receiver.answers.pop(0) if receiver.answers else (200, {})
        with receiver.arrived:
            receiver.arrived.notify_all()
        payload = ExportMetricsServiceResponse().SerializeToString() if status == 200 else b"no"
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def otlp_receiver(path: str = "/v1/metrics", *, keep_alive: bool = False) -> Iterator[Receiver]:
    """``keep_alive``: HTTP/1.1 connections kept open between requests, as a Collector's are."""
    receiver = Receiver(url="")
    handler = type("Handler", (_Handler,), {"receiver": receiver,
                                            "protocol_version": "HTTP/1.1" if keep_alive else "HTTP/1.0"})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release.set()
        server.shutdown()
        server.server_close()


class LoopbackCollector:
    """A stand-in for tests/otel_collector.py's OtelCollector where no Collector binary was built: the
    same interface (endpoint_http, start, stop, read_metrics, wait_for_metrics), a loopback receiver
    that keeps its port across restarts, and the requests it accepted as the Collector's file
    exporter would write them (OTLP/JSON, parsed by the same parse_metrics_line)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    @property
    def endpoint_http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from google.protobuf import json_format

                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportMetricsServiceRequest()
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request.ParseFromString(body)
                with owner._lock:
                    owner._lines.append(json_format.MessageToJson(request, indent=None))
                payload = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def read_metrics(self) -> list[Any]:
        from otel_collector import parse_metrics_line

        with self._lock:
            lines = list(self._lines)
        return [point for line in lines for point in parse_metrics_line(line)]

    def wait_for_metrics(self, condition: Any = None, timeout: float = 15.0) -> list[Any]:
        import time

        check = condition or bool
        deadline = time.monotonic() + timeout
        while True:
            points = self.read_metrics()
            if check(points):
                return points
            assert time.monotonic() < deadline, f"the stand-in received {len(points)} points, not the awaited"
            time.sleep(0.05)
