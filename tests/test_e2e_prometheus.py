"""End to end: a real Prometheus server scrapes `gpuscope run --simulate skew` on loopback.

Prometheus (Debian package `prometheus`, installed by scripts/test.sh) asks for OpenMetrics first, so
a successful scrape also proves that format parses in the real server.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from agent_process import RunningAgent, free_port, http_get, run_agent, run_ready_server

pytestmark = pytest.mark.e2e

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def require(binary: str | None, name: str) -> str:
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; scripts/test.sh installs it from Debian's packages")
        pytest.skip(f"{name} is not installed (scripts/test.sh installs it)")
    return binary


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, promql: str) -> list[dict[str, Any]]:
        status, body = http_get(f"{self.base}/api/v1/query?query={urllib.parse.quote(promql)}")
        assert status == 200, body
        data = json.loads(body)
        assert data["status"] == "success", data
        result: list[dict[str, Any]] = data["data"]["result"]
        return result

    def wait_for(self, promql: str, count: int = 1, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if len(result) >= count:
                return result
            time.sleep(0.5)
        raise AssertionError(f"{promql!r}: {len(result)} series after {timeout} s, wanted {count}: {result}")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[RunningAgent]:
    with run_agent(tmp_path, "--simulate", "skew", "--sample-interval", "500ms") as running:
        yield running


@contextmanager
def run_prometheus(directory: Path, config_text: str) -> Iterator[Prometheus]:
    """A Prometheus on a free loopback port with this configuration until the block ends."""
    binary = require(PROMETHEUS, "prometheus")
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    config.write_text(config_text)
    port = free_port()
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    log_path = directory / "prometheus.log"
    with run_ready_server(argv, f"http://127.0.0.1:{port}", log_path, "prometheus") as base:
        yield Prometheus(base)


def scrape_config(agent: RunningAgent) -> str:
    """Scrape and evaluate every second; the agent as job "gpuscope"."""
    return ("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            f"  - job_name: gpuscope\n    static_configs:\n      - targets: ['127.0.0.1:{agent.port}']\n")


@pytest.fixture
def prometheus(tmp_path: Path, agent: RunningAgent) -> Iterator[Prometheus]:
    with run_prometheus(tmp_path, scrape_config(agent)) as server:
        yield server


def value(series: dict[str, Any]) -> float:
    return float(series["value"][1])


def test_prometheus_scrapes_the_agent_and_sees_the_simulated_node(prometheus: Prometheus) -> None:
    (up,) = prometheus.wait_for('up{job="gpuscope"} == 1')
    assert value(up) == 1.0
    assert value(prometheus.wait_for("gpuscope_nvml_up")[0]) == 1.0
    util = prometheus.wait_for("gpu_utilization_ratio", count=4)
    by_gpu = {s["metric"]["gpu"]: value(s) for s in util}
    # The skew scenario: GPU 0 near 0.98, the other three near 0.62.
    assert by_gpu["0"] > 0.9
    assert all(0.45 < by_gpu[g] < 0.8 for g in ("1", "2", "3")), by_gpu
    assert all(s["metric"]["uuid"].startswith("GPU-") for s in util)

    info = prometheus.wait_for("gpu_process_info", count=4)
    assert sorted(s["metric"]["process"] for s in info) == [f"train-rank{i}" for i in range(4)]
    assert all("cmdline" not in s["metric"] for s in info)  # not exported unless opted in

    memory_series = prometheus.wait_for("gpu_process_memory_used_bytes", 4)
    memory = {s["metric"]["gpu"]: value(s) for s in memory_series}
    assert memory["0"] == 66 * 2**30

    # Counters behave as counters across scrapes: energy grows at about the power draw.
    prometheus.wait_for("count_over_time(gpu_energy_joules_total[10s]) >= 6", count=4)
    rate = prometheus.query("rate(gpu_energy_joules_total[10s])")
    power = {s["metric"]["gpu"]: value(s) for s in prometheus.query("gpu_power_watts")}
    for s in rate:
        assert 0.5 * power[s["metric"]["gpu"]] < value(s) < 1.5 * power[s["metric"]["gpu"]]

    # Absent, not zero: this scenario's H100s have ECC, so the counter exists and is 0; no series
    # that the simulated GPUs do not support appears (e.g. none of these GPUs has MIG, none is lost).
    assert {value(s) for s in prometheus.query("gpu_up")} == {1.0}
    assert len(prometheus.query("gpu_ecc_uncorrected_errors_total")) == 4


def test_promtool_accepts_a_real_scrape(agent: RunningAgent, tmp_path: Path) -> None:
    binary = require(PROMTOOL, "promtool")
    body = agent.wait_for("/metrics", "gpu_process_info{")
    result = subprocess.run([binary, "check", "metrics"], input=body, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""  # no lint warnings either


def test_prometheus_scrapes_over_tls_with_basic_auth_and_fails_without(tmp_path: Path) -> None:
    """The agent with a web configuration file (TLS, a bcrypt user): Prometheus's job with the CA and
    the password is up; the same target without the password, or over plain HTTP, is down."""
    import bcrypt
    from pki import make_pki

    pki = make_pki(tmp_path / "pki")
    password_file = tmp_path / "password"
    password_file.write_text("scrape-password-42")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                   "basic_auth_users:\n"
                   f"  prometheus: {bcrypt.hashpw(b'scrape-password-42', bcrypt.gensalt(4)).decode()}\n")
    with run_agent(tmp_path, "--simulate", "skew", "--web.config.file", str(web), tls=pki.ca,
                   user=("prometheus", "scrape-password-42")) as agent:
        target = f"['127.0.0.1:{agent.port}']"
        tls = f"tls_config: {{ca_file: {json.dumps(str(pki.ca))}}}"
        config = ("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                  f"  - job_name: secured\n    scheme: https\n    {tls}\n"
                  "    basic_auth: {username: prometheus, password_file: "
                  f"{json.dumps(str(password_file))}}}\n"
                  f"    static_configs: [{{targets: {target}}}]\n"
                  f"  - job_name: no_password\n    scheme: https\n    {tls}\n"
                  f"    static_configs: [{{targets: {target}}}]\n"
                  f"  - job_name: plain_http\n    static_configs: [{{targets: {target}}}]\n")
        with run_prometheus(tmp_path / "prometheus", config) as prometheus:
            prometheus.wait_for('up{job="secured"} == 1')
            prometheus.wait_for('gpu_up{job="secured"}', count=4)
            prometheus.wait_for('up{job=~"no_password|plain_http"} == 0', count=2)
            body = http_get(prometheus.base + "/api/v1/targets")[1]
            errors = {t["labels"]["job"]: t["lastError"] for t in json.loads(body)["data"]["activeTargets"]}
            assert errors["secured"] == "" and "401" in errors["no_password"], errors
            assert errors["plain_http"], errors
            assert prometheus.query('gpu_up{job!="secured"}') == []
