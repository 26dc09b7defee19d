"""End to end, every hop real and on loopback: the SHIPPED Prometheus rules fire on what the agent
exports, Prometheus sends the alert to Alertmanager, Alertmanager's webhook reaches the agent's
``POST /api/v1/alertmanager``, and the agent captures the real JAX job on the alerting GPU.

The agent runs as a secured node should: its port serves TLS only, Prometheus scrapes it with basic
auth (its ``tls_config`` and ``basic_auth``), and Alertmanager's webhook sends the webhook's bearer
token (``http_config.authorization.credentials_file``) over TLS.

    gpuscope run --simulate  <-scrape-  prometheus (deploy/prometheus/gpuscope-rules.yml, unchanged)
          ^                                  | alerts
          | webhook                          v
          +------------------------------ alertmanager

The rule is GpuXidError, the only shipped GPU rule without a ``for:`` (the others wait 30 s to 2 m of
real time): the scenario gives GPU 1, where the JAX job's real pid "runs", Xid 48 a few seconds after
start. Xid alerts do not capture by default (``capture.rules``), so the agent's config turns that on
for GpuXidError -- an operator setting, not a change to the rules. The agent's own alert engine is
off (``alerting.enabled: false``), so the capture can only have come through Prometheus and
Alertmanager; its record says ``trigger.kind: webhook``, which the engine's captures never do.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from agent_process import free_port, http_get, run_agent
from capturing import Workload
from pki import Pki, make_pki
from test_alertmanager import active_alerts, run_alertmanager, wait_until
from test_capture_service import scenario_for
from test_e2e_prometheus import Prometheus, run_prometheus

from gpuscope.capture.records import record_from_bytes
from gpuscope.generated.tsl import xplane_pb2

pytestmark = pytest.mark.e2e

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "gpuscope-rules.yml"
ALERT = "GpuXidError"
XID_GPU = 1  # scenario_for(pid): GPU 1 holds the JAX job
XID_CODE = 48  # double-bit ECC: not on the rule's list of application-caused Xids (13, 31, 43, 45)
# Scenario time: Prometheus and Alertmanager run before the agent starts, so Prometheus scrapes the
# agent within a second or two of its start, well before the Xid (checked below).
XID_AT_S = 12
DEADLINE_S = 45.0  # each hop below; the whole test takes about 25 s

@dataclass(frozen=True)
class Secrets:
    pki: Pki
    web_config: Path
    password: str
    password_file: Path
    webhook_token: Path


def make_secrets(folder: Path) -> Secrets:
    """The agent's TLS certificate and web configuration (Prometheus's user), the password file
    Prometheus reads, and the webhook's bearer token that Alertmanager sends."""
    pki = make_pki(folder / "pki")
    password = "scrape-" + os.urandom(8).hex()
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    web_config = folder / "web.yml"
    web_config.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n"
                          f"  key_file: {pki.server_key}\n"
                          f"basic_auth_users:\n  prometheus: {hashed}\n")
    password_file = folder / "password"
    password_file.write_text(password)
    token = folder / "webhook-token"
    token.write_text("webhook-" + os.urandom(16).hex())
    for path in (password_file, token):
        path.chmod(0o600)
    return Secrets(pki, web_config, password, password_file, token)


def scenario(pid: int) -> str:
    """scenario_for(pid) (the JAX job on GPU 1) with an Xid on GPU 1 soon after start."""
    document = yaml.safe_load(scenario_for(pid))
    document["name"] = "e2e-rules-xid"
    document["gpus"][XID_GPU]["xid"] = [{"at": f"{XID_AT_S}s", "code": XID_CODE}]
    return yaml.safe_dump(document)


def alertmanager_config(agent_base: str, secrets: Secrets) -> str:
    # Grouped per alert and GPU, sent after 1 s; never repeated within the test.
    return f"""\
route:
  receiver: gpuscope
  group_by: [alertname, instance, gpu]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: gpuscope
    webhook_configs:
      - url: {agent_base}/api/v1/alertmanager
        send_resolved: false
        http_config:
          authorization: {{type: Bearer, credentials_file: {json.dumps(str(secrets.webhook_token))}}}
          tls_config: {{ca_file: {json.dumps(str(secrets.pki.ca))}}}
"""


def prometheus_config(agent_port: int, alertmanager: str, secrets: Secrets) -> str:
    return f"""\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [{json.dumps(str(RULES))}]
alerting:
  alertmanagers:
    - static_configs:
        - targets: ['{urllib.parse.urlsplit(alertmanager).netloc}']
scrape_configs:
  - job_name: gpuscope
    scheme: https
    tls_config: {{ca_file: {json.dumps(str(secrets.pki.ca))}}}
    basic_auth: {{username: prometheus, password_file: {json.dumps(str(secrets.password_file))}}}
    static_configs:
      - targets: ['127.0.0.1:{agent_port}']
"""


def get_json(url: str) -> Any:
    status, body = http_get(url)
    assert status == 200, (url, body)
    return json.loads(body)


