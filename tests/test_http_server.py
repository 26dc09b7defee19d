"""The HTTP endpoints, served for real on 127.0.0.1 (port 0), scraped with http.client and promtool."""

from __future__ import annotations

import gzip
import http.client
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.parser import text_string_to_metric_families
from snapshots import FakeSource, make_full_snapshot, make_gpus, make_snapshot

from gpuscope.alerts.model import Alert, AlertState, TransitionState
from gpuscope.documents import ProcessExposure
from gpuscope.exporters.prometheus import SnapshotCollector
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__
from gpuscope.web.server import AgentHttpServer, ListenError

TIMEOUT = 5.0
NOW = 5000.0  # the fake monotonic clock; snapshots are stamped relative to it


@dataclass
class FakeClock:
    now: float = NOW

    def __call__(self) -> float:
        return self.now


@dataclass
class Agent:
    server: AgentHttpServer
    source: FakeSource
    clock: FakeClock

    def request(self, path: str, method: str = "GET", headers: dict[str, str] | None = None,
                ) -> tuple[int, dict[str, str], bytes]:
        host, port = self.server.bound_address
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        try:
            conn.request(method, path, headers=headers or {})
            response = conn.getresponse()
            body = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, body
        finally:
            conn.close()


def fresh_snapshot(**overrides: Any) -> Snapshot:
    """A snapshot taken half a second before the fake clock's now."""
    return make_snapshot(**{"monotonic": NOW - 0.5, **overrides})


@pytest.fixture
def agent() -> Iterator[Agent]:
    source = FakeSource(snapshot=fresh_snapshot())
    clock = FakeClock()
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(source))
    server = AgentHttpServer("127.0.0.1:0", registry=registry, source=source, clock=clock)
    server.start()
    try:
        yield Agent(server, source, clock)
    finally:
        server.stop()


# -- /metrics ----------------------------------------------------------------------------------------


