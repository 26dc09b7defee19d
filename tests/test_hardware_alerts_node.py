"""The hardware-health alerts end to end on a simulated HGX H100 node (scenario ``alert-row-remap``):
GPU 3 has a row remap pending, GPU 7 a failed one. The real sampler over the simulator feeds the
engine with its default rules; the node raises the health alerts on those GPUs only, and every output
the other rules use carries them: the event log, Alertmanager, ``gpuscope_alert_firing``, the status
page (no green "up" for those GPUs), and the snapshot document's health per GPU and MIG device."""

from __future__ import annotations

import json
import re
from pathlib import Path

from snapshots import make_gpu, make_mig_gpu, make_snapshot
from test_alert_scenarios import Run
from test_alertmanager import recorder, wait_until

from gpuscope.alerts.alertmanager import AlertmanagerNotifier
from gpuscope.alerts.config import AlertmanagerConfig, EventLogConfig
from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.alerts.rules import HARDWARE_RULES, RULE_TYPES
from gpuscope.exporters.alerts import AlertCollector
from gpuscope.snapshot import Snapshot
from gpuscope.version import __version__
from gpuscope.web.status_page import StatusView, render_status_page
from gpuscope.web.utilization_history import UtilizationHistory

EXPECTED = {("GpuRowRemapPending", 3), ("GpuUnhealthy", 3), ("GpuRowRemapFailed", 7), ("GpuUnhealthy", 7)}


def test_a_pending_and_a_failed_remap_reach_every_output(tmp_path: Path) -> None:
    event_log = AlertEventLog(EventLogConfig(path=str(tmp_path / "alerts.jsonl")))
    with recorder(200) as (url, pushed):
        with Run("alert-row-remap") as run:
            notifier = AlertmanagerNotifier(AlertmanagerConfig(url=url), run.engine, hostname="sim-node",
                                            instance="sim-node:9847")
            run.engine.add_listener(event_log)
            run.engine.add_listener(notifier)
            notifier.start()
            try:
                run.until(90)  # the rules' for: 1m, and a while after
                wait_until(lambda: {(a["labels"]["alertname"], int(a["labels"]["gpu"]))
                                    for body in pushed for a in body[2]} >= EXPECTED, "the pushes")
            finally:
                notifier.stop()
            snapshot = run.sampler.latest()
            alerts = run.engine.alerts()
            firing_metric = list(AlertCollector(run.engine).collect())
        event_log.close()
    # The engine: the health alerts on GPUs 3 and 7, firing, and nothing else anywhere.
    assert set(run.fired()) == EXPECTED and run.touched() == EXPECTED
    assert {(a.name, a.gpu, a.state) for a in alerts} == {(name, gpu, "firing") for name, gpu in EXPECTED}
    assert {a.name: a.severity for a in alerts if a.gpu == 7} == {"GpuRowRemapFailed": "critical",
                                                                   "GpuUnhealthy": "warning"}
    # The event log: a pending and a firing line per alert (for: 1m).
    lines = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert {(line["alertname"], line["gpu"]) for line in lines if line["to"] == "firing"} == EXPECTED
    assert {line["alertname"] for line in lines} <= set(HARDWARE_RULES)
    # Alertmanager: pushed with their severity.
    pushed_alerts = {(a["labels"]["alertname"], a["labels"]["gpu"], a["labels"]["severity"])
                     for body in pushed for a in body[2]}
    assert ("GpuRowRemapFailed", "7", "critical") in pushed_alerts
    assert ("GpuRowRemapPending", "3", "warning") in pushed_alerts
    # gpuscope_alert_firing.
    (family,) = [f for f in firing_metric if f.name == "gpuscope_alert_firing"]
    assert {(s.labels["alertname"], int(s.labels["gpu"])) for s in family.samples} == EXPECTED
    # No profiler capture for a hardware fault.
    assert not any(RULE_TYPES[name].captures_by_default for name, _ in EXPECTED)
    # The status page: the alerts, the health badges, and no green "up" on GPUs 3 and 7.
    assert snapshot is not None
    page = render_status_page(StatusView(
        snapshot=snapshot, stale=False, alerts=alerts, captures=None, history=UtilizationHistory().series,
        version=__version__, now=snapshot.timestamp)).decode()
    rows = dict(re.findall(r'<tr class="gpu" id="gpu-(\d)">(.*?)</tr>', page, re.S))
    assert len(rows) == 8
    for gpu, row in rows.items():
        green = '<span class="badge up">up</span>' in row
        assert green == (gpu not in ("3", "7")), (gpu, row)
    assert ">reset required</span>" in rows["3"] and "GpuRowRemapPending" in rows["3"]
    assert ">replace</span>" in rows["7"] and '<span class="badge up critical"' in rows["7"]
    assert "GpuRowRemapFailed" in rows["7"] and "Alerts: 4 firing" in page
    # The snapshot document: the health and its reasons per GPU.
    document = snapshot.to_json()
    health = {g["index"]: (g["health"], g["health_reasons"]) for g in document["gpus"]}
    assert health[3] == ("reset_required", ["a remapped memory row waits for a GPU reset"])
    assert health[7] == ("replace", ["a memory row could not be remapped"])
    assert all(health[i] == ("ok", []) for i in (0, 1, 2, 4, 5, 6))


def test_the_snapshot_gives_each_mig_device_its_gpus_health() -> None:
    failing = make_mig_gpu(1, row_remap_pending=True, row_remap_failed=True)
    snapshot = make_snapshot(gpus=[make_gpu(0), failing])
    document = json.loads(json.dumps(snapshot.to_json()))
    sound, mig = document["gpus"]
    assert (sound["health"], sound["health_reasons"]) == ("ok", [])
    reasons = ["a memory row could not be remapped", "a remapped memory row waits for a GPU reset"]
    assert (mig["health"], mig["health_reasons"]) == ("replace", reasons)
    assert [(m["health"], m["health_reasons"]) for m in mig["mig_devices"]] == [("replace", reasons)] * 2
    assert Snapshot.from_json(document) == snapshot  # derived: dropped on the way back


def test_a_gpu_lost_for_less_than_a_minute_leaves_gpu_unhealthy_pending_only() -> None:
    """GpuUnhealthy judges a GPU that is down (lost): GPU 1 of ``gpu-lost`` is lost from 20 s to 40 s,
    shorter than the rule's for of 1m, so its alert goes pending and then inactive; Xid 79 fires."""
    with Run("gpu-lost") as run:
        run.until(60)
    unhealthy = [(at, t.state, t.values) for at, t in run.transitions if t.name == "GpuUnhealthy"]
    assert [(state, values) for _, state, values in unhealthy] == [("pending", {"lost": 1.0}),
                                                                  ("inactive", {"lost": 1.0})]
    assert 20 <= unhealthy[0][0] <= 22 and 40 <= unhealthy[1][0] <= 42
    assert {t.gpu for _, t in run.transitions} == {1}
    assert ("GpuXidError", 1) in run.fired()
