"""A real OpenTelemetry Collector for the OTLP tests, and what its file exporter wrote, as data points.

`scripts/build-otelcol` builds the Collector (the OTLP receiver over gRPC and HTTP, the file exporter)
into `.cache/otelcol/otelcol-gpuscope`. `OtelCollector` writes its configuration (both receivers on
free loopback ports, the file exporter appending JSON lines to a file, flushed every 50 ms), starts
it and waits until both ports accept; `read_metrics()` parses the file into `DataPoint`s. The
`otel_collector` fixture (tests/conftest.py) gives a started one per test and stops it afterwards.

Where the binary is missing, `require_collector()` skips the test with the build's reason (its
`.cache/otelcol/build-error.txt`), naming `scripts/build-otelcol`; on CI (`CI` set) it fails instead,
unless the build could not reach the Go module proxy, which is the machine's network, not the code.
`GPUSCOPE_OTELCOL` names another Collector binary with the same components.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO / ".cache" / "otelcol"
DEFAULT_BINARY = BUILD_DIR / "otelcol-gpuscope"
BUILD_ERROR = BUILD_DIR / "build-error.txt"
BUILD_SCRIPT = "scripts/build-otelcol"
# The phrase scripts/build-otelcol writes when the Go module proxy could not be reached.
UNREACHABLE_PROXY = "the Go module proxy"

# OTLP's AggregationTemporality, as the Collector's JSON writes it (a number) or as protobuf's JSON
# mapping does (the enum's name).
_TEMPORALITIES = {0: "unspecified", 1: "delta", 2: "cumulative",
                  "AGGREGATION_TEMPORALITY_UNSPECIFIED": "unspecified",
                  "AGGREGATION_TEMPORALITY_DELTA": "delta",
                  "AGGREGATION_TEMPORALITY_CUMULATIVE": "cumulative"}
# The metric kinds of OTLP's Metric.data, in its JSON names.
_METRIC_TYPES = ("gauge", "sum", "histogram", "exponentialHistogram", "summary")


@dataclass(frozen=True)
class DataPoint:
    """One data point of one metric, with what the file says around it.

    ``type`` is the metric's kind (``gauge``, ``sum``, ``histogram``, ``exponentialHistogram``,
    ``summary``); ``monotonic`` is set for sums only; ``temporality`` (``cumulative``, ``delta``,
    ``unspecified``) for sums and histograms. ``value`` is a gauge's or sum's number (int for
    ``asInt``, float for ``asDouble``, NaN and infinities included), None for the other kinds, whose
    fields stay in ``point``. Times are nanoseconds since the epoch, 0 where absent.
    """

    name: str
    unit: str
    type: str
    monotonic: bool | None
    temporality: str | None
    attributes: Mapping[str, Any]
    resource: Mapping[str, Any]
    value: int | float | None
    time_unix_nano: int
    start_time_unix_nano: int
    scope: str = ""
    description: str = ""
    point: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


def attribute_value(value: Mapping[str, Any]) -> Any:
    """An OTLP/JSON AnyValue as a Python value: str, bool, int, float, bytes, list, dict or None."""
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # int64 is a JSON string
    if "doubleValue" in value:
        return _number(value["doubleValue"])
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    if "arrayValue" in value:
        return [attribute_value(item) for item in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes(value["kvlistValue"].get("values", []))
    return None


def attributes(key_values: list[Mapping[str, Any]]) -> dict[str, Any]:
    """OTLP/JSON KeyValues as a dict."""
    return {kv["key"]: attribute_value(kv.get("value", {})) for kv in key_values}


def _number(raw: Any) -> float:
    # The Collector writes NaN and the infinities as the strings "NaN", "Infinity", "-Infinity".
    return float(raw)


def _nanos(raw: Any) -> int:
    return int(raw) if raw is not None else 0


def parse_metrics_line(line: str) -> list[DataPoint]:
    """The data points of one line of the file exporter: an ExportMetricsServiceRequest in OTLP/JSON."""
    request = json.loads(line)
    points: list[DataPoint] = []
    for resource_metrics in request.get("resourceMetrics", []):
        resource = attributes(resource_metrics.get("resource", {}).get("attributes", []))
        for scope_metrics in resource_metrics.get("scopeMetrics", []):
            scope = scope_metrics.get("scope", {}).get("name", "")
            for metric in scope_metrics.get("metrics", []):
                points.extend(_metric_points(metric, resource, scope))
    return points


def _metric_points(metric: Mapping[str, Any], resource: dict[str, Any], scope: str) -> Iterator[DataPoint]:
    kind = next((name for name in _METRIC_TYPES if name in metric), None)
    if kind is None:
        raise ValueError(f"metric {metric.get('name')!r} has none of {', '.join(_METRIC_TYPES)}")
    data = metric[kind]
    monotonic = bool(data.get("isMonotonic", False)) if kind == "sum" else None
    temporality = None
    if kind in ("sum", "histogram", "exponentialHistogram"):
        temporality = _TEMPORALITIES[data.get("aggregationTemporality", 0)]
    for point in data.get("dataPoints", []):
        value: int | float | None = None
        if "asInt" in point:
            value = int(point["asInt"])
        elif "asDouble" in point:
            value = _number(point["asDouble"])
        yield DataPoint(
            name=metric["name"], unit=metric.get("unit", ""), type=kind, monotonic=monotonic,
            temporality=temporality, attributes=attributes(point.get("attributes", [])),
            resource=resource, value=value, time_unix_nano=_nanos(point.get("timeUnixNano")),
            start_time_unix_nano=_nanos(point.get("startTimeUnixNano")), scope=scope,
            description=metric.get("description", ""), point=point)


def parse_metrics_file(text: str) -> list[DataPoint]:
    """Every data point of the file exporter's output, in the order written. A last line without its
    newline is still being written, and is left for the next read."""
    complete = text[:text.rfind("\n") + 1]
    return [point for line in complete.splitlines() if line.strip() for point in parse_metrics_line(line)]


def collector_binary() -> Path | None:
    """The Collector to run: ``GPUSCOPE_OTELCOL`` if set, else what scripts/build-otelcol built."""
    named = os.environ.get("GPUSCOPE_OTELCOL")
    binary = Path(named) if named else DEFAULT_BINARY
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def missing_reason() -> str:
    """Why there is no Collector binary, naming the script that builds it."""
    named = os.environ.get("GPUSCOPE_OTELCOL")
    if named:
        return f"GPUSCOPE_OTELCOL={named} is not an executable file"
    reason = f"no OpenTelemetry Collector at {DEFAULT_BINARY.relative_to(REPO)}: run {BUILD_SCRIPT}"
    if BUILD_ERROR.is_file():
        lines = BUILD_ERROR.read_text(errors="replace").splitlines()
        if lines:
            reason += f" (its last run: {lines[0]})"
    return reason


def require_collector() -> Path:
    """The Collector binary; skips the test where there is none (fails on CI, unless the build could
    not reach the Go module proxy)."""
    binary = collector_binary()
    if binary is not None:
        return binary
    reason = missing_reason()
    if os.environ.get("CI") and UNREACHABLE_PROXY not in reason:
        pytest.fail(reason)
    pytest.skip(reason)


def _free_ports(count: int) -> list[int]:
    # All sockets open at once, so the ports differ.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class OtelCollector:
    """A Collector process whose OTLP receivers write every metric they accept to ``output_path``.

    ``start()`` and ``stop()`` may alternate: a restart keeps the ports and appends to the same file.
    """

    def __init__(self, binary: Path, workdir: Path, *, flush_interval: str = "50ms",
                 start_timeout: float = 30.0) -> None:
        self.binary = binary
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.grpc_port = _free_ports(2)
        self.config_path = workdir / "otelcol.yaml"
        self.output_path = workdir / "metrics.jsonl"
        self.log_path = workdir / "otelcol.log"
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self.config_path.write_text(json.dumps(self._config(flush_interval), indent=2) + "\n")

    @property
    def endpoint_http(self) -> str:
        """The OTLP/HTTP base URL (``http://127.0.0.1:PORT``); metrics go to ``/v1/metrics``."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return self.endpoint_http + "/v1/metrics"

    @property
    def endpoint_grpc(self) -> str:
        """The OTLP/gRPC target (``127.0.0.1:PORT``, plaintext), as ``grpc.insecure_channel`` takes it."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _config(self, flush_interval: str) -> dict[str, Any]:
        # JSON is YAML: the Collector reads this file as it would a YAML one.
        return {
            "receivers": {"otlp": {"protocols": {
                "grpc": {"endpoint": self.endpoint_grpc},
                "http": {"endpoint": f"127.0.0.1:{self.http_port}"},
            }}},
            "exporters": {"file": {
                "path": str(self.output_path),
                "format": "json",
                # A restart must not truncate what the Collector wrote before it.
                "append": True,
                "flush_interval": flush_interval,
            }},
            "service": {
                # No self-metrics: their default port (8888) would clash between Collectors.
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
                "pipelines": {"metrics": {"receivers": ["otlp"], "exporters": ["file"]}},
            },
        }

    def start(self) -> None:
        """Start the Collector; return once both receivers accept connections."""
        if self.running:
            raise RuntimeError("the Collector is already running")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [str(self.binary), f"--config=file:{self.config_path}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=self.workdir)
        deadline = time.monotonic() + self.start_timeout
        while not (_accepts(self.http_port) and _accepts(self.grpc_port)):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Collector did not start; its log:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the Collector (SIGTERM: it flushes the file before it exits); no-op when stopped."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def read_metrics(self) -> list[DataPoint]:
        """Every data point the Collector has written so far (across restarts), in order."""
        if not self.output_path.exists():
            return []
        return parse_metrics_file(self.output_path.read_text())

    def wait_for_metrics(self, condition: Callable[[list[DataPoint]], bool] | None = None,
                         timeout: float = 15.0) -> list[DataPoint]:
        """``read_metrics()`` once ``condition`` holds on it (default: any point at all); fails the
        test, with the Collector's log, after ``timeout`` seconds."""
        check = condition or bool
        deadline = time.monotonic() + timeout
        while True:
            points = self.read_metrics()
            if check(points):
                return points
            if time.monotonic() > deadline:
                pytest.fail(f"the Collector wrote {len(points)} points, not what was awaited; "
                            f"its log:\n{self.log_tail()}")
            time.sleep(0.05)


@contextmanager
def running_collector(workdir: Path, binary: Path | None = None) -> Iterator[OtelCollector]:
    """A started Collector (``binary``, else `require_collector()`'s) for the ``with`` block."""
    collector = OtelCollector(binary or require_collector(), workdir)
    collector.start()
    try:
        yield collector
    finally:
        collector.stop()


def points_named(points: list[DataPoint], name: str) -> list[DataPoint]:
    return [point for point in points if point.name == name]

