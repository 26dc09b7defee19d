"""End to end: `gpuscope run --simulate demo` pushing to a real OpenTelemetry Collector
(tests/otel_collector.py; skipped where scripts/build-otelcol could not build one) and to a loopback
stand-in with the same interface (tests/otlp_receiver.py), which runs everywhere. What arrives is
checked against the agent's own snapshot (/api/v1/snapshot): names, units, instruments, attributes
and values. Then the Collector goes away for a while: the
agent's queue stays within otlp.max_queue and counts what it drops; and when the Collector is back,
delivery resumes."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, run_agent
from otel_collector import DataPoint
from otlp_receiver import LoopbackCollector
from polling import wait_until

from gpuscope.otlp.encode import unix_nanos
from gpuscope.snapshot import Snapshot

pytestmark = pytest.mark.e2e

MAX_QUEUE = 3


def metric_value(agent: RunningAgent, name: str, labels: str = "") -> float | None:
    """One sample of the agent's /metrics (``labels`` as written in the exposition, e.g.
    ``outcome="sent"``); None when absent."""
    status, body = agent.get("/metrics")
    assert status == 200
    selector = re.escape(name + (f"{{{labels}}}" if labels else ""))
    match = re.search(rf"^{selector} (\S+)$", body, re.MULTILINE)
    return float(match.group(1)) if match else None


def snapshot_of(agent: RunningAgent) -> Snapshot:
    status, body = agent.get("/api/v1/snapshot")
    assert status == 200
    return Snapshot.from_json(json.loads(body))


def at(points: list[DataPoint], time_ns: int) -> list[DataPoint]:
    return [p for p in points if p.time_unix_nano == time_ns]


def one(points: list[DataPoint], name: str, **attributes: object) -> DataPoint:
    wanted = {key.replace("__", "."): value for key, value in attributes.items()}
    found = [p for p in points if p.name == name and wanted.items() <= dict(p.attributes).items()]
    assert len(found) == 1, (name, wanted, [dict(p.attributes) for p in points if p.name == name])
    return found[0]


@pytest.fixture(params=["otelcol", "loopback"])
def collector(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The real Collector (the otel_collector fixture), or the loopback stand-in."""
    if request.param == "otelcol":
        yield request.getfixturevalue("otel_collector")
        return
    stand_in = LoopbackCollector()
    try:
        yield stand_in
    finally:
        stand_in.stop()


def pushed_snapshot(agent: RunningAgent, collector: Any) -> tuple[Snapshot, list[DataPoint]]:
    """A snapshot of the agent's and the points the Collector received for it (pushes come every
    second, snapshots every two: each is pushed)."""
    for _ in range(10):
        snapshot = snapshot_of(agent)
        time_ns = unix_nanos(snapshot.timestamp)
        points = collector.wait_for_metrics(
            lambda found, t=time_ns: any(p.time_unix_nano >= t for p in found))
        mine = at(points, time_ns)
        if mine:
            return snapshot, mine
    raise AssertionError("no pushed snapshot matched the agent's")


