"""The `gpuscope` command as a user runs it: exit codes, messages, whole-process behaviour."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from agent_process import run_agent


def gpuscope(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope", *args],
                          capture_output=True, text=True, check=False, timeout=timeout)


def test_config_check_accepts_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.yml"
    path.write_text("sample_interval: 500ms\nprocesses:\n  cmdline: false\n")
    result = gpuscope("config", "check", str(path))
    assert result.returncode == 0
    assert "OK" in result.stdout


def test_config_check_lists_every_problem_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("sample_interval: soon\nweb:\n  port: 1\nidle_dips:\n  threshold: 1.5\n")
    result = gpuscope("config", "check", str(path))
    assert result.returncode == 2
    assert "sample_interval:" in result.stderr
    assert "web.port: unknown key" in result.stderr
    assert "idle_dips.threshold:" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_refuses_bad_config_without_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.yml"
    path.write_text("sample_interval: -1\n")
    result = gpuscope("run", "--config", str(path), timeout=30)
    assert result.returncode == 2
    assert "sample_interval" in result.stderr and "Traceback" not in result.stderr


def test_run_refuses_a_bad_flag_value() -> None:
    result = gpuscope("run", "--sample-interval", "often", timeout=30)
    assert result.returncode == 2 and "often" in result.stderr


def test_unknown_scenario_names_the_bundled_ones() -> None:
    result = gpuscope("snapshot", "--simulate", "no-such-node", timeout=30)
    assert result.returncode == 2
    assert "demo" in result.stderr and "healthy" in result.stderr and "Traceback" not in result.stderr


def test_scenarios_lists_the_bundled_scenarios() -> None:
    listed = gpuscope("scenarios").stdout.split()
    for name in ("demo", "healthy", "input-bound", "shared-gpu", "skew", "gpu-lost"):
        assert name in listed


def test_snapshot_table_shows_gpus_then_processes() -> None:
    result = gpuscope("snapshot", "--simulate", "shared-gpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.index("NAME") < out.index("PID")  # GPU table first, then processes
    assert "NVIDIA" in out and "compute" in out


def test_snapshot_json_is_the_snapshot() -> None:
    result = gpuscope("snapshot", "--simulate", "healthy", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["nvml_up"] is True and len(data["gpus"]) == 4
    gpu = data["gpus"][0]
    assert gpu["up"] and gpu["memory_total_bytes"] > 0 and gpu["processes"][0]["name"] == "train-rank0"


def test_run_without_a_driver_serves_nvml_down_with_one_hint(tmp_path: Path) -> None:
    # This machine has no NVIDIA driver: the real pynvml fails to load libnvidia-ml.so.1.
    with run_agent(tmp_path, "--sample-interval", "200ms") as agent:
        status, body = agent.get("/metrics")
        assert status == 200 and "gpuscope_nvml_up 0.0" in body and "gpuscope_build_info{" in body
        assert "gpu_up" not in body.replace("gpuscope_nvml_up", "")
        assert agent.get("/-/healthy")[0] == 200
        status, reason = agent.get("/-/ready")
        assert status == 503 and "NVML" in reason
        time.sleep(1.0)  # several ticks, several retries
        assert agent.stderr().count("NVML is not available") == 1


def test_busy_port_is_a_clear_startup_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gpuscope("run", "--web.listen-address", f"127.0.0.1:{port}", timeout=30)
    assert result.returncode != 0
    assert str(port) in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("cannot listen") == 1, result.stderr  # said once, not wrapped twice


def test_sigterm_stops_cleanly_within_two_seconds_and_reaps_helpers(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        agent.wait_for("/metrics", 'gpu_process_info{')
        helpers = [c for c in psutil.Process(agent.proc.pid).children() if c.is_running()]
        assert len(helpers) == 4  # the scenario's spawned processes
        agent.proc.send_signal(signal.SIGTERM)
        # The contract: a clean stop within 2 s of SIGTERM.
        assert agent.proc.wait(timeout=2.0) == 0
        _gone, alive = psutil.wait_procs(helpers, timeout=2.0)
        assert not alive
        assert "Traceback" not in agent.stderr()


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:99999", "[::1"])
def test_bad_listen_address_is_refused(address: str) -> None:
    result = gpuscope("run", "--web.listen-address", address, timeout=30)
    assert result.returncode == 2, result.stderr
    assert address in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("text", "expected"), [
    # A port out of range: refused by `config check`, not first by `run`.
    ('web:\n  listen_address: ":99999"\n',
     "web.listen_address: invalid address ':99999': the port must be a number from 0 to 65535"),
    # The bad value is named once.
    ("sample_interval: fast\n",
     "sample_interval: expected a duration such as 1.5, '500ms' or '2m', got 'fast'"),
    # A duration no timer can wait for is refused here, not by the thread that would wait.
    # An empty path would only be found out by `run`.
    ('alerting:\n  event_log:\n    path: ""\n',
     "alerting.event_log.path: String should have at least 1 character (got '')"),
    ("alerting:\n  alertmanager:\n    resend_interval: 1e12\n",
     "alerting.alertmanager.resend_interval: Input should be less than or equal to 86400 "
     "(got 1000000000000.0)"),
])
def test_config_check_refuses_with_the_key_path(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yml"
    path.write_text(text)
    result = gpuscope("config", "check", str(path))
    assert result.returncode == 2, result.stdout
    assert result.stderr.splitlines()[1:] == [f"  {expected}"], result.stderr


def test_snapshot_is_taken_with_the_agents_wiring_pods_included() -> None:
    """`snapshot` samples the node as `run` does: on the demo node its simulated kubelet names pods."""
    result = gpuscope("snapshot", "--simulate", "demo", "--json")
    assert result.returncode == 0, result.stderr
    pods = [pod for gpu in json.loads(result.stdout)["gpus"] for pod in gpu["pods"]]
    assert pods and all(pod["namespace"] and pod["pod"] for pod in pods), pods


def test_a_running_agent_reports_each_source_it_runs(tmp_path: Path) -> None:
    """nvml, processes, pods (the demo node's simulated kubelet), alerts and captures (its worker)."""
    with run_agent(tmp_path, "--simulate", "demo", "--sample-interval", "200ms") as agent:
        agent.wait_for("/metrics", 'gpuscope_collector_success{collector="pods"}')
        body = agent.wait_for("/metrics", 'gpuscope_collector_duration_seconds{collector="alerts"}')
    success = {source: float(value) for source, value in
               re.findall(r'gpuscope_collector_success\{collector="(\w+)"\} (\S+)', body)}
    assert set(success) == {"nvml", "processes", "pods", "alerts", "captures"}, body
    assert success["nvml"] == success["alerts"] == success["captures"] == 1.0
    durations = set(re.findall(r'gpuscope_collector_duration_seconds\{collector="(\w+)"\}', body))
    assert durations == {"nvml", "processes", "pods", "alerts"}  # no capture has run yet


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize(("content", "environment", "expected"), [
    (b"sample_interval: 1\nnode_name: \xff\xfe\n", {},
     "not UTF-8 text: byte 0xff at offset 30 cannot be decoded"),
    (b"", {"GPUSCOPE_SAMPLE_INTERVALL": "5"}, "GPUSCOPE_SAMPLE_INTERVALL: names no setting (a typo?)"),
    (b"", {"GPUSCOPE_CAPTURE__TARGETS": "[{bad"}, "GPUSCOPE_CAPTURE__TARGETS: a section or a list is written "
                                                 "as JSON here"),
    (b"", {"GPUSCOPE_WEB": "listen_address=:1"}, "GPUSCOPE_WEB: a section or a list is written as JSON here"),
    (b"x: " + b"y" * (1 << 20), {}, "the file is larger than 1.0 MiB"),
])
def test_configuration_edge_cases_exit_2_naming_the_problem(
        tmp_path: Path, command: str, content: bytes, environment: dict[str, str], expected: str) -> None:
    path = tmp_path / "gpuscope.yml"
    path.write_bytes(content)
    args = ["config", "check", str(path)] if command == "check" else ["run", "--config", str(path)]
    result = subprocess.run([sys.executable, "-m", "gpuscope", *args], capture_output=True, text=True,
                            check=False, timeout=60, env={**os.environ, **environment})
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_every_setting_can_come_from_its_variable(tmp_path: Path) -> None:
    """Aliased keys (`for`), sections and lists as JSON, upper or lower case: all taken, env over file."""
    path = tmp_path / "gpuscope.yml"
    path.write_text("alerting:\n  rules:\n    GpuLowUtilization:\n      for: 10m\n")
    environment = {"GPUSCOPE_ALERTING__RULES__GPULOWUTILIZATION__FOR": "30s",
                   "GPUSCOPE_CAPTURE__PROFILER_PORTS": "[6009, 9012]",
                   "gpuscope_web": '{"listen_address": ":9999"}'}
    code = ("from pathlib import Path; from gpuscope.config import load_settings; import sys; "
            "s = load_settings(Path(sys.argv[1])); "
            "print(s.alerting.rules.GpuLowUtilization.for_, s.capture.profiler_ports, s.web.listen_address)")
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                            check=False, timeout=60, env={**os.environ, **environment})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["30.0", "[6009,", "9012]", ":9999"]


