"""End to end: `gpuscope run` recognises a pattern and its alert reaches a real Alertmanager.

The agent runs as a real process on a simulated node whose GPU 1 reports a non-benign Xid 3 s after
start (GpuXidError fires immediately); a real Alertmanager (Debian's prometheus-alertmanager) listens
on loopback. The alert must appear in Alertmanager's API, in the agent's /api/v1/alerts and metrics,
and as a line of the JSON-lines event log.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from agent_process import free_port, run_agent
from test_alertmanager import active_alerts, run_alertmanager

pytestmark = pytest.mark.e2e

SCENARIO = """
name: xid-soon
duration: 10m
gpus:
  - utilization: 0.95
    processes: [{name: train-rank0, spawn: true, memory: 60GiB}]
  - utilization: 0.95
    processes: [{name: train-rank1, spawn: true, memory: 60GiB}]
    xid: [{at: 3s, code: 48}]
"""


def test_an_xid_alert_reaches_alertmanager_api_metrics_and_event_log(tmp_path: Path) -> None:
    scenario = tmp_path / "xid-soon.yaml"
    scenario.write_text(SCENARIO)
    event_log = tmp_path / "state" / "alerts.jsonl"
    with run_alertmanager(tmp_path / "am", free_port()) as alertmanager:
        config = tmp_path / "gpuscope.yml"
        config.write_text(
            "sample_interval: 500ms\n"
            "alerting:\n"
            f"  event_log:\n    path: {event_log}\n"
            f"  alertmanager:\n    url: {alertmanager}\n    resend_interval: 5s\n"
        )
        with run_agent(tmp_path, "--config", str(config), "--simulate", str(scenario)) as agent:
            body = agent.wait_for("/api/v1/alerts", "GpuXidError", timeout=30)
            (alert,) = [a for a in json.loads(body)["alerts"] if a["alertname"] == "GpuXidError"]
            assert alert["gpu"] == 1 and alert["state"] == "firing"

            metrics = agent.wait_for("/metrics", 'gpuscope_alert_firing{')
            assert 'alertname="GpuXidError"' in metrics and 'gpu="1"' in metrics

            deadline = time.monotonic() + 20
            pushed = active_alerts(alertmanager, "GpuXidError")
            while not pushed and time.monotonic() < deadline:
                time.sleep(0.2)
                pushed = active_alerts(alertmanager, "GpuXidError")
            assert len(pushed) == 1, pushed
            labels = pushed[0]["labels"]
            assert labels["gpu"] == "1" and labels["severity"] and labels["uuid"].startswith("GPU-")
            assert labels["instance"].endswith(f":{agent.port}")

        lines = [json.loads(line) for line in event_log.read_text().splitlines()]
        firing = [e for e in lines if e["alertname"] == "GpuXidError" and e["to"] == "firing"]
        assert len(firing) == 1 and firing[0]["gpu"] == 1 and firing[0]["values"]