def test_metrics_text_format(agent: Agent) -> None:
    status, headers, body = agent.request("/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "content-encoding" not in headers
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert [s.value for s in families["gpuscope_nvml_up"].samples] == [1.0]
    assert len(families["gpu_up"].samples) == 8


def test_metrics_openmetrics_negotiation(agent: Agent) -> None:
    status, headers, body = agent.request("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b"# UNIT gpu_power_watts watts\n" in body


def test_metrics_prometheus_accept_header_gets_openmetrics(agent: Agent) -> None:
    # What Prometheus 2.x sends when scraping.
    accept = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
    status, headers, _ = agent.request("/metrics", headers={"Accept": accept})
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")


def test_metrics_gzip(agent: Agent) -> None:
    status, headers, body = agent.request("/metrics", headers={"Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["content-encoding"] == "gzip"
    assert int(headers["content-length"]) == len(body)
    assert b"gpu_power_watts{" in gzip.decompress(body)


def test_metrics_head(agent: Agent) -> None:
    status, headers, body = agent.request("/metrics", method="HEAD")
    assert status == 200
    assert body == b""
    assert int(headers["content-length"]) > 1000


@pytest.mark.parametrize("accept", [
    None, "text/plain;version=1.0.0;escaping=allow-utf-8", "application/openmetrics-text",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.3",
])
@pytest.mark.parametrize("accept_encoding", [None, "gzip", "br, GZIP;q=0.5"])
def test_metrics_body_and_content_type_are_prometheus_clients(agent: Agent, accept: str | None,
                                                              accept_encoding: str | None) -> None:
    agent.source.snapshot = fresh_snapshot(gpus=make_full_snapshot().gpus)
    headers = {k: v for k, v in (("Accept", accept), ("Accept-Encoding", accept_encoding)) if v is not None}
    status, response_headers, body = agent.request("/metrics", headers=headers)
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(agent.source))
    encoder, content_type = choose_encoder(accept or "")
    assert status == 200
    assert response_headers["content-type"] == content_type
    if accept_encoding:
        assert response_headers["content-encoding"] == "gzip"
        body = gzip.decompress(body)
    else:
        assert "content-encoding" not in response_headers
    assert body == encoder(registry)


def test_metrics_head_has_the_get_length(agent: Agent) -> None:
    for headers in ({}, {"Accept-Encoding": "gzip"}, {"Accept": "application/openmetrics-text"}):
        _, get_headers, body = agent.request("/metrics", headers=headers)
        status, head_headers, head_body = agent.request("/metrics", method="HEAD", headers=headers)
        assert (status, head_body) == (200, b"")
        assert head_headers["content-length"] == get_headers["content-length"] == str(len(body))
        assert head_headers["content-type"] == get_headers["content-type"]


def test_metrics_name_filter(agent: Agent) -> None:
    query = "name[]=gpu_power_watts&name[]=gpu_energy_joules_total&name[]=gpuscope_nvml_up&name[]=nope"
    status, _, body = agent.request(f"/metrics?{query}")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert sorted(families) == ["gpu_energy_joules", "gpu_power_watts", "gpuscope_nvml_up"]
    assert len(families["gpu_power_watts"].samples) == 8
    # A counter by its family name; in OpenMetrics, units stay.
    status, _, body = agent.request("/metrics?name[]=gpu_energy_joules",
                                    headers={"Accept": "application/openmetrics-text"})
    assert body.startswith(b"# HELP gpu_energy_joules ")
    assert b"# UNIT gpu_energy_joules joules\n" in body
    assert body.count(b"\ngpu_energy_joules_total{") == 8
    assert body.endswith(b"# EOF\n")
    # Nothing matches: an empty but valid exposition.
    assert agent.request("/metrics?name[]=nope")[0::2] == (200, b"")
    # An empty name[] is no filter (parse_qs drops blank values, as in prometheus_client).
    assert agent.request("/metrics?name[]=")[2] == agent.request("/metrics")[2]


def test_metrics_before_first_snapshot(agent: Agent) -> None:
    agent.source.snapshot = None
    status, _, body = agent.request("/metrics")
    assert status == 200
    names = [f.name for f in text_string_to_metric_families(body.decode())]
    assert names == ["gpuscope_build_info", "gpuscope_nvml_up"]


def test_metrics_collector_error_is_a_500_and_the_server_survives(agent: Agent,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def collect(self) -> list[object]:
            raise RuntimeError("boom")

    registry = CollectorRegistry()
    registry.register(Broken())  # type: ignore[arg-type]
    broken = AgentHttpServer("127.0.0.1:0", registry=registry, source=agent.source)
    broken.start()
    try:
        host, port = broken.bound_address
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert response.status == 500
        assert b"boom" not in response.read()
        conn.close()
        assert "boom" in caplog.text
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        broken.stop()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not on PATH (apt install prometheus)")
@pytest.mark.parametrize("include_cmdline", [False, True])
def test_promtool_check_metrics_on_a_real_scrape(include_cmdline: bool) -> None:
    source = FakeSource(snapshot=make_full_snapshot())
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(source, include_cmdline=include_cmdline))
    server = AgentHttpServer("127.0.0.1:0", registry=registry, source=source)
    server.start()
    try:
        status, _, body = Agent(server, source, FakeClock()).request("/metrics")
    finally:
        server.stop()
    assert status == 200
    result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30,
                            check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, b"", b""), result


# -- probes and API ----------------------------------------------------------------------------------


def test_index_page(agent: Agent) -> None:
    status, headers, body = agent.request("/")
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    page = body.decode()
    for link in ("/metrics", "/-/healthy", "/-/ready", "/api/v1/snapshot"):
        assert f'href="{link}"' in page
    assert __version__ in page


def test_healthy(agent: Agent) -> None:
    assert agent.request("/-/healthy")[0::2] == (200, b"OK\n")
    agent.source.alive = False
    status, headers, body = agent.request("/-/healthy")
    assert status == 503
    assert headers["content-type"] == "text/plain; charset=utf-8"
    assert b"no sampling tick completed" in body


def test_ready_when_fresh(agent: Agent) -> None:
    status, headers, body = agent.request("/-/ready")
    assert (status, body) == (200, b"OK\n")
    assert headers["content-type"] == "text/plain; charset=utf-8"


def test_not_ready_before_first_snapshot(agent: Agent) -> None:
    agent.source.snapshot = None
    status, _, body = agent.request("/-/ready")
    assert status == 503
    assert body.count(b"\n") == 1
    assert b"no snapshot" in body


def test_not_ready_when_nvml_is_down(agent: Agent) -> None:
    agent.source.snapshot = fresh_snapshot(nvml_up=False, gpus=())
    status, _, body = agent.request("/-/ready")
    assert status == 503
    assert b"NVML" in body


def test_not_ready_when_stale(agent: Agent) -> None:
    agent.source.interval = 2.0
    agent.clock.now = NOW - 0.5 + 5.9  # 5.9 s old, limit 3 x 2 s
    assert agent.request("/-/ready")[0] == 200
    agent.clock.now = NOW - 0.5 + 6.5
    status, _, body = agent.request("/-/ready")
    assert status == 503
    assert b"6.5 s old" in body
    assert body.count(b"\n") == 1
    # The sampler catches up: ready again.
    agent.source.snapshot = fresh_snapshot(monotonic=agent.clock.now - 0.1)
    assert agent.request("/-/ready")[0] == 200


def test_not_ready_while_fewer_gpus_than_expected_are_readable() -> None:
    """nvml.expected_gpus: a node whose GPUs vanished (or one fell off the bus) must not look ready."""
    clock = FakeClock()
    source = FakeSource(snapshot=fresh_snapshot(gpus=make_gpus(8)))
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=source, clock=clock,
                             expected_gpus=8)
    server.start()
    try:
        agent = Agent(server, source, clock)
        assert agent.request("/-/ready")[0] == 200
        source.snapshot = fresh_snapshot(gpus=make_gpus(6))
        status, _, body = agent.request("/-/ready")
        assert status == 503 and b"6 of the 8 expected GPUs are readable" in body
        lost = [replace(g, up=False) if g.index == 3 else g for g in make_gpus(8)]
        source.snapshot = fresh_snapshot(gpus=lost)
        assert b"7 of the 8 expected" in agent.request("/-/ready")[2]
    finally:
        server.stop()


def test_ready_uses_the_real_monotonic_clock_by_default() -> None:
    source = FakeSource(snapshot=make_snapshot(monotonic=time.monotonic()))
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=source)
    server.start()
    try:
        agent = Agent(server, source, FakeClock())
        assert agent.request("/-/ready")[0] == 200
        source.snapshot = make_snapshot(monotonic=time.monotonic() - 10)
        assert agent.request("/-/ready")[0] == 503
    finally:
        server.stop()