def test_a_hanging_gpu_is_down_while_the_others_report(tmp_path: Path) -> None:
    """The whole agent: GPU 1's NVML calls hang from 1 s to 60 s; within seconds /metrics shows it down
    and counted, GPU 0 still reporting, and the agent healthy."""
    scenario = tmp_path / "hanging.yaml"
    scenario.write_text("""
name: hanging
gpus:
  - {utilization: 0.9}
  - {utilization: 0.9, failures: [{function: nvmlDeviceGetPowerUsage, from: 1s, to: 60s, error: hang}]}
loop: false
""")
    config = tmp_path / "gpuscope.yml"
    config.write_text("watchdog: {stuck_after: 1s}\n")
    with run_agent(tmp_path, "--simulate", str(scenario), "--config", str(config),
                   "--sample-interval", "200ms") as agent:
        body = agent.wait_for("/metrics", "gpuscope_nvml_stuck_calls_total 1.0")
        assert 'gpu_up{gpu="1",uuid=' in body and re.search(r'gpu_up\{gpu="1",uuid="[^"]+"\} 0\.0', body)
        assert re.search(r'gpu_power_watts\{gpu="0",uuid="[^"]+"\} \d', body)
        assert not re.search(r'gpu_power_watts\{gpu="1"', body)
        assert agent.get("/-/healthy")[0] == 200
        started = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        agent.proc.wait(timeout=10)
        assert time.monotonic() - started < 2.0, "SIGTERM with a stuck NVML call"
