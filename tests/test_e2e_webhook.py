"""End to end: a real Alertmanager's webhook makes `gpuscope run` capture the real JAX job on the GPU
an alert names, when it sends the webhook's credentials (``http_config``). Without them the agent
answers 401: nothing is captured, and nothing is counted against the hourly budget (of 1 here, so
the authorised capture after the refused one proves it). A malformed payload is refused with the
reason and changes nothing."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from agent_process import RunningAgent, free_port, http_get, run_agent
from capturing import Workload
from test_alertmanager import run_alertmanager, wait_until
from test_capture_service import scenario_for
from test_e2e_rules_to_capture import metric_sum

pytestmark = pytest.mark.e2e

TOKEN = "webhook-token-for-the-e2e-test-0123"
# A webhook's capture names its alert; the span the alert judged is the PromQL rule's, unknown here.
WEBHOOK_TRIGGER = {"kind": "webhook", "alertname": "GpuLowUtilization", "user": None, "judged_since": None,
                   "judged_until": None, "alert_summary": None}


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
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


def alertmanager_config(agent_base: str, token_file: Path, password_file: Path) -> str:
    """Alerts labelled ``via=<receiver>`` go to that receiver: one sends no credentials, one the
    webhook's bearer token, one the basic-auth user the webhook accepts."""
    url = f"{agent_base}/api/v1/alertmanager"
    return f"""\
route:
  receiver: anonymous
  group_by: [alertname, via]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
  routes:
    - {{matchers: ['via="bearer"'], receiver: bearer}}
    - {{matchers: ['via="basic"'], receiver: basic}}
receivers:
  - name: anonymous
    webhook_configs: [{{url: {url}, send_resolved: false}}]
  - name: bearer
    webhook_configs:
      - url: {url}
        send_resolved: false
        http_config: {{authorization: {{type: Bearer, credentials_file: {json.dumps(str(token_file))}}}}}
  - name: basic
    webhook_configs:
      - url: {url}
        send_resolved: false
        http_config:
          basic_auth: {{username: alertmanager, password_file: {json.dumps(str(password_file))}}}
"""