def test_snapshot_json(agent: Agent) -> None:
    snapshot = make_full_snapshot()
    agent.source.snapshot = snapshot
    status, headers, body = agent.request("/api/v1/snapshot")
    assert status == 200
    assert headers["content-type"] == "application/json"
    data = json.loads(body)
    expected = json.loads(json.dumps(snapshot.to_json()))
    for gpu in expected["gpus"]:  # processes.cmdline is off by default: no command line leaves
        for process in gpu["processes"]:
            process["cmdline"] = None
    assert data == expected
    assert any(p.cmdline for gpu in snapshot.gpus for p in gpu.processes)
    assert data["gpus"][0]["xid_errors"] == {"13": 2, "79": 1}
    assert data["gpus"][0]["clock_event_reasons"] == ["hw_slowdown", "sw_power_cap"]


def test_snapshot_json_without_processes_when_not_exported() -> None:
    snapshot = make_full_snapshot()
    assert any(gpu.processes for gpu in snapshot.gpus)
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(),
                             source=FakeSource(snapshot=snapshot), processes=ProcessExposure(export=False))
    server.start()
    try:
        host, port = server.bound_address
        with urllib.request.urlopen(f"http://{host}:{port}/api/v1/snapshot", timeout=10) as response:
            data = json.loads(response.read())
    finally:
        server.stop()
    assert [gpu["processes"] for gpu in data["gpus"]] == [[] for _ in snapshot.gpus]
    assert data["gpus"][0]["uuid"] == snapshot.gpus[0].uuid


def test_snapshot_json_before_first_snapshot(agent: Agent) -> None:
    agent.source.snapshot = None
    status, headers, body = agent.request("/api/v1/snapshot")
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert "no snapshot" in json.loads(body)["error"]


@pytest.mark.parametrize("path", ["/nope", "/metrics/", "/-/", "/api/v1/snapshot/x", "/favicon.ico"])
def test_unknown_path_is_404(agent: Agent, path: str) -> None:
    assert agent.request(path)[0] == 404


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "PATCH"])
@pytest.mark.parametrize("path", ["/metrics", "/-/ready", "/"])
def test_other_methods_are_405(agent: Agent, method: str, path: str) -> None:
    status, headers, _ = agent.request(path, method=method)
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


def test_requests_are_not_logged_to_stderr(agent: Agent, capfd: pytest.CaptureFixture[str]) -> None:
    for path in ("/metrics", "/-/ready", "/nope"):
        agent.request(path)
    assert capfd.readouterr().err == ""


# -- listening ---------------------------------------------------------------------------------------


