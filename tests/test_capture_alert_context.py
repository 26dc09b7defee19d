"""A capture read beside the alert that triggered it: which minutes each saw, and a capture whose
verdict does not account for its alert says so rather than contradict it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_analysis_diagnose import STEP_US, kernels, steps
from test_capture_analysis import input_bound_trace

from gpuscope.alert_captures.event_lines import CaptureEventLines
from gpuscope.alert_captures.verdicts import CaptureVerdicts
from gpuscope.alerts.alertmanager import AlertmanagerNotifier
from gpuscope.alerts.config import AlertmanagerConfig, EventLogConfig
from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.alerts.model import Alert, Transition
from gpuscope.capture.alert_context import alert_context, alert_trigger
from gpuscope.capture.analysis_worker import summarise
from gpuscope.capture.model import CaptureRecord, CaptureTarget, TargetOutcome, Trigger
from gpuscope.capture.store import CaptureStore
from gpuscope.cli.explain import explain_path

FIRED = 1_795_000_000.0  # 2026-11-18 11:06:40 UTC
LOW = Trigger("alert", alertname="GpuLowUtilization", judged_since=FIRED - 240.0, judged_until=FIRED,
              alert_summary="GPU 3 runs a job but its mean utilization is 12.0% over 2m (below 80%)")


def record(trigger: Trigger, verdict: str | None, *, start: float = FIRED + 3.0) -> dict[str, Any]:
    analysis = None if verdict is None else {"verdict": verdict, "headline": f"{verdict}: x"}
    fields = ("kind", "alertname", "judged_since", "judged_until", "alert_summary")
    return {"id": "c1", "trigger": {name: getattr(trigger, name) for name in fields},
            "start": start, "duration_s": 10.0, "analysis": analysis, "gpu": 3}


def test_a_healthy_capture_under_a_low_utilization_alert_says_it_saw_other_minutes() -> None:
    context = alert_context(record(LOW, "healthy"))
    assert context is not None and context.accounts is False
    assert context.judged == "2026-11-18 11:02:40 to 11:06:40 UTC"
    assert context.captured == "2026-11-18 11:06:43 to 11:06:53 UTC"
    text = context.text
    assert text.startswith("GpuLowUtilization judged 2026-11-18 11:02:40 to 11:06:40 UTC; the capture saw "
                           "2026-11-18 11:06:43 to 11:06:53 UTC, 3s after the alert fired.")
    assert "this capture does not explain the alert" in text
    assert "start-up" in text and "The alert's evidence stands: GPU 3 runs a job" in text
    assert text.endswith("Take another capture while the alert fires (gpuscope capture --gpu 3).")
    assert "healthy" not in text.split("does not explain")[1]  # no verdict offered as the alert's cause


def test_verdicts_that_account_for_their_alert_and_those_that_make_no_claim() -> None:
    for alertname, verdict in (("GpuLowUtilization", "input_bound"), ("GpuFrequentIdleDips", "host_sync"),
                               ("GpuBusyButStalled", "tensor_cores_idle"),
                               ("GpuSharedByProcesses", "shared_gpu")):
        context = alert_context(record(Trigger("alert", alertname=alertname, judged_since=FIRED - 60,
                                               judged_until=FIRED), verdict))
        assert context is not None and context.accounts is True, (alertname, verdict)
        assert context.text.endswith(f"Its verdict, {verdict}, accounts for the alert.")
    # An idle GPU's alert is not explained by what the busy GPU does.
    busy = alert_context(record(LOW, "tensor_cores_idle"))
    assert busy is not None and busy.accounts is False
    assert "tensor_cores_idle, which is about another part of the job's time" in busy.text
    # A capture that could not be read, or only in part, explains nothing and says so.
    for verdict in ("inconclusive", "unreadable"):
        unsure = alert_context(record(LOW, verdict))
        assert unsure is not None and unsure.accounts is False
        assert f"nothing conclusive (its verdict is {verdict}" in unsure.text
        assert "this capture does not explain the alert" in unsure.text
    # No claim either way: no verdict yet, or a rule the verdicts do not speak of.
    assert alert_context(record(LOW, None)).accounts is None  # type: ignore[union-attr]
    xid = alert_context(record(Trigger("alert", alertname="GpuXidError", judged_since=FIRED,
                                       judged_until=FIRED), "healthy"))
    assert xid is not None and xid.accounts is None and "does not explain" not in xid.text
    # A webhook trigger (the PromQL rules) does not know the window: the capture's minutes only.
    webhook = alert_context(record(Trigger("webhook", alertname="GpuLowUtilization"), "healthy"))
    assert webhook is not None and webhook.judged == ""
    assert webhook.text.startswith("The capture saw 2026-11-18 11:06:43 to 11:06:53 UTC, after "
                                   "GpuLowUtilization fired.")
    assert alert_context(record(Trigger("user", user="alice"), "healthy")) is None


def test_an_alerts_firing_transition_gives_its_capture_the_window_it_judged() -> None:
    transition = Transition(
        name="GpuLowUtilization", gpu=3, uuid="GPU-3", severity="warning", hostname="n1", previous="pending",
        state="firing", at=FIRED, active_since=FIRED - 120.0, values={}, summary="GPU 3 runs a job" * 100,
        window_seconds=120.0)
    trigger = alert_trigger(transition)
    assert (trigger.kind, trigger.alertname) == ("alert", "GpuLowUtilization")
    assert (trigger.judged_since, trigger.judged_until) == (FIRED - 240.0, FIRED)
    assert trigger.alert_summary is not None and len(trigger.alert_summary) == 500


# -- the readers -------------------------------------------------------------------------------------------


def healthy_trace() -> bytes:
    trace = steps(lambda t, start, n: kernels(t, start + 20.0, STEP_US - 40.0))
    return json.dumps({"deviceProperties": [{"id": 0}], "traceEvents": trace.events}).encode()


def capture_folder(tmp_path: Path, trace: bytes, trigger: Trigger = LOW) -> Path:
    folder = tmp_path / "capture"
    folder.mkdir()
    (folder / "node-1_4242.pt.trace.json").write_bytes(trace)
    (folder / "capture.json").write_text(json.dumps(record(trigger, None) | {"gpu": 3}))
    return folder


def test_captures_explain_puts_the_alert_beside_the_verdict(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = capture_folder(tmp_path, healthy_trace())
    assert explain_path(folder, as_json=False, shown_as="capture c1") == 0
    out = capsys.readouterr().out
    assert out.startswith("Alert: GpuLowUtilization judged 2026-11-18 11:02:40 to 11:06:40 UTC; the capture "
                          "saw 2026-11-18 11:06:43 to 11:06:53 UTC")
    assert "this capture does not explain the alert" in out.split("\n\n")[0]
    assert explain_path(folder, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "healthy"
    assert report["alert"]["accounts_for_alert"] is False
    assert report["alert"]["judged"] == "2026-11-18 11:02:40 to 11:06:40 UTC"


def test_captures_explain_of_a_capture_that_accounts_for_its_alert(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert explain_path(capture_folder(tmp_path, input_bound_trace()), as_json=False) == 0
    first = capsys.readouterr().out.split("\n\n")[0]
    assert first.endswith("Its verdict, input_bound, accounts for the alert.")


def stored(store: CaptureStore, kind: str, trigger: Trigger = LOW) -> CaptureRecord:
    staging = store.begin(gpu=3)
    with staging.new_file("node-1_4242", ".pt.trace.json") as new:
        new.file.write(b"{}")
        relative = new.publish()
    record = CaptureRecord(id=staging.id, trigger=trigger, gpu=3, pids=(4242,),
                           targets=(TargetOutcome(CaptureTarget("kineto", 4242), "captured", (relative,)),),
                           start=FIRED + 3.0, duration_s=10.0, bytes=0, outcome="captured", hostname="node-1")
    store.commit(staging, record)
    findings = [] if kind == "healthy" else [{"kind": kind, "severity": "high", "share": 0.5,
                                               "summary": "50% waits", "evidence": []}]
    return store.annotate(record.id, summarise({"traces": [{"source": "t", "findings": findings}]}))


def test_alertmanager_and_the_event_log_say_which_minutes_and_whether_it_accounts(tmp_path: Path) -> None:
    with CaptureStore(tmp_path / "captures", quota_bytes=64 << 20) as store:
        healthy = stored(store, "healthy")
        verdicts = CaptureVerdicts()
        verdicts.on_analysed(healthy)

        class Source:
            def alerts(self) -> list[Alert]:
                return []

        notifier = AlertmanagerNotifier(AlertmanagerConfig(url="http://127.0.0.1:9"), Source(),
                                        hostname="n1", instance="n1:9847", verdicts=verdicts)
        alert = Alert(name="GpuLowUtilization", gpu=3, uuid="GPU-3", severity="warning", state="firing",
                      hostname="n1", active_since=FIRED - 120, firing_since=FIRED, values={}, summary="low")
        annotations = notifier._from_alert(alert, time.time())[1]["annotations"]
        assert annotations["diagnosis"] == ("healthy: no finding over its threshold (the capture saw other "
                                            "minutes than the alert judged and does not explain it)")
        assert annotations["capture_context"].startswith("GpuLowUtilization judged 2026-11-18 11:02:40 to")
        assert "does not explain the alert" in annotations["capture_context"]
        # One that accounts for its alert keeps its headline as it is.
        verdicts.on_analysed(stored(store, "input_bound"))
        annotations = notifier._from_alert(alert, time.time())[1]["annotations"]
        assert annotations["diagnosis"] == "input_bound: 50% waits"

        log = AlertEventLog(EventLogConfig(path=str(tmp_path / "alerts.jsonl")))
        try:
            CaptureEventLines(log).record_analysis(healthy)
            assert log.flush()
        finally:
            log.close()
    (line,) = (tmp_path / "alerts.jsonl").read_text().splitlines()
    event = json.loads(line)
    assert event["alert"]["accounts_for_alert"] is False
    assert event["alert"]["captured"] == "2026-11-18 11:06:43 to 11:06:53 UTC"