def firing_in_prometheus(prometheus: Prometheus) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = get_json(prometheus.base + "/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == ALERT and a["state"] == "firing"]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text format)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def test_shipped_rule_fires_and_alertmanager_webhook_captures_the_job(
        jax_job: Workload, tmp_path: Path) -> None:
    pid = jax_job.proc.pid
    scenario_path = tmp_path / "e2e-rules-xid.yaml"
    scenario_path.write_text(scenario(pid))
    config = tmp_path / "gpuscope.yml"
    secrets = make_secrets(tmp_path / "secrets")
    config.write_text(
        "sample_interval: 500ms\n"
        f"web:\n  config_file: {secrets.web_config}\n"
        "alerting:\n  enabled: false\n"
        f"capture:\n  profiler_ports: [{jax_job.port}]\n  duration: 1s\n"
        f"  rules: {{{ALERT}: true}}\n"
        f"  webhook: {{enabled: true, token_file: {secrets.webhook_token}}}\n"
    )
    port = free_port()
    store = tmp_path / f"captures-{port}"  # run_agent's GPUSCOPE_CAPTURE__STORE__ROOT
    instance = f"127.0.0.1:{port}"
    # Prometheus and Alertmanager first, so that the scenario's clock starts once they are watching.
    agent_args = ("--config", str(config), "--simulate", str(scenario_path))
    with run_alertmanager(tmp_path / "am", free_port(), alertmanager_config(f"https://{instance}", secrets)) \
            as alertmanager, \
            run_prometheus(tmp_path / "prometheus", prometheus_config(port, alertmanager, secrets)) \
            as prometheus, \
            run_agent(tmp_path, *agent_args, port=port, tls=secrets.pki.ca,
                      user=("prometheus", secrets.password)) as agent:

        def logs() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}"
                             for p in (agent.log, tmp_path / "am" / "alertmanager.log",
                                       tmp_path / "prometheus" / "prometheus.log"))

        # Prometheus loaded the shipped file: every alert rule in it, none of them in error.
        shipped = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
        groups = get_json(prometheus.base + "/api/v1/rules?type=alert")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        assert sorted(loaded) == sorted(shipped) and ALERT in loaded, groups
        assert all(r["health"] != "err" for r in loaded.values()), loaded
        assert all(g["file"] == str(RULES) for g in groups), groups

        # 1. The shipped rule fires in Prometheus, with the scrape's target labels.
        (fired,) = wait_until(lambda: firing_in_prometheus(prometheus),
                              f"{ALERT} to fire in Prometheus", timeout=DEADLINE_S, diagnostics=logs)
        labels = fired["labels"]
        assert labels["instance"] == instance and labels["job"] == "gpuscope", labels
        assert labels["gpu"] == str(XID_GPU) and labels["xid"] == str(XID_CODE), labels
        assert labels["uuid"].startswith("GPU-") and labels["severity"] == "critical", labels
        series = prometheus.query(f'ALERTS{{alertname="{ALERT}", alertstate="firing"}}')
        assert [s["metric"]["gpu"] for s in series] == [str(XID_GPU)], series
        # Prometheus scraped the agent before the Xid, too: the rule fired on a counter that
        # appeared while Prometheus watched, not only on one there at the first scrape.
        scrapes = prometheus.query(f'sum_over_time(up{{instance="{instance}"}}[5m])')  # successful
        with_xid = prometheus.query(
            f'count_over_time(gpu_xid_errors_total{{instance="{instance}"}}[5m])')
        assert [s["metric"]["gpu"] for s in with_xid] == [str(XID_GPU)], with_xid
        assert float(scrapes[0]["value"][1]) > float(with_xid[0]["value"][1]), (
            "the first successful scrape came after the Xid",
            scrapes, with_xid)

        # 2. Prometheus sent it to Alertmanager, which holds it with the same labels.
        (held,) = wait_until(lambda: active_alerts(alertmanager, ALERT), f"{ALERT} in Alertmanager",
                             timeout=DEADLINE_S, diagnostics=logs)
        assert held["labels"] == labels, (held["labels"], labels)
        assert held["receivers"] == [{"name": "gpuscope"}]
        generator = urllib.parse.urlsplit(held["generatorURL"])  # Prometheus names it by hostname
        assert generator.port == urllib.parse.urlsplit(prometheus.base).port, held
        assert "gpu_xid_errors_total" in urllib.parse.parse_qs(generator.query)["g0.expr"][0], held

        # 3. Alertmanager's webhook reached the agent, which took and stored the capture.
        record_path = wait_until(lambda: next(store.glob("*/capture.json"), None),
                                 "a capture in the agent's store", timeout=DEADLINE_S, diagnostics=logs)
        record = record_from_bytes(record_path.read_bytes())
        assert record.trigger.kind == "webhook" and record.trigger.alertname == ALERT, record
        assert record.gpu == XID_GPU and pid in record.pids, record
        assert record.outcome == "captured" and record.error is None, record
        (xplane,) = [f for f in record.files if f.endswith(".xplane.pb")]
        space = xplane_pb2.XSpace.FromString((record_path.parent / xplane).read_bytes())
        assert space.planes, "an empty trace"

        # Alertmanager counts the notification as delivered: the agent answered 2xx.
        am_metrics = http_get(alertmanager + "/metrics")[1]
        assert metric_sum(am_metrics, "alertmanager_notifications_total", integration="webhook") >= 1
        assert metric_sum(am_metrics, "alertmanager_notifications_failed_total",
                          integration="webhook") == 0, am_metrics

        # Only the webhook path: the agent's engine is off, and only that one capture exists.
        assert json.loads(agent.get("/api/v1/alerts")[1]) == {"enabled": False, "alerts": []}
        metrics = agent.get("/metrics")[1]
        assert metric_sum(metrics, "gpuscope_captures_total", trigger="webhook", outcome="captured") == 1
        assert metric_sum(metrics, "gpuscope_captures_total", trigger="alert") == 0
        assert [p.parent for p in store.glob("*/capture.json")] == [record_path.parent]