def test_the_collector_receives_the_snapshot_and_survives_an_outage(tmp_path: Path, collector: Any) -> None:
    otel_collector = collector
    env = {"GPUSCOPE_OTLP__ENABLED": "true", "GPUSCOPE_OTLP__ENDPOINT": otel_collector.endpoint_http,
           "GPUSCOPE_OTLP__INTERVAL": "1s", "GPUSCOPE_OTLP__TIMEOUT": "1s",
           "GPUSCOPE_OTLP__MAX_QUEUE": str(MAX_QUEUE)}
    with run_agent(tmp_path, "--simulate", "demo", "--sample-interval", "2s", env=env) as agent:
        agent.wait_for("/api/v1/snapshot", '"gpus"')
        snapshot, points = pushed_snapshot(agent, otel_collector)

        # -- what arrives is the agent's snapshot, under the conventions' names and units ----------------
        resource = dict(points[0].resource)
        assert resource["service.name"] == "gpuscope" and resource["host.name"] == snapshot.hostname
        up = [gpu for gpu in snapshot.gpus if gpu.up]
        assert up, "the demo node has readable GPUs"
        for gpu in up:
            if gpu.utilization_ratio is not None:
                utilization = one(points, "hw.gpu.utilization", hw__id=gpu.uuid, hw__gpu__task="general")
                assert (utilization.type, utilization.unit) == ("gauge", "1")
                assert utilization.value == pytest.approx(gpu.utilization_ratio)
            usage = one(points, "hw.gpu.memory.usage", hw__id=gpu.uuid)
            assert (usage.type, usage.unit, usage.monotonic, usage.temporality) == (
                "sum", "By", False, "cumulative")
            assert usage.value == pytest.approx(gpu.memory_used_bytes)
            assert one(points, "hw.gpu.memory.limit", hw__id=gpu.uuid).value == pytest.approx(
                gpu.memory_total_bytes)
            if gpu.power_watts is not None:
                power = one(points, "hw.power", hw__id=gpu.uuid)
                assert power.unit == "W" and power.value == pytest.approx(gpu.power_watts)
            if gpu.energy_joules_total is not None:
                energy = one(points, "hw.energy", hw__id=gpu.uuid)
                assert (energy.type, energy.unit, energy.monotonic, energy.temporality) == (
                    "sum", "J", True, "cumulative")
                assert energy.value == pytest.approx(gpu.energy_joules_total)
                assert 0 < energy.start_time_unix_nano <= energy.time_unix_nano
            if gpu.pcie_rx_bytes_total is not None:
                received = one(points, "hw.gpu.io", hw__id=gpu.uuid, network__io__direction="receive")
                assert received.unit == "By" and received.value == pytest.approx(gpu.pcie_rx_bytes_total)
            status = one(points, "hw.status", hw__id=gpu.uuid, hw__state="ok")
            assert status.value == (1 if gpu.health == "ok" else 0)
            attributes = dict(status.attributes)
            assert attributes["hw.type"] == "gpu" and attributes["hw.model"] == gpu.name
            assert attributes["hw.vendor"] == "NVIDIA" and attributes["hw.name"] == f"GPU {gpu.index}"
        processes = [p for p in points if p.name == "gpuscope.process.memory.usage"]
        assert processes and all("process.command_line" not in p.attributes for p in processes)
        assert {p.attributes["process.pid"] for p in processes} == {
            process.pid for gpu in up for process in gpu.processes}
        assert metric_value(agent, "gpuscope_otlp_exports_total", 'outcome="sent"') >= 1  # type: ignore[operator]

        # -- the Collector goes away: a bounded queue, drops counted --------------------------------------
        otel_collector.stop()
        lengths: list[float] = []

        def dropping() -> bool:
            lengths.append(metric_value(agent, "gpuscope_otlp_queue_length") or 0.0)
            return (metric_value(agent, "gpuscope_otlp_exports_total", 'outcome="dropped"') or 0) >= 2

        wait_until(dropping, timeout=30.0, step=0.2)
        assert max(lengths) <= MAX_QUEUE
        assert metric_value(agent, "gpuscope_otlp_queue_capacity") == MAX_QUEUE
        assert (metric_value(agent, "gpuscope_otlp_retries_total") or 0) >= 1
        sent_before = metric_value(agent, "gpuscope_otlp_exports_total", 'outcome="sent"') or 0

        # -- and comes back: delivery resumes, the queue drains ------------------------------------------
        back = time.time()
        otel_collector.start()
        otel_collector.wait_for_metrics(
            lambda found: any(p.time_unix_nano >= unix_nanos(back) for p in found), timeout=90.0)
        wait_until(lambda: (metric_value(agent, "gpuscope_otlp_exports_total", 'outcome="sent"') or 0)
                   > sent_before + MAX_QUEUE - 1, timeout=90.0, step=0.2)
        assert "OTLP: pushing to" in agent.stderr()


def test_grpc_reaches_the_collector(tmp_path: Path, otel_collector: Any) -> None:
    env = {"GPUSCOPE_OTLP__ENABLED": "true", "GPUSCOPE_OTLP__PROTOCOL": "grpc",
           "GPUSCOPE_OTLP__ENDPOINT": f"http://{otel_collector.endpoint_grpc}",
           "GPUSCOPE_OTLP__INTERVAL": "1s"}
    with run_agent(tmp_path, "--simulate", "demo", "--sample-interval", "2s", env=env) as agent:
        agent.wait_for("/api/v1/snapshot", '"gpus"')
        snapshot, points = pushed_snapshot(agent, otel_collector)
        for gpu in snapshot.gpus:
            if gpu.up and gpu.memory_used_bytes is not None:
                usage = one(points, "hw.gpu.memory.usage", hw__id=gpu.uuid)
                assert usage.unit == "By" and usage.value == pytest.approx(gpu.memory_used_bytes)