def fire(alertmanager: str, instance: str, via: str, gpu: int) -> None:
    alert = [{"labels": {"alertname": "GpuLowUtilization", "instance": instance, "gpu": str(gpu),
                         "via": via}}]
    request = urllib.request.Request(f"{alertmanager}/api/v2/alerts", data=json.dumps(alert).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def records(store: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(store.glob("*/capture.json"))]


def start_agent(tmp_path: Path, jax_job: Workload, port: int) -> tuple[Path, Path, list[str]]:
    scenario = tmp_path / "node.yaml"
    scenario.write_text(scenario_for(jax_job.proc.pid))
    token_file = tmp_path / "webhook-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    password_file = tmp_path / "am-password"
    password_file.write_text("am-secret-password")
    hashed = bcrypt.hashpw(b"am-secret-password", bcrypt.gensalt(4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  alertmanager: {hashed}\n")
    config = tmp_path / "gpuscope.yml"
    config.write_text(f"web:\n  config_file: {web}\n"
                      f"capture:\n  profiler_ports: [{jax_job.port}]\n  duration: 1s\n  hourly_budget: 2\n"
                      "  cooldown: 0s\n"
                      f"  webhook: {{enabled: true, token_file: {token_file}, users: [alertmanager]}}\n")
    return token_file, password_file, ["--config", str(config), "--simulate", str(scenario)]


def wait_for_capture(store: Path, count: int, agent: RunningAgent) -> list[dict[str, object]]:
    return wait_until(lambda: len(records(store)) >= count and records(store), f"{count} capture(s)",
                      timeout=60, diagnostics=agent.stderr)


def test_alertmanager_with_credentials_captures_and_without_is_refused(jax_job: Workload,
                                                                       tmp_path: Path) -> None:
    port = free_port()
    instance = f"127.0.0.1:{port}"
    token_file, password_file, args = start_agent(tmp_path, jax_job, port)
    store = tmp_path / f"captures-{port}"  # run_agent's GPUSCOPE_CAPTURE__STORE__ROOT
    am_config = alertmanager_config(f"http://{instance}", token_file, password_file)
    with run_alertmanager(tmp_path / "am", free_port(), am_config) as alertmanager, \
            run_agent(tmp_path, *args, port=port, user=("alertmanager", "am-secret-password")) as agent:
        agent.wait_for("/metrics", f'pid="{jax_job.proc.pid}"')

        # 1. No credentials: Alertmanager's notification fails, the agent counts a refusal, no capture.
        fire(alertmanager, instance, "anonymous", gpu=1)
        wait_until(lambda: metric_sum(http_get(alertmanager + "/metrics")[1],
                                      "alertmanager_notifications_failed_total", integration="webhook") >= 1,
                   "Alertmanager's failed notification", timeout=30, diagnostics=agent.stderr)
        metrics = agent.get("/metrics")[1]
        assert metric_sum(metrics, "gpuscope_http_rejected_requests_total", reason="unauthorized") >= 1
        assert metric_sum(metrics, "gpuscope_captures_total") == 0 and records(store) == []

        # 2. The bearer token, then basic auth: both captured, within a budget of 2 the refusal did not use.
        fire(alertmanager, instance, "bearer", gpu=1)
        first = wait_for_capture(store, 1, agent)
        fire(alertmanager, instance, "basic", gpu=1)
        both = wait_for_capture(store, 2, agent)
        assert [r["gpu"] for r in both] == [1, 1] and all(r["outcome"] == "captured" for r in both), both
        assert all(r["trigger"] == WEBHOOK_TRIGGER for r in both), both
        assert first[0]["outcome"] == "captured", first
        # Alertmanager keeps retrying the anonymous notification: still refused, still no capture.
        def refusals() -> float:
            return metric_sum(agent.get("/metrics")[1], "gpuscope_http_rejected_requests_total",
                              reason="unauthorized")

        refused = refusals()
        wait_until(lambda: refusals() > refused, "a retried refusal", timeout=30)
        assert len(records(store)) == 2


def test_webhook_payloads_are_checked_before_anything_is_captured(jax_job: Workload, tmp_path: Path) -> None:
    port = free_port()
    _, _, args = start_agent(tmp_path, jax_job, port)
    with run_agent(tmp_path, *args, port=port, user=("alertmanager", "am-secret-password")) as agent:
        agent.wait_for("/metrics", f'pid="{jax_job.proc.pid}"')
        url = agent.base + "/api/v1/alertmanager"
        store = tmp_path / f"captures-{port}"

        assert post(url, webhook(f"127.0.0.1:{port}", gpu="1"), token=None)[0] == 401
        status, reply = post(url, b'{"version": "4", "alerts": "nope"}')
        assert status == 400 and "alerts" in str(reply["error"])
        status, reply = post(url, webhook("some-other-node:9847", gpu="1"))
        assert status == 200 and reply["accepted"] == 0  # not about this node

        status, reply = post(url, webhook(f"127.0.0.1:{port}", gpu="1"))
        assert status == 200 and reply["accepted"] == 1, reply
        deadline = time.monotonic() + 60
        found: list[dict[str, object]] = []
        while not found and time.monotonic() < deadline:
            found = records(store)
            time.sleep(0.2)
        assert len(found) == 1, agent.stderr()
        record = found[0]
        assert record["trigger"] == WEBHOOK_TRIGGER
        assert record["gpu"] == 1 and record["outcome"] == "captured"
        assert any(str(f).endswith(".xplane.pb") for f in record["files"])  # type: ignore[attr-defined]
        metrics = agent.wait_for("/metrics", "gpuscope_captures_total{")
        assert 'trigger="webhook"' in metrics and 'outcome="captured"' in metrics
