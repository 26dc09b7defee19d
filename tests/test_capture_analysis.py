"""Each stored capture analysed in the background: the record's summary, the limits, and where the
verdict shows (the metrics, `captures ls`, the status page, the event log, Alertmanager)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from test_analysis_diagnose import KinetoTrace, kernels, steps

from gpuscope.alert_captures.event_lines import CaptureEventLines
from gpuscope.alert_captures.verdicts import CaptureVerdicts
from gpuscope.alerts.alertmanager import AlertmanagerNotifier
from gpuscope.alerts.config import AlertmanagerConfig, EventLogConfig
from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.alerts.model import Alert
from gpuscope.capture.analysis_worker import AnalysisLimits, AnalysisWorker, summarise
from gpuscope.capture.model import CaptureRecord, CaptureTarget, TargetOutcome, Trigger
from gpuscope.capture.store import CaptureStore
from gpuscope.cli.capture import _finding, _gain
from gpuscope.exporters.captures import CaptureCollector
from gpuscope.web.status_captures import finding

LIMITS = AnalysisLimits(max_trace_bytes=64 << 20, cpu_seconds=60, memory_bytes=2 << 30)


def input_bound_trace() -> bytes:
    def build(t: KinetoTrace, start: float, n: int) -> None:
        t.host("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", start,
               5_000.0)
        kernels(t, start + 5_000.0, 5_000.0, each=500.0, gap=0.0)

    trace = steps(build)
    return json.dumps({"deviceProperties": [{"id": 0}], "traceEvents": trace.events}).encode()


ALERT = Trigger("alert", alertname="GpuLowUtilization")


def store_capture(store: CaptureStore, trace: bytes, *, suffix: str = ".pt.trace.json",
                  trigger: Trigger = ALERT) -> CaptureRecord:
    staging = store.begin(gpu=3)
    with staging.new_file("node-1_4242", suffix) as new:
        new.file.write(trace)
        relative = new.publish()
    target = CaptureTarget("kineto", 4242)
    record = CaptureRecord(id=staging.id, trigger=trigger, gpu=3, pids=(4242,),
                           targets=(TargetOutcome(target, "captured", (relative,)),), start=time.time(),
                           duration_s=2.0, bytes=0, outcome="captured", hostname="node-1")
    return store.commit(staging, record)


@pytest.fixture
def store(tmp_path: Path) -> CaptureStore:
    with CaptureStore(tmp_path / "captures", quota_bytes=256 << 20) as opened:
        yield opened


def analysed(worker: AnalysisWorker, store: CaptureStore, record: CaptureRecord,
             timeout: float = 60.0) -> CaptureRecord:
    """Submit the record to the running worker and wait for its analysis in the store."""
    worker.submit(record)
    deadline = time.monotonic() + timeout
    while (current := store.get(record.id)).analysis is None:
        assert time.monotonic() < deadline, "no analysis within the timeout"
        time.sleep(0.05)
    return current


def test_a_stored_capture_gets_its_verdict_in_its_record(store: CaptureStore, tmp_path: Path) -> None:
    worker = AnalysisWorker(store, LIMITS)
    heard: list[CaptureRecord] = []
    worker.add_listener(heard.append)
    worker.start()
    try:
        record = analysed(worker, store, store_capture(store, input_bound_trace()))
    finally:
        worker.stop(timeout=5)
    analysis = record.analysis
    assert analysis is not None
    assert analysis["verdict"] == "input_bound"
    assert analysis["headline"].startswith("input_bound: 50% of the step time the device waits for input")
    (finding,) = analysis["findings"]
    assert finding["severity"] == "high" and finding["share"] == pytest.approx(0.5, abs=0.01)
    assert finding["evidence"].startswith("enumerate(DataLoader)")
    # What prefetching the input would buy, from the replay in the child, rides along.
    assert finding["gain"]["before_s"] == pytest.approx(0.010, rel=0.01)
    assert 0 < finding["gain"]["after_s"] <= finding["gain"]["before_s"]
    assert any("loader" in a for a in finding["gain"]["assumptions"])
    assert heard == [record]
    assert worker.finding_counts()["input_bound"] == 1 and worker.finding_counts()["healthy"] == 0
    # capture.json on disk holds it too: an agent restarted later lists the same verdict.
    reopened = json.loads((store.path(record.id) / "capture.json").read_text())
    assert reopened["analysis"]["verdict"] == "input_bound"
    assert store.total_bytes() == sum(f.size for f in store.files(record.id))


def test_traces_over_the_size_cap_are_skipped_with_the_reason(store: CaptureStore) -> None:
    worker = AnalysisWorker(store, AnalysisLimits(max_trace_bytes=1 << 20, cpu_seconds=60,
                                                  memory_bytes=2 << 30))
    record = store_capture(store, b" " * (2 << 20))
    summary = worker.analyse(record)
    assert summary["verdict"] is None
    assert "larger than capture.analysis.max_trace_bytes (1.0 MiB)" in summary["skipped"]


def test_an_analysis_over_its_memory_cap_is_stopped_not_the_agent(store: CaptureStore) -> None:
    """An event with a 48 MiB name must be held whole to be parsed: over a 64 MiB address space."""
    worker = AnalysisWorker(store, AnalysisLimits(max_trace_bytes=128 << 20, cpu_seconds=60,
                                                  memory_bytes=64 << 20))
    huge = b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 1, "name": "' + b"a" * (48 << 20)
    summary = worker.analyse(store_capture(store, huge + b'"}]}'))
    assert summary["verdict"] is None
    assert summary["skipped"].startswith("the analysis was stopped by its limits (capture.analysis: "
                                         "cpu_seconds 60, memory_bytes 64.0 MiB)")
    # The same capture within the default limits is analysed.
    assert AnalysisWorker(store, LIMITS).analyse(store_capture(store, input_bound_trace()))["verdict"] == (
        "input_bound")


def test_a_trace_that_cannot_be_read_is_skipped_with_the_readers_message(store: CaptureStore) -> None:
    summary = AnalysisWorker(store, LIMITS).analyse(store_capture(store, b'{"traceEvents": [{"ph": "X", '))
    assert summary["verdict"] is None
    assert ".pt.trace.json" in summary["skipped"]


def test_only_captured_records_with_traces_are_queued(store: CaptureStore) -> None:
    worker = AnalysisWorker(store, LIMITS)  # not started: what is queued stays queued
    record = store_capture(store, input_bound_trace())
    from dataclasses import replace
    worker.submit(replace(record, outcome="empty"))
    worker.submit(replace(record, files=("capture.json",)))
    assert worker._queue.qsize() == 0
    for _ in range(20):
        worker.submit(record)
    assert worker._queue.qsize() == 16  # the rest are marked skipped at once
    assert store.get(record.id).analysis == {"verdict": None,
                                             "skipped": "too many captures waiting for analysis"}


def test_the_summary_keeps_the_most_severe_findings_first_and_bounded() -> None:
    report = {"traces": [
        {"source": "/x/a.pt.trace.json", "findings": [
            {"kind": "host_sync", "severity": "moderate", "share": None, "per_step": 2.0,
             "summary": "s" * 900, "evidence": [{"name": "aten::nonzero", "site": "train.py(3): f"}]}]},
        {"source": "/x/b.pt.trace.json", "findings": [
            {"kind": "input_bound", "severity": "high", "share": 0.4, "summary": "waits", "evidence": []}]}]}
    summary = summarise(report)
    assert summary["verdict"] == "input_bound"
    assert [f["kind"] for f in summary["findings"]] == ["input_bound", "host_sync"]
    assert summary["findings"][1]["site"] == "train.py(3): f"
    assert summary["findings"][1]["trace"] == "a.pt.trace.json"
    assert len(summary["findings"][1]["summary"]) == 300
    assert summarise({"traces": [{"findings": []}]})["verdict"] == "healthy"
    # A low finding (an opportunity) is kept, and the verdict stays healthy.
    low = summarise({"traces": [{"source": "c", "findings": [
        {"kind": "optimizer_heavy", "severity": "low", "share": 0.26, "summary": "fused", "evidence": []}]}]})
    assert (low["verdict"], [f["kind"] for f in low["findings"]]) == ("healthy", ["optimizer_heavy"])
    assert low["headline"].startswith("healthy: ")
    # Without a finding, healthy only where every trace showed enough to say so.
    unread = summarise({"traces": [{"source": "e", "verdict": "unreadable", "findings": [],
                                    "unreadable": "Nothing to diagnose: it holds no events."}]})
    assert unread["verdict"] == "unreadable"
    assert unread["headline"] == "unreadable: Nothing to diagnose: it holds no events."
    partial = summarise({"traces": [
        {"source": "f", "verdict": "healthy", "findings": []},
        {"source": "g", "verdict": "inconclusive", "findings": [], "partial": ["6 of the 8 GPUs ..."]}]})
    assert (partial["verdict"], partial["headline"]) == ("inconclusive", "inconclusive: 6 of the 8 GPUs ...")
    # At equal severity the device's idle time comes before what it is busy with.
    both = summarise({"traces": [{"source": "d", "findings": [
        {"kind": "tensor_cores_idle", "severity": "high", "share": 0.6, "summary": "fp32", "evidence": []},
        {"kind": "input_bound", "severity": "high", "share": 0.3, "summary": "waits", "evidence": []}]}]})
    assert [f["kind"] for f in both["findings"]] == ["input_bound", "tensor_cores_idle"]


def test_the_summary_keeps_each_gain_bounded_or_the_reason_there_is_none() -> None:
    estimated = {"before_s": 0.072, "after_s": 0.054, "share": 0.25, "assumptions": ["a" * 900] * 9}
    summary = summarise({"traces": [{"source": "t", "gain_together": {**estimated, "share": 0.3},
                                     "findings": [
        {"kind": "host_sync", "severity": "high", "share": 0.3, "summary": "s", "evidence": [],
         "gain": estimated},
        {"kind": "costly_op", "severity": "high", "share": 0.2, "summary": "s", "evidence": [],
         "gain": {"not_estimated": "r" * 900}},
        {"kind": "input_bound", "severity": "high", "share": 0.2, "summary": "s", "evidence": [],
         "gain": {"before_s": "x"}}]}]})
    gains = {f["kind"]: f["gain"] for f in summary["findings"]}
    assert gains["host_sync"]["share"] == 0.25 and gains["host_sync"]["after_s"] == 0.054
    assert len(gains["host_sync"]["assumptions"]) == 4
    assert all(len(a) == 300 for a in gains["host_sync"]["assumptions"])
    assert gains["costly_op"] == {"not_estimated": "r" * 300}
    assert gains["input_bound"] is None  # malformed: dropped, not guessed
    assert summary["gain_together"]["share"] == 0.3
    assert "gain_together" not in summarise({"traces": [{"source": "t", "findings": []}]})


def test_the_findings_counter_has_every_finding_from_zero(store: CaptureStore) -> None:
    class Stats:
        def capture_counts(self) -> dict:
            return {}

        def store_bytes(self) -> int:
            return 0

        def last_capture_timestamp(self) -> None:
            return None

        def budget_remaining(self) -> int:
            return 6

    worker = AnalysisWorker(store, LIMITS)
    families = {f.name: f for f in CaptureCollector(Stats(), worker).collect()}
    samples = {s.labels["finding"]: s.value for s in families["gpuscope_capture_findings"].samples}
    assert samples == {"input_bound": 0, "host_bound": 0, "host_sync": 0, "launch_bound": 0,
                       "communication_wait": 0, "idle_between_steps": 0, "shared_gpu": 0,
                       "tensor_cores_idle": 0, "costly_op": 0, "dominant_op": 0, "layout_conversion": 0,
                       "small_grids": 0, "optimizer_heavy": 0, "healthy": 0, "inconclusive": 0,
                       "unreadable": 0}


def test_captures_ls_and_the_status_page_show_the_verdict() -> None:
    assert _finding(None) == "-"
    assert _finding({"verdict": None, "skipped": "too large"}) == "skipped"
    assert _finding({"verdict": "host_sync"}) == "host_sync"
    assert page_finding({"verdict": "input_bound", "headline": "input_bound: <b>50%</b>"}) == (
        '<span class="verdict moderate">input_bound</span><div class="small headline" title="input_bound: '
        '&lt;b&gt;50%&lt;/b&gt;">input_bound: &lt;b&gt;50%&lt;/b&gt;</div>')
    assert "not analysed" in page_finding({"verdict": None, "skipped": "x"})


GAIN = {"before_s": 0.072, "after_s": 0.0544, "share": 0.2444, "assumptions": ["the <next> batch is ready"]}


def gained(gain: dict[str, Any] | None, kind: str = "input_bound") -> dict[str, Any]:
    """An analysis whose verdict's finding has this gain (None: analysed before gains were estimated)."""
    finding = {"kind": kind, "severity": "high", "share": 0.25, "summary": "25% waits", "evidence": [],
               "gain": gain}
    return summarise({"traces": [{"source": "t", "findings": [finding]}]})


