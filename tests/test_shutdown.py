"""SIGTERM stops the whole agent within 2 s in every state, and leaves nothing half-written.

The states: clients holding connections (a scrape that never finishes its request), a control API
client waiting for a long capture of a real JAX job, with alerts written to the event log; then the
agent restarts on the same store and event log, which must read back whole. (A sampler stuck in an
NVML call is covered in test_cli.py.)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from agent_process import run_agent
from capturing import Workload
from test_capture_service import scenario_for

STOP_LIMIT_S = 2.0


def sigterm(agent_proc: subprocess.Popen[str]) -> float:
    started = time.monotonic()
    agent_proc.send_signal(signal.SIGTERM)
    agent_proc.wait(timeout=15)
    return time.monotonic() - started


def test_sigterm_with_clients_connected_and_a_capture_in_flight(jax_job: Workload, tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(scenario_for(jax_job.pid))
    events = tmp_path / "alerts.jsonl"
    config = tmp_path / "gpuscope.yml"
    config.write_text(f"capture:\n  profiler_ports: [{jax_job.port}]\n"
                      f"alerting:\n  event_log: {{path: {events}}}\n")
    args = ("--simulate", str(scenario), "--config", str(config), "--sample-interval", "100ms")
    with run_agent(tmp_path, *args) as agent:
        agent.wait_for("/metrics", f'pid="{jax_job.pid}"')
        stalled = []
        for _ in range(5):  # clients that never finish their request
            client = socket.create_connection(("127.0.0.1", agent.port))
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: node\r\n")
            stalled.append(client)
        socket_path = tmp_path / f"control-{agent.port}.sock"
        waiting = subprocess.Popen(
            [sys.executable, "-m", "gpuscope", "capture", "--socket", str(socket_path), "--target",
             f"127.0.0.1:{jax_job.port}", "--duration", "20s", "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while "capture requested" not in agent.stderr() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # the capture is under way in the job's profiler
            took = sigterm(agent.proc)
            assert agent.proc.returncode == 0, agent.stderr()
            assert took < STOP_LIMIT_S, f"SIGTERM took {took:.2f} s"
            _out, err = waiting.communicate(timeout=15)
            assert waiting.returncode != 0 and "stopping" in err, err  # told, not left hanging
        finally:
            waiting.kill()
            for client in stalled:
                client.close()
    assert "Traceback" not in agent.stderr()

    # Restarted on the same store and event log: both read back whole.
    with run_agent(tmp_path, *args, port=agent.port) as again:
        again.wait_healthy()
        listed = subprocess.run([sys.executable, "-m", "gpuscope", "captures", "ls", "--json", "--socket",
                                 str(tmp_path / f"control-{again.port}.sock")],
                                capture_output=True, text=True, timeout=30, check=False)
        assert listed.returncode == 0, listed.stderr
        assert isinstance(json.loads(listed.stdout), list)
    if events.exists():
        for line in events.read_text().splitlines():
            json.loads(line)
    assert not list((tmp_path / f"captures-{agent.port}" / ".staging").iterdir()), "leftovers not removed"