def test_bad_listen_address_rejected_by_the_constructor() -> None:
    with pytest.raises(ValueError, match="'9847'"):
        AgentHttpServer("9847", registry=CollectorRegistry(), source=FakeSource())


def test_port_zero_binds_a_real_port(agent: Agent) -> None:
    host, port = agent.server.bound_address
    assert host == "127.0.0.1"
    assert 0 < port < 65536


def test_localhost(agent: Agent) -> None:
    server = AgentHttpServer("localhost:0", registry=CollectorRegistry(), source=agent.source)
    server.start()
    try:
        host, _ = server.bound_address
        assert host in ("127.0.0.1", "::1")
        assert Agent(server, agent.source, agent.clock).request("/-/healthy")[0] == 200
    finally:
        server.stop()


def _ipv6_loopback_available() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback_available(), reason="no IPv6 loopback on this machine")
def test_ipv6_loopback(agent: Agent) -> None:
    server = AgentHttpServer("[::1]:0", registry=CollectorRegistry(), source=agent.source)
    server.start()
    try:
        assert server.bound_address[0] == "::1"
        assert Agent(server, agent.source, agent.clock).request("/-/healthy")[0] == 200
    finally:
        server.stop()


def test_address_in_use_raises_listen_error_naming_the_address(agent: Agent) -> None:
    _, port = agent.server.bound_address
    address = f"127.0.0.1:{port}"
    second = AgentHttpServer(address, registry=CollectorRegistry(), source=agent.source)
    with pytest.raises(ListenError, match=re.escape(f"cannot listen on '{address}'")) as excinfo:
        second.start()
    assert isinstance(excinfo.value, OSError)
    assert excinfo.value.errno is not None
    with pytest.raises(RuntimeError):
        _ = second.bound_address


def test_unresolvable_host_raises_listen_error() -> None:
    server = AgentHttpServer("no-such-host.invalid:0", registry=CollectorRegistry(), source=FakeSource())
    with pytest.raises(ListenError, match=re.escape("'no-such-host.invalid:0'")):
        server.start()


def test_stop_closes_the_socket_promptly(agent: Agent) -> None:
    host, port = agent.server.bound_address
    started = time.monotonic()
    agent.server.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), timeout=TIMEOUT):
        pass
    agent.server.stop()  # idempotent


def test_start_twice_is_an_error(agent: Agent) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        agent.server.start()


def test_restart_after_stop_on_the_same_port(agent: Agent) -> None:
    _, port = agent.server.bound_address
    agent.server.stop()
    again = AgentHttpServer(f"127.0.0.1:{port}", registry=CollectorRegistry(), source=agent.source)
    again.start()
    try:
        assert again.bound_address[1] == port
    finally:
        again.stop()


def test_slow_request_does_not_block_others(agent: Agent) -> None:
    host, port = agent.server.bound_address
    with socket.create_connection((host, port), timeout=TIMEOUT) as idle:
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finishes its headers
        started = time.monotonic()
        assert agent.request("/-/healthy")[0] == 200
        assert time.monotonic() - started < 1.0


# -- /api/v1/alerts ----------------------------------------------------------------------------------


@dataclass
class FakeAlertSource:
    """An AlertSource whose alerts the test sets."""

    current: list[Alert]

    def alerts(self) -> list[Alert]:
        return list(self.current)

    def transition_counts(self) -> Mapping[tuple[str, TransitionState], int]:
        return {}


def make_alert(name: str, gpu: int, state: AlertState, **values: float) -> Alert:
    return Alert(name=name, gpu=gpu, uuid=f"GPU-{gpu:08d}", severity="warning", state=state,
                 hostname="node-1", active_since=1_700_000_000.0,
                 firing_since=1_700_000_120.0 if state == "firing" else None,
                 values=values, summary=f"{name} on GPU {gpu}", labels={"laggard": "true"})


@pytest.fixture
def alerting_agent(agent: Agent) -> Iterator[tuple[Agent, FakeAlertSource]]:
    alerts = FakeAlertSource([])
    server = AgentHttpServer("127.0.0.1:0", registry=CollectorRegistry(), source=agent.source, alerts=alerts)
    server.start()
    try:
        yield Agent(server, agent.source, agent.clock), alerts
    finally:
        server.stop()


def test_alerts_json_when_alerting_is_disabled(agent: Agent) -> None:
    status, headers, body = agent.request("/api/v1/alerts")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"enabled": False, "alerts": []}