def test_captures_ls_and_the_status_page_show_what_fixing_the_verdict_would_buy() -> None:
    assert _gain(gained(GAIN)) == "-24% step"
    assert _gain(gained({"not_estimated": "no model"}, "costly_op")) == "n/e"
    assert _gain(gained(None)) == _gain({"verdict": "healthy", "findings": []}) == _gain(None) == "-"
    cell = page_finding(gained(GAIN))
    # The step times under the headline, what the estimate assumes on hover (escaped).
    assert ('<div class="small gain" title="72.0 -&gt; 54.4 ms a step (24% less), assuming the &lt;next&gt; '
            'batch is ready">fixing it: 72.0 -&gt; 54.4 ms a step (24% less)</div>') in cell
    assert cell.index("headline") < cell.index("fixing it")
    assert ('<div class="small muted gain" title="no &lt;model&gt;">fixing it: not estimated</div>'
            in page_finding(gained({"not_estimated": "no <model>"}, "costly_op")))
    assert "fixing it" not in page_finding(gained(None))
    assert "fixing it" not in page_finding({"verdict": "healthy", "headline": "healthy: no finding",
                                            "findings": []})


def page_finding(analysis: dict[str, Any]) -> str:
    """The status page's verdict cell of a user's capture with this analysis."""
    return finding(CaptureRecord(id="c", trigger=Trigger("user", user="unix"), gpu=0, pids=(), targets=(),
                                 start=0.0, duration_s=1.0, bytes=0, outcome="captured", analysis=analysis))


