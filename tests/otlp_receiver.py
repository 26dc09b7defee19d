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
def otlp_receiver(path: str = "/v1/metrics") -> Iterator[Receiver]:
    receiver = Receiver(url="")
    handler = type("Handler", (_Handler,), {"receiver": receiver})
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
