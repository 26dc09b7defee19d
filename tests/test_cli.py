"""The `gpuscope` command as a user runs it: exit codes, messages, whole-process behaviour."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from agent_process import free_port, run_agent


def gpuscope(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpuscope", *args], env=env,
                          capture_output=True, text=True, check=False, timeout=timeout)


def own_paths(tmp_path: Path) -> dict[str, str]:
    """The environment with every file the agent keeps under ``tmp_path``: what an agent or a demo
    run earlier on this machine left in the default places must not show in the test's output."""
    return {**os.environ, "GPUSCOPE_CAPTURE__STORE__ROOT": str(tmp_path / "captures"),
            "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "control.sock")}


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


def test_scenarios_says_what_each_one_shows_on_one_line() -> None:
    from gpuscope.simulate import bundled_scenarios, load_scenario

    result = gpuscope("scenarios")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == bundled_scenarios()
    for line, name in zip(lines, bundled_scenarios(), strict=True):
        description = load_scenario(name).description
        # Short enough to read in a list: one line each, not a paragraph.
        assert description and "\n" not in description.strip(), name
        assert len(description) <= 150, (name, description)
        assert line.split(None, 1)[1] == description, line
    as_json = gpuscope("scenarios", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == [{"name": name, "description": load_scenario(name).description}
                                          for name in bundled_scenarios()]


def _actions_without_help(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    for action in parser._actions:
        if not action.help or action.help == argparse.SUPPRESS:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"
        if isinstance(action, argparse._SubParsersAction):
            helped = {choice.dest for choice in action._choices_actions if choice.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    yield f"{path} {name} (the command)"
                yield from _actions_without_help(sub, f"{path} {name}")


def test_every_command_and_argument_has_help_text() -> None:
    from gpuscope.cli.main import build_parser

    parser = build_parser()
    assert list(_actions_without_help(parser, "gpuscope")) == []
    # The walk reaches every level: the commands, `config check`, `captures get`.
    walked = [action.choices for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    assert {"run", "snapshot", "config", "scenarios", "capture", "captures"} <= set(walked[0])


def test_snapshot_takes_its_log_level() -> None:
    quiet = gpuscope("snapshot", "--simulate", "healthy", "--json")
    loud = gpuscope("snapshot", "--simulate", "healthy", "--json", "--log-level", "debug")
    assert quiet.returncode == loud.returncode == 0, loud.stderr
    assert " DEBUG " not in quiet.stderr and " DEBUG " in loud.stderr


def test_snapshot_table_shows_gpus_then_processes() -> None:
    result = gpuscope("snapshot", "--simulate", "shared-gpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.index("NAME") < out.index("PID")  # GPU table first, then processes
    assert "NVIDIA" in out and "compute" in out


def test_snapshot_without_nvml_suggests_a_simulated_node(tmp_path: Path) -> None:
    # This machine has no NVIDIA driver, and nothing listens where this command's settings look.
    env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{free_port()}",
           "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "none.sock")}
    result = subprocess.run([sys.executable, "-m", "gpuscope", "snapshot"], capture_output=True, text=True,
                            check=False, timeout=60, env=env)
    assert result.returncode == 1
    assert "NVML is not available" in result.stdout
    assert "--simulate NAME" in result.stderr and "gpuscope scenarios" in result.stderr
    assert "agent" not in result.stderr and "Traceback" not in result.stderr


def test_snapshot_without_nvml_names_the_running_agents_snapshot(tmp_path: Path) -> None:
    """A running agent answers `gpuscope snapshot`, by HTTP or by its control socket: its snapshot is
    printed (here its simulated node, though this machine has no driver) and stderr says whose it is."""
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{agent.port}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "none.sock")}
        by_http = subprocess.run([sys.executable, "-m", "gpuscope", "snapshot"], capture_output=True,
                                 text=True, check=False, timeout=60, env=env)
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{free_port()}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / f"control-{agent.port}.sock")}  # run_agent's
        by_socket = subprocess.run([sys.executable, "-m", "gpuscope", "snapshot"], capture_output=True,
                                   text=True, check=False, timeout=60, env=env)
    assert by_http.returncode == 0, by_http.stderr
    assert f"snapshot of the running agent at http://127.0.0.1:{agent.port} (node " in by_http.stderr
    assert by_socket.returncode == 0, by_socket.stderr
    assert f"snapshot of the running agent at control socket {tmp_path}/control-{agent.port}.sock (node " \
        in by_socket.stderr and "simulating healthy" in by_socket.stderr
    for result in (by_http, by_socket):
        assert "4 GPU(s)" in result.stdout and "NVIDIA" in result.stdout and "train-rank0" in result.stdout
        assert "NVML is not available" not in result.stdout and "--simulate NAME" not in result.stderr
        assert "Traceback" not in result.stderr


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
        result = gpuscope("run", "--web.listen-address", f"127.0.0.1:{port}", timeout=30,
                          env=own_paths(tmp_path))
    assert result.returncode != 0
    assert str(port) in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("cannot listen") == 1, result.stderr  # said once, not wrapped twice
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "another gpuscope" in result.stderr and "--web.listen-address" in result.stderr  # what to do


def test_sigterm_stops_cleanly_within_two_seconds_and_reaps_helpers(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        agent.wait_for("/metrics", 'gpu_process_info{')
        helpers = [c for c in psutil.Process(agent.proc.pid).children() if c.is_running()]
        assert len(helpers) == 4  # the scenario's spawned processes
        agent.proc.send_signal(signal.SIGTERM)
        # The documented contract (docs/deploy.md): a clean stop within 2 s of SIGTERM.
        assert agent.proc.wait(timeout=2.0) == 0
        _gone, alive = psutil.wait_procs(helpers, timeout=2.0)
        assert not alive
        assert "Traceback" not in agent.stderr()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_idle_main_thread_wakes_for_sigterm_and_sigint(tmp_path: Path, signum: signal.Signals) -> None:
    """The main thread sleeps until a signal comes, waking only for the watchdog's rounds (here once a
    minute): each of the two still stops the agent within 2 s, however long it has been serving."""
    with run_agent(tmp_path, "--simulate", "demo", env={"GPUSCOPE_WATCHDOG__STUCK_AFTER": "60s"}) as agent:
        agent.wait_for("/metrics", "gpu_up{")
        main_thread = Path(f"/proc/{agent.proc.pid}/task/{agent.proc.pid}/status")

        def switches() -> int:
            return sum(int(line.split()[1]) for line in main_thread.read_text().splitlines()
                       if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))

        before = switches()
        time.sleep(2.5)  # the main thread long asleep: a timer of a second would have woken it twice
        assert switches() - before <= 1
        started = time.monotonic()
        agent.proc.send_signal(signum)
        assert agent.proc.wait(timeout=5.0) == 0
        assert time.monotonic() - started < 2.0
        assert f"received {signum.name}, stopping" in agent.stderr() and "Traceback" not in agent.stderr()


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


def test_snapshot_table_and_json_name_the_slurm_job() -> None:
    from snapshots import make_full_snapshot

    from gpuscope.cli.snapshot import format_snapshot

    snapshot = make_full_snapshot()
    table = format_snapshot(snapshot).splitlines()
    header = next(line for line in table if line.startswith("GPU  PID"))
    assert header.split()[-1] == "JOB"
    row = next(line for line in table if line.split()[:2] == ["0", "6060"])
    assert row.split()[-1] == "4242.0"
    assert next(line for line in table if line.split()[:2] == ["0", "4242"]).split()[-1] == "-"
    processes = json.loads(json.dumps(snapshot.to_json()))["gpus"][0]["processes"]
    expected = {"job_id": "4242", "step": "0", "uid": 1000}
    assert [p["slurm_job"] for p in processes if p["pid"] == 6060] == [expected]


def test_snapshot_table_lists_mig_devices_under_their_gpu_and_the_health_state() -> None:
    from dataclasses import replace

    from snapshots import make_gpu, make_mig_gpu, make_snapshot, mig_uuid

    from gpuscope.cli.snapshot import format_snapshot

    mig = make_mig_gpu(2)
    gpus = [make_gpu(0, row_remap_pending=True), make_gpu(1, row_remap_failed=True), mig,
            make_gpu(3, up=False, processes=())]
    snapshot = make_snapshot(gpus=gpus, monotonic=10.5)
    # Half a second earlier the first MIG device's busy-seconds were 0.3 lower; the second had none yet.
    first, second = mig.mig_devices
    earlier = replace(mig, mig_devices=(replace(first, busy_seconds_total=812.2),
                                        replace(second, busy_seconds_total=None)))
    previous = make_snapshot(gpus=[gpus[0], gpus[1], earlier, gpus[3]], monotonic=10.0)
    table = format_snapshot(snapshot, previous=previous).splitlines()
    header = table[2].split()
    assert header[-2:] == ["STATE", "POD"]
    rows = {line.split()[0]: line for line in table[3:9] if not line.startswith(" ")}
    assert "RESET REQUIRED, up" in rows["0"] and "REPLACE, up" in rows["1"]
    assert rows["3"].split()[-2] == "LOST"
    assert table[5].split()[:7] == ["2", "NVIDIA", "H100", "80GB", "HBM3", "-", "-"]  # MIG: no utilization
    device_rows = table[6:8]
    assert [row.split()[:6] for row in device_rows] == [  # under their GPU
        ["MIG", "3g.40gb", "GI", "1", "CI", "0"], ["MIG", "3g.40gb", "GI", "2", "CI", "0"]]
    # busy share over the half second, SM activity, memory, processes on it, UUID, pods
    pod = "research/finetune-7/trainer"
    first_row, second_row = (row.split()[6:] for row in device_rows)
    assert first_row == ["60%", "62%", "21.0/40", "GiB", "-", "-", "1", "-", mig_uuid(2, 0), pod]
    assert second_row == ["0%", "0%", "0.0/40", "GiB", "-", "-", "0", "-", mig_uuid(2, 1), "-"]
    assert table[8].startswith("3 ")
    # Without the tick before, no busy share.
    assert format_snapshot(snapshot).splitlines()[6].split()[6] == "-"
    # JSON: the MIG devices and the health, as Snapshot.to_json gives them.
    data = json.loads(json.dumps(snapshot.to_json()))
    assert [g["health"] for g in data["gpus"]] == ["reset_required", "replace", "ok", "lost"]
    assert [g["health_reasons"] for g in data["gpus"]] == [
        ["a remapped memory row waits for a GPU reset"], ["a memory row could not be remapped"], [],
        ["the GPU cannot be read"]]
    assert [m["uuid"] for m in data["gpus"][2]["mig_devices"]] == [mig_uuid(2, 0), mig_uuid(2, 1)]


def test_snapshot_table_of_a_simulated_mig_node() -> None:
    result = gpuscope("snapshot", "--simulate", "mig")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    devices = [line.split() for line in lines if line.startswith("       MIG ")]
    assert [d[1] for d in devices] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    assert devices[2][-1] == "research/notebook-alice/jupyter"
    assert all(d[6].endswith("%") for d in devices)  # a busy share over the half second


H100_TRACE = Path(__file__).parent / "fixtures" / "traces" / "h100" / "deep_narrow_mlp.pt.trace.json.gz"


@pytest.mark.parametrize("args", [("scenarios", "--json"), ("scenarios",), ("--help",),
                                  ("explain", "--json", str(H100_TRACE)), ("explain", str(H100_TRACE))])
def test_a_reader_that_went_away_ends_the_command_without_a_traceback(args: tuple[str, ...]) -> None:
    """`gpuscope … | head`: the pipe's reader is gone before the command writes (its read end is
    closed at once), so every write fails; the command ends as one killed by SIGPIPE would, quietly."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, "-m", "gpuscope", *args], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode in (0, 128 + signal.SIGPIPE), (result.returncode, result.stderr)


def test_snapshot_json_of_the_running_agent(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{agent.port}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "none.sock")}
        result = gpuscope("snapshot", "--json", env=env)
        served = json.loads(agent.get("/api/v1/snapshot")[1])
    assert result.returncode == 0, result.stderr
    assert f"snapshot of the running agent at http://127.0.0.1:{agent.port}" in result.stderr
    data = json.loads(result.stdout)
    assert data["nvml_up"] is True and len(data["gpus"]) == 4 and data["hostname"] == served["hostname"]
    assert data["gpus"][0]["processes"][0]["name"] == "train-rank0" and "health" in data["gpus"][0]


def test_snapshot_on_all_interfaces_asks_the_agent_at_loopback(tmp_path: Path) -> None:
    """web.listen_address ":PORT" (every interface): the command asks 127.0.0.1:PORT."""
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f":{agent.port}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "none.sock")}
        result = gpuscope("snapshot", env=env)
    assert result.returncode == 0, result.stderr
    assert f"snapshot of the running agent at http://127.0.0.1:{agent.port} (node " in result.stderr


def test_snapshot_with_simulate_samples_its_own_node_not_the_agents(tmp_path: Path) -> None:
    with run_agent(tmp_path, "--simulate", "healthy", "--sample-interval", "200ms") as agent:
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{agent.port}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / f"control-{agent.port}.sock")}
        result = gpuscope("snapshot", "--simulate", "shared-gpu", env=env)
    assert result.returncode == 0, result.stderr
    assert "sampling its own simulated node (--simulate shared-gpu), not the running agent's" in result.stderr
    assert "snapshot of the running agent" not in result.stderr and "compute" in result.stdout


def test_snapshot_from_json_rebuilds_the_snapshot() -> None:
    from snapshots import make_full_snapshot

    from gpuscope.snapshot import Snapshot

    snapshot = make_full_snapshot()
    assert any(g.mig_devices for g in snapshot.gpus) and any(g.nvlink_link_bytes for g in snapshot.gpus)
    assert Snapshot.from_json(json.loads(json.dumps(snapshot.to_json()))) == snapshot


@pytest.mark.parametrize(("change", "expected"), [
    (lambda d: d.pop("hostname"), "snapshot.hostname: missing"),
    (lambda d: d["gpus"][0].update(index="0"), "snapshot.gpus[0].index: expected an integer, got a string"),
    (lambda d: d["gpus"][0].update(xid_errors={"x": 1}), "gpus[0].xid_errors: expected integer keys"),
    (lambda d: d["gpus"][0].update(processes={}), "gpus[0].processes: expected a list, got an object"),
    (lambda d: d["gpus"][0]["processes"][0].update(kind="cuda"), "gpus[0].processes[0].kind: expected one"),
])
def test_snapshot_from_json_names_the_malformed_field(change: Any, expected: str) -> None:
    from snapshots import make_full_snapshot

    from gpuscope.snapshot import Snapshot, SnapshotJsonError

    data = json.loads(json.dumps(make_full_snapshot().to_json()))
    change(data)
    with pytest.raises(SnapshotJsonError, match=re.escape(expected)):
        Snapshot.from_json(data)
    with pytest.raises(SnapshotJsonError, match="snapshot: expected a JSON object, got a list"):
        Snapshot.from_json([])


@pytest.mark.parametrize(("status", "expected"), [
    (200, "cannot read (snapshot.gpus[0].index: expected an integer, got a string); not using it"),
    (401, "requires authentication (401 Unauthorized"),
])
def test_snapshot_falls_back_to_sampling_when_the_agent_cannot_be_used(
        tmp_path: Path, status: int, expected: str) -> None:
    """Something answering as a gpuscope agent with a snapshot that does not fit, or wanting a password:
    said in one line, and the command samples the node itself (no driver here: today's hints)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def version_string(self) -> str:
            return "gpuscope/0"

        def do_GET(self) -> None:
            body = json.dumps({"timestamp": 1.0, "hostname": "x", "nvml_up": True, "driver_version": None,
                               "gpus": [{"index": "zero"}], "sample_duration_seconds": 0.1}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "GPUSCOPE_WEB__LISTEN_ADDRESS": f"127.0.0.1:{server.server_port}",
               "GPUSCOPE_CONTROL__SOCKET": str(tmp_path / "none.sock")}
        result = gpuscope("snapshot", env=env)
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in result.stderr
    assert expected in result.stderr
    assert result.returncode == 1 and "NVML is not available" in result.stdout
    assert "snapshot of the running agent" not in result.stderr