def analysed_record(store: CaptureStore, trigger: Trigger,
                    gain: dict[str, Any] | None = None) -> CaptureRecord:
    record = store_capture(store, input_bound_trace(), trigger=trigger)
    finding = {"kind": "input_bound", "severity": "high", "share": 0.5, "summary": "50% waits",
               "evidence": [], "gain": gain}
    return store.annotate(record.id, summarise({"traces": [{"source": "t", "findings": [finding]}]}))


def test_the_alert_that_triggered_a_capture_carries_its_verdict_to_alertmanager(
        store: CaptureStore) -> None:
    verdicts = CaptureVerdicts()
    record = analysed_record(store, ALERT)
    verdicts.on_analysed(record)
    verdicts.on_analysed(analysed_record(store, Trigger("user", user="alice")))  # not an alert's

    class Source:
        def alerts(self) -> list[Alert]:
            return []

    notifier = AlertmanagerNotifier(AlertmanagerConfig(url="http://127.0.0.1:9"), Source(), hostname="n1",
                                    instance="n1:9847", verdicts=verdicts)

    def alert(name: str, gpu: int, since: float) -> Alert:
        return Alert(name=name, gpu=gpu, uuid="GPU-3", severity="warning", state="firing", hostname="n1",
                     active_since=since, firing_since=since, values={}, summary="low")

    _, item = notifier._from_alert(alert("GpuLowUtilization", 3, record.start - 60), time.time())
    assert item["annotations"]["diagnosis"] == "input_bound: 50% waits"
    assert item["annotations"]["capture_id"] == record.id
    assert "capture_gain" not in item["annotations"]  # a record analysed before gains were estimated
    # What fixing the verdict's finding would buy, and what that assumes; or why it is not estimated.
    for gain, said in ((GAIN, "fixing input_bound: 72.0 -> 54.4 ms a step (24% less), assuming the <next> "
                              "batch is ready"),
                       ({"not_estimated": "why"}, "fixing input_bound: gain not estimated: why")):
        verdicts.on_analysed(analysed_record(store, ALERT, gain))
        _, item = notifier._from_alert(alert("GpuLowUtilization", 3, record.start - 60), time.time())
        assert item["annotations"]["capture_gain"] == said
    for other in (alert("GpuLowUtilization", 2, record.start - 60), alert("GpuThrottled", 3, 0.0),
                  alert("GpuLowUtilization", 3, record.start + 600)):  # a later alert: not its capture
        assert "diagnosis" not in notifier._from_alert(other, time.time())[1]["annotations"]


