"""Simulated GPU processes as capture targets: the helper processes poll a real Kineto daemon (the
agent's, on a socket file of the test's own), and a capture through the real Kineto backend gets the
trace of what the process did, step by step, in time with its GPU's pattern."""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from capturing import DirectoryStaging
from hypothesis import given
from hypothesis import strategies as st

from gpuscope.capture.kineto.backend import KinetoBackend
from gpuscope.capture.kineto.daemon import KinetoDaemon
from gpuscope.capture.kineto.protocol import (
    CLIENT_PREFIX,
    HEADER,
    MalformedDatagram,
    encode_request,
    parse_config,
    parse_request,
    split_message,
    trace_config,
)
from gpuscope.capture.model import BackendResult, CaptureTarget
from gpuscope.simulate import Simulation
from gpuscope.simulate.kineto_client import TraceConfigError, TraceRequest
from gpuscope.simulate.loader import parse_scenario
from gpuscope.simulate.traced_work import INPUT_WAIT

SCENARIO = """
name: capturable
duration: 5m
gpus:
  - utilization: {level: 0.9}
    processes: [{name: sim-steady, spawn: true}]
  - utilization: {pattern: steps, period: 1s, busy_fraction: 0.5}
    processes: [{name: sim-steps, spawn: true}]
"""


@dataclass
class Node:
    simulation: Simulation
    daemon: KinetoDaemon
    socket_dir: Path

    def capture(self, name: str, staging: Path,
                duration_s: float) -> tuple[BackendResult, list[dict[str, Any]]]:
        pid = self.simulation.helper_pids[name]
        target = CaptureTarget("kineto", pid, source="kineto-registration")
        result = KinetoBackend(self.daemon).capture(target, duration_s, DirectoryStaging(staging),
                                                    deadline_s=20.0)
        if result.outcome != "captured":
            return result, []
        document = json.loads(gzip.decompress((staging / result.files[0]).read_bytes()))
        return result, [e for e in document["traceEvents"] if e["ph"] == "X" and e["cat"] != "Trace"]


@pytest.fixture
def node() -> Iterator[Node]:
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # socket paths must stay short
    daemon = KinetoDaemon(socket_dir=short / "ipc", trace_dir=short / "traces")
    simulation = Simulation(parse_scenario(SCENARIO), kineto_daemon=daemon.address)
    simulation.install()  # the helpers start before the daemon, as in the agent: they keep looking
    try:
        daemon.start()
        deadline = time.monotonic() + 20
        while set(simulation.helper_pids.values()) - set(daemon.registered()):
            assert time.monotonic() < deadline, (simulation.helper_pids, daemon.registered())
            time.sleep(0.05)
        yield Node(simulation, daemon, short / "ipc")
    finally:
        simulation.uninstall()
        daemon.stop()
        shutil.rmtree(short, ignore_errors=True)


def scenario_time(node: Node, event: dict[str, Any], base_ns: int) -> float:
    """The scenario time at which a span started (its wall-clock start, on the monotonic clock)."""
    wall = base_ns / 1e9 + event["ts"] / 1e6
    return wall - (time.time() - time.monotonic()) - node.simulation._t0  # type: ignore[operator]


def test_a_process_is_traced_doing_what_its_gpu_does(node: Node, tmp_path: Path) -> None:
    result, spans = node.capture("sim-steps", tmp_path, 2.5)
    assert result.outcome == "captured", result
    pid = node.simulation.helper_pids["sim-steps"]
    host = [e for e in spans if e["cat"] != "kernel"]
    assert {e["pid"] for e in host} == {pid} and {e["tid"] for e in host} == {pid}
    # The simulated GPU's kernels: on device 0's stream 7, each tied to a launch of the process's.
    kernels = [e for e in spans if e["cat"] == "kernel"]
    launches = {e["args"]["correlation"] for e in host if e["name"] == "cudaLaunchKernel"}
    assert kernels and {(e["pid"], e["tid"]) for e in kernels} == {(0, 7)}
    assert {e["args"]["correlation"] for e in kernels} == launches
    # The device works while the host computes, and idles while it waits for its input. A 2.5 s trace
    # of 1 s steps cuts its first and last step anywhere (1.5 s computing and 1 s waiting, or the
    # reverse), and a busy machine stretches the computing half: the totals only show both halves.
    device = sum(e["dur"] for e in kernels)
    waiting_time = sum(e["dur"] for e in spans if e["name"] == INPUT_WAIT)
    assert 0.4 < device / waiting_time < 2.5
    # Steps of one second: half computing, half waiting (an input-bound job).
    whole = [e for e in spans if e["name"].startswith("ProfilerStep#") and 0.9e6 < e["dur"] < 1.1e6]
    assert whole, spans
    computing = [e for e in spans if e["name"] == "compute" and e["dur"] > 0.4e6]
    waiting = [e for e in spans if e["name"] == INPUT_WAIT and e["dur"] > 0.4e6]
    assert computing and waiting
    assert all(0.4e6 < e["dur"] < 0.6e6 for e in computing + waiting)
    assert all(e["args"]["blocks"] > 0 for e in computing)
    # In time with the simulated GPU: each whole compute span starts on a second of scenario time.
    document = json.loads(gzip.decompress((tmp_path / result.files[0]).read_bytes()))
    for event in computing:
        t = scenario_time(node, event, document["baseTimeNanoseconds"])
        assert abs(t - round(t)) < 0.15, t