def test_alerts_json_lists_pending_and_firing_alerts(alerting_agent: tuple[Agent, FakeAlertSource]) -> None:
    agent, source = alerting_agent
    assert json.loads(agent.request("/api/v1/alerts")[2]) == {"enabled": True, "alerts": []}
    source.current = [make_alert("GpuLowUtilization", 1, "firing", mean_utilization=0.55),
                      make_alert("GpuSharedByProcesses", 2, "pending", processes=3.0)]
    status, headers, body = agent.request("/api/v1/alerts")
    assert status == 200
    assert headers["content-type"] == "application/json"
    data = json.loads(body)
    assert data == {"enabled": True, "alerts": [a.to_json() for a in source.current]}
    assert data["alerts"][0]["alertname"] == "GpuLowUtilization"
    assert data["alerts"][0]["values"] == {"mean_utilization": 0.55}
    assert data["alerts"][1]["state"] == "pending"
    assert data["alerts"][1]["firing_since"] is None


def test_alerts_json_non_finite_values_are_null(alerting_agent: tuple[Agent, FakeAlertSource]) -> None:
    agent, source = alerting_agent
    source.current = [make_alert("GpuUtilizationSkew", 0, "firing", spread=float("nan"), peak=float("inf"),
                                 mean=0.5)]
    status, _, body = agent.request("/api/v1/alerts")
    assert status == 200
    assert b"NaN" not in body and b"Infinity" not in body  # strict JSON parsers reject those
    assert json.loads(body)["alerts"][0]["values"] == {"spread": None, "peak": None, "mean": 0.5}


def test_alerts_json_head_and_methods(alerting_agent: tuple[Agent, FakeAlertSource]) -> None:
    agent, source = alerting_agent
    source.current = [make_alert("GpuThrottled", 0, "firing")]
    status, headers, body = agent.request("/api/v1/alerts", method="HEAD")
    assert (status, body) == (200, b"")
    assert int(headers["content-length"]) == len(agent.request("/api/v1/alerts")[2])
    status, headers, _ = agent.request("/api/v1/alerts", method="POST")
    assert status == 405
    assert headers["allow"] == "GET, HEAD"
    assert agent.request("/api/v1/alerts/x")[0] == 404


def test_alerts_json_source_error_is_500_without_details(alerting_agent: tuple[Agent, FakeAlertSource],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    agent, source = alerting_agent

    def broken() -> list[Alert]:
        raise RuntimeError("engine exploded")

    source.alerts = broken  # type: ignore[method-assign]
    status, _, body = agent.request("/api/v1/alerts")
    assert status == 500
    assert b"exploded" not in body
    assert "exploded" in caplog.text


def test_index_page_links_the_alerts(agent: Agent) -> None:
    assert b'href="/api/v1/alerts"' in agent.request("/")[2]


class _CountingConnection:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.writes.append(bytes(data))


@pytest.mark.parametrize("body", [[b"first part, ", b"second part"], [b"one part"], [], iter([b"a", b"b"])])
def test_a_response_goes_out_with_its_head_in_one_write(body: Any) -> None:
    """The status line and headers are sent with the body's first part (or alone, without a body):
    one trip through the network stack for a scrape, not one per header."""
    from gpuscope.web import http_connection

    parts = list(body) if not isinstance(body, list) else body
    replay = iter(parts) if not isinstance(body, list) else body

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return replay

    connection = _CountingConnection()
    http_connection._Response(connection).run(app, {"REQUEST_METHOD": "GET"})  # type: ignore[arg-type]
    assert len(connection.writes) == max(len(parts), 1)
    head, _, first = connection.writes[0].partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.0 200 OK"
    assert "Content-Type: text/plain" in lines and "Server: gpuscope" in lines
    assert any(re.fullmatch(r"Date: \w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", line) for line in lines)
    if isinstance(body, list):  # known in full: its length is said
        assert f"Content-Length: {sum(map(len, parts))}" in lines
    assert first + b"".join(connection.writes[1:]) == b"".join(parts)


def test_an_application_that_fails_before_answering_gets_a_500_and_the_details_stay_in_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    from gpuscope.web import http_connection

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        raise RuntimeError("secret detail")

    connection = _CountingConnection()
    http_connection._Response(connection).run(app, {"REQUEST_METHOD": "GET", "PATH_INFO": "/x"})  # type: ignore[arg-type]
    (response,) = connection.writes
    assert response.startswith(b"HTTP/1.0 500 Internal Server Error\r\n")
    assert b"secret" not in response and "secret detail" in caplog.text