def test_the_event_log_follows_an_alert_with_what_its_capture_showed(store: CaptureStore,
                                                                     tmp_path: Path) -> None:
    log = AlertEventLog(EventLogConfig(path=str(tmp_path / "alerts.jsonl")))
    try:
        lines = CaptureEventLines(log)
        lines.record_analysis(analysed_record(store, Trigger("alert", alertname="GpuLowUtilization")))
        lines.record_analysis(analysed_record(store, Trigger("user", user="alice")))
        lines.record_analysis(analysed_record(store, Trigger("alert", alertname="GpuLowUtilization"), GAIN))
        assert log.flush()
    finally:
        log.close()
    line, with_gain = (tmp_path / "alerts.jsonl").read_text().splitlines()
    event = json.loads(line)
    assert event["event"] == "capture_analysis" and event["name"] == "GpuLowUtilization"
    assert (event["gpu"], event["verdict"]) == (3, "input_bound")
    assert event["findings"] == [{"kind": "input_bound", "severity": "high", "share": 0.5,
                                  "summary": "50% waits", "gain": None}]
    assert event["verdict_gain"] is None and event["gain_together"] is None
    event = json.loads(with_gain)
    assert event["findings"][0]["gain"] == GAIN
    assert event["verdict_gain"] == ("fixing input_bound: 72.0 -> 54.4 ms a step (24% less), assuming the "
                                     "<next> batch is ready")
