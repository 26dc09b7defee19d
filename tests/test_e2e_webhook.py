"""End to end: an Alertmanager webhook naming this agent's GPU makes `gpuscope run` capture the real
JAX job on that GPU; a malformed payload is refused with the reason and changes nothing."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from agent_process import run_agent
from capturing import Workload
from test_capture_service import scenario_for

pytestmark = pytest.mark.e2e


def post(url: str, body: bytes) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def webhook(instance: str, **labels: str) -> bytes:
    alert = {"status": "firing", "labels": {"alertname": "GpuLowUtilization", "instance": instance,
                                             **labels},
             "annotations": {}, "startsAt": "2026-11-22T08:00:00Z", "endsAt": "0001-01-01T00:00:00Z"}
    return json.dumps({"version": "4", "status": "firing", "receiver": "gpuscope", "groupLabels": {},
                       "commonLabels": {}, "commonAnnotations": {}, "externalURL": "", "alerts": [alert]
                       }).encode()


def test_webhook_triggers_a_capture_of_the_gpus_job(jax_job: Workload, tmp_path: Path) -> None:
    scenario = tmp_path / "node.yaml"
    scenario.write_text(scenario_for(jax_job.proc.pid))
    config = tmp_path / "gpuscope.yml"
    config.write_text(f"capture:\n  profiler_ports: [{jax_job.port}]\n  duration: 1s\n")
    with run_agent(tmp_path, "--config", str(config), "--simulate", str(scenario)) as agent:
        agent.wait_for("/metrics", f'pid="{jax_job.proc.pid}"')
        url = agent.base + "/api/v1/alertmanager"
        store = tmp_path / f"captures-{agent.port}"  # run_agent's GPUSCOPE_CAPTURE__STORE__ROOT

        status, reply = post(url, b'{"version": "4", "alerts": "nope"}')
        assert status == 400 and "alerts" in str(reply["error"])
        status, reply = post(url, webhook("some-other-node:9847", gpu="1"))
        assert status == 200 and reply["accepted"] == 0  # not about this node

        status, reply = post(url, webhook(f"127.0.0.1:{agent.port}", gpu="1"))
        assert status == 200 and reply["accepted"] == 1, reply
        deadline = time.monotonic() + 60
        records: list[Path] = []
        while not records and time.monotonic() < deadline:
            records = list(store.glob("*/capture.json"))
            time.sleep(0.2)
        assert len(records) == 1, agent.stderr()
        record = json.loads(records[0].read_text())
        assert record["trigger"]["kind"] == "webhook"
        assert record["trigger"]["alertname"] == "GpuLowUtilization"
        assert record["gpu"] == 1 and record["outcome"] == "captured"
        assert any(f.endswith(".xplane.pb") for f in record["files"])
        metrics = agent.wait_for("/metrics", "gpuscope_captures_total{")
        assert 'trigger="webhook"' in metrics and 'outcome="captured"' in metrics