def test_a_steady_process_computes_most_of_the_time(node: Node, tmp_path: Path) -> None:
    result, spans = node.capture("sim-steady", tmp_path, 1.0)
    assert result.outcome == "captured", result
    busy = sum(e["dur"] for e in spans if e["name"] == "compute")
    idle = sum(e["dur"] for e in spans if e["name"] == INPUT_WAIT)
    assert busy > 5 * idle > 0


def test_only_the_daemon_can_send_a_process_a_trace_config(node: Node) -> None:
    # The client socket is connected to the daemon's: the kernel refuses datagrams from anyone else.
    (client,) = [p for p in node.socket_dir.iterdir() if p.name.startswith(CLIENT_PREFIX)][:1]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger, pytest.raises(OSError) as refused:
        stranger.sendto(HEADER.pack(5, b"req") + b"x=y\n\n", str(client))
    assert refused.value.errno == errno.EPERM


def test_the_client_sockets_go_with_the_processes() -> None:
    short = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        with KinetoDaemon(socket_dir=short / "ipc", trace_dir=short / "traces") as daemon:
            simulation = Simulation(parse_scenario(SCENARIO), kineto_daemon=daemon.address)
            with simulation:
                deadline = time.monotonic() + 20
                while len(daemon.registered()) < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert len([p for p in (short / "ipc").iterdir() if p.name.startswith(CLIENT_PREFIX)]) == 2
            assert [p.name for p in (short / "ipc").iterdir()] == ["dynolog"]
    finally:
        shutil.rmtree(short, ignore_errors=True)


# -- the client's side of the protocol ----------------------------------------------------------------


def test_a_request_is_what_the_daemon_parses() -> None:
    kind, body = split_message(encode_request((42, 7), job_id=9), 0)
    request = parse_request(body)
    assert (kind, request.pids, request.job_id, request.profiler_busy) == (b"req", (42, 7), 9, False)
    assert parse_request(split_message(encode_request((42,), profiler_busy=True), 0)[1]).profiler_busy
    with pytest.raises(ValueError, match="positive pids"):
        encode_request((0,))


def test_a_trace_config_is_what_the_daemon_sends() -> None:
    config = parse_config(trace_config(Path("/run/t/123-ab/trace.json"), 2000, 0))
    request = TraceRequest.from_config(config)
    assert request == TraceRequest(Path("/run/t/123-ab/trace.json"), 2.0, 0.0)
    assert request.trace_path(4242) == Path("/run/t/123-ab/trace_4242.json")
    for bad in ({"ACTIVITIES_LOG_FILE": "relative/trace.json"}, {"ACTIVITIES_LOG_FILE": "/a/../b.json"},
                {"ACTIVITIES_LOG_FILE": "/t.json", "ACTIVITIES_DURATION_MSECS": "0"},
                {"ACTIVITIES_LOG_FILE": "/t.json", "ACTIVITIES_DURATION_MSECS": "soon"},
                {"ACTIVITIES_DURATION_MSECS": "100"}):
        with pytest.raises(TraceConfigError):
            TraceRequest.from_config(bad)


@given(st.binary(max_size=512))
def test_any_reply_parses_or_is_refused_by_name(data: bytes) -> None:
    try:
        config = parse_config(data)
    except MalformedDatagram:
        return
    assert all(isinstance(k, str) and k and isinstance(v, str) for k, v in config.items())
    with contextlib.suppress(TraceConfigError):
        TraceRequest.from_config(config)


def test_a_reply_header_carries_the_config() -> None:
    message = HEADER.pack(4, b"req") + b"a=b\n"
    assert split_message(message, 0) == (b"req", b"a=b\n")
    assert struct.calcsize("=Q32s") == HEADER.size
