"""Each GPU's latest diagnosis as metrics: which capture's analysis stands for a GPU, what of it is
exported (the exact exposition), and that it survives an agent restart through the store's records."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from snapshots import FakeSource, gpu_uuid, make_gpu, make_snapshot
from test_capture_analysis import LIMITS, analysed, input_bound_trace, store_capture
from test_exporter import CATALOGUE, CatalogueRow, catalogue_section, parse_catalogue
from test_prometheus_rules import promtool

from gpuscope.capture.analysis_worker import AnalysisWorker
from gpuscope.capture.diagnoses import FindingShare, LatestDiagnoses, diagnosis_of
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.capture.store import CaptureStore
from gpuscope.exporters.diagnosis import DiagnosisCollector
from gpuscope.exporters.exposition import render_text

START = 1_717_171_000.5


def gain(share: float) -> dict[str, Any]:
    return {"before_s": 0.1, "after_s": 0.1 * (1 - share), "share": share, "assumptions": ["a loader"]}


def finding(kind: str, severity: str, share: float | None, gain_: dict[str, Any] | None = None,
            trace: str = "a.pt.trace.json") -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "share": share, "per_step": None, "summary": "...",
            "evidence": "", "site": "", "trace": trace, "gain": gain_}


def record(gpu: int | None, analysis: dict[str, Any] | None, *, start: float = START,
           token: str = "a1b2c3") -> CaptureRecord:
    where = f"gpu{gpu}" if gpu is not None else "pid4242"
    return CaptureRecord(id=f"20240531T155000Z-{where}-{token}", trigger=Trigger("user"), gpu=gpu,
                         pids=(4242,), targets=(), start=start, duration_s=2.0, bytes=0,
                         outcome="captured", analysis=analysis)


# GPU 2 as the demo's shared GPU shows it: two processes, each with shared_gpu (not estimated) and
# input_bound (estimated); GPU 1 input-bound with one estimated fix; GPU 0 healthy.
SHARED = {"verdict": "shared_gpu", "headline": "shared_gpu: ...", "traces": 2, "findings": [
    finding("shared_gpu", "high", 0.8744, {"not_estimated": "the replay does not model the others"}, "b"),
    finding("shared_gpu", "high", 0.8733, {"not_estimated": "the replay does not model the others"}, "a"),
    finding("input_bound", "moderate", 0.116, gain(0.1199), "b"),
    finding("input_bound", "low", 0.0454, gain(0.1191), "a")]}
INPUT_BOUND = {"verdict": "input_bound", "headline": "input_bound: ...", "traces": 1,
               "findings": [finding("input_bound", "high", 0.4803, gain(0.2759))]}
HEALTHY = {"verdict": "healthy", "headline": "healthy: no finding over its threshold", "traces": 1,
           "findings": []}


def collector(diagnoses: LatestDiagnoses, gpus: int = 4) -> DiagnosisCollector:
    return DiagnosisCollector(diagnoses, FakeSource(make_snapshot([make_gpu(i) for i in range(gpus)])))


def exposition(diagnoses: LatestDiagnoses, gpus: int = 4) -> str:
    return render_text(collector(diagnoses, gpus).collect()).decode()


def test_the_exposition_of_three_gpus() -> None:
    diagnoses = LatestDiagnoses()
    diagnoses.load([record(2, SHARED), record(1, INPUT_BOUND, start=START + 1),
                    record(0, HEALTHY, start=START + 2)])
    u0, u1, u2 = (gpu_uuid(i) for i in range(3))
    assert exposition(diagnoses) == f"""\
# HELP gpuscope_diagnosis_timestamp_seconds Unix time at which the capture behind the GPU's \
gpuscope_diagnosis_* series started (the newest analysed capture of the GPU), in seconds.
# TYPE gpuscope_diagnosis_timestamp_seconds gauge
gpuscope_diagnosis_timestamp_seconds{{gpu="0",uuid="{u0}"}} 1.7171710025e+09
gpuscope_diagnosis_timestamp_seconds{{gpu="1",uuid="{u1}"}} 1.7171710015e+09
gpuscope_diagnosis_timestamp_seconds{{gpu="2",uuid="{u2}"}} 1.7171710005e+09
# HELP gpuscope_diagnosis_verdict The verdict of the newest analysed capture of the GPU (value always \
1): the finding that holds its steps back most, or healthy, inconclusive or unreadable.
# TYPE gpuscope_diagnosis_verdict gauge
gpuscope_diagnosis_verdict{{gpu="0",uuid="{u0}",verdict="healthy"}} 1.0
gpuscope_diagnosis_verdict{{gpu="1",uuid="{u1}",verdict="input_bound"}} 1.0
gpuscope_diagnosis_verdict{{gpu="2",uuid="{u2}",verdict="shared_gpu"}} 1.0
# HELP gpuscope_diagnosis_finding_share Share (0-1) of the step time a finding of the newest analysed \
capture of the GPU accounts for, by finding and its severity (the largest over the capture's traces).
# TYPE gpuscope_diagnosis_finding_share gauge
gpuscope_diagnosis_finding_share{{finding="input_bound",gpu="1",severity="high",uuid="{u1}"}} 0.4803
gpuscope_diagnosis_finding_share{{finding="input_bound",gpu="2",severity="moderate",uuid="{u2}"}} 0.116
gpuscope_diagnosis_finding_share{{finding="shared_gpu",gpu="2",severity="high",uuid="{u2}"}} 0.8744
# HELP gpuscope_diagnosis_gain_share Share (0-1) of the step time that fixing the finding would win \
back, as the replay of the newest analysed capture of the GPU estimates it; absent when not estimated.
# TYPE gpuscope_diagnosis_gain_share gauge
gpuscope_diagnosis_gain_share{{finding="input_bound",gpu="1",uuid="{u1}"}} 0.2759
gpuscope_diagnosis_gain_share{{finding="input_bound",gpu="2",uuid="{u2}"}} 0.1199
# HELP gpuscope_diagnosis_gain_together_share Share (0-1) of the step time that all the estimated \
fixes of the newest analysed capture of the GPU would win back together; absent when none was estimated.
# TYPE gpuscope_diagnosis_gain_together_share gauge
gpuscope_diagnosis_gain_together_share{{gpu="1",uuid="{u1}"}} 0.2759
gpuscope_diagnosis_gain_together_share{{gpu="2",uuid="{u2}"}} 0.1199
"""


def test_the_collector_renders_exactly_the_catalogue() -> None:
    documented = set(parse_catalogue(catalogue_section(CATALOGUE.read_text(), "Diagnosis")))
    diagnoses = LatestDiagnoses()
    diagnoses.load([record(2, SHARED)])
    emitted = set()
    for family in collector(diagnoses).collect():
        label_sets = {frozenset(s.labels) for s in family.samples}
        assert len(label_sets) == 1, f"{family.name}: samples with different label names"
        emitted.add(CatalogueRow(family.name, family.type, family.unit, label_sets.pop(),
                                 family.documentation))
    assert emitted == documented


def test_all_fixes_together_come_from_the_replay_of_them_all() -> None:
    analysis = {"verdict": "host_sync", "findings": [
        finding("host_sync", "high", 0.30, gain(0.25)),
        finding("launch_bound", "moderate", 0.10, gain(0.08)),
        finding("tensor_cores_idle", "moderate", 0.2, {"not_estimated": "not modelled"})],
        "gain_together": gain(0.31)}
    diagnosis = diagnosis_of(record(0, analysis))
    assert diagnosis is not None and diagnosis.gain_together == 0.31
    assert diagnosis.findings == (FindingShare("host_sync", "high", 0.30, 0.25),
                                  FindingShare("launch_bound", "moderate", 0.10, 0.08),
                                  FindingShare("tensor_cores_idle", "moderate", 0.2, None))
    # Nothing estimated: no together either.
    nothing = {"verdict": "small_grids", "findings": [
        finding("small_grids", "high", 0.9, {"not_estimated": "the replay models no fix for small_grids"})]}
    diagnosis = diagnosis_of(record(0, nothing))
    assert diagnosis is not None and diagnosis.gain_together is None
    text = exposition(_holding(record(0, nothing)))
    assert "gpuscope_diagnosis_gain" not in text
    assert f'finding="small_grids",gpu="0",severity="high",uuid="{gpu_uuid(0)}"}} 0.9' in text
    # Two processes with one estimated fix each (no trace replayed two): the larger stands for all.
    apart = {"verdict": "host_sync", "findings": [finding("host_sync", "high", 0.3, gain(0.2), "a"),
                                                  finding("launch_bound", "high", 0.3, gain(0.25), "b")]}
    diagnosis = diagnosis_of(record(0, apart))
    assert diagnosis is not None and diagnosis.gain_together == 0.25


def test_a_finding_without_a_share_has_no_share_series_but_keeps_its_gain_and_verdict() -> None:
    cpu_only = {"verdict": "host_sync", "findings": [finding("host_sync", "high", None, gain(0.4))]}
    text = exposition(_holding(record(1, cpu_only)))
    u1 = gpu_uuid(1)
    assert f'gpuscope_diagnosis_verdict{{gpu="1",uuid="{u1}",verdict="host_sync"}} 1.0' in text
    assert "gpuscope_diagnosis_finding_share" not in text
    assert f'gpuscope_diagnosis_gain_share{{finding="host_sync",gpu="1",uuid="{u1}"}} 0.4' in text


def test_only_known_names_and_shares_within_0_1_pass() -> None:
    """A record read back from the store could say anything: the label values stay a closed set."""
    edited = {"verdict": "input_bound", "findings": [
        finding("input_bound", "high", 1.7, gain(-0.2)), finding("made_up", "high", 0.5, gain(0.5)),
        finding("host_sync", "critical", 0.5), finding("launch_bound", "low", float("nan")),
        "not a finding", {"kind": ["input_bound"]}]}
    diagnosis = diagnosis_of(record(0, edited))
    assert diagnosis is not None
    assert diagnosis.findings == (FindingShare("input_bound", "high", 1.0, 0.0),
                                  FindingShare("launch_bound", "low", None, None))
    for analysis in ({"verdict": "made_up", "findings": []}, {"verdict": None, "skipped": "too large"},
                     {"verdict": ["healthy"]}, None):
        assert diagnosis_of(record(0, analysis)) is None, analysis
    assert diagnosis_of(record(None, HEALTHY)) is None  # a capture of no GPU


def test_the_newest_analysed_capture_of_each_gpu_stands_and_a_skipped_one_does_not_replace_it() -> None:
    diagnoses = LatestDiagnoses()
    diagnoses.on_analysed(record(1, INPUT_BOUND, start=START + 10, token="000001"))
    diagnoses.on_analysed(record(1, HEALTHY, start=START, token="000002"))  # older: analysed late
    diagnoses.on_analysed(record(1, {"verdict": None, "skipped": "too large"}, start=START + 20))
    diagnoses.on_analysed(record(3, HEALTHY, start=START + 5))
    assert [(d.gpu, d.verdict) for d in diagnoses.latest()] == [(1, "input_bound"), (3, "healthy")]
    diagnoses.on_analysed(record(1, HEALTHY, start=START + 30, token="000003"))
    assert [(d.gpu, d.verdict, d.start) for d in diagnoses.latest()] == [
        (1, "healthy", START + 30), (3, "healthy", START + 5)]


def test_a_gpu_the_snapshot_does_not_list_exports_nothing() -> None:
    diagnoses = _holding(record(5, INPUT_BOUND), record(0, HEALTHY))
    text = exposition(diagnoses, gpus=2)
    assert 'gpu="0"' in text and 'gpu="5"' not in text
    assert list(DiagnosisCollector(diagnoses, FakeSource(None)).collect()) == []  # before the first tick
    assert list(collector(LatestDiagnoses()).collect()) == []  # no diagnosis yet: no family at all


def test_describe_does_not_collect() -> None:
    class Exploding(LatestDiagnoses):
        def latest(self) -> list[Any]:
            raise AssertionError("registration must not read the diagnoses")

    assert list(DiagnosisCollector(Exploding(), FakeSource(None)).describe()) == []


def test_the_analysis_of_a_stored_capture_is_the_diagnosis_after_a_restart(tmp_path: Path) -> None:
    """The worker's listener and, after a restart, the store's records give the same diagnosis."""
    root = tmp_path / "captures"
    heard = LatestDiagnoses()
    with CaptureStore(root, quota_bytes=256 << 20) as store:
        worker = AnalysisWorker(store, LIMITS)
        worker.add_listener(heard.on_analysed)
        worker.start()
        try:
            stored = analysed(worker, store, store_capture(store, input_bound_trace()))
        finally:
            worker.stop(timeout=5)
    (live,) = heard.latest()
    assert (live.gpu, live.capture_id, live.verdict) == (3, stored.id, "input_bound")
    (kept,) = live.findings
    assert kept.kind == "input_bound" and kept.share == pytest.approx(0.5, abs=0.01)
    assert stored.analysis is not None
    assert kept.gain_share == stored.analysis["findings"][0]["gain"]["share"]  # estimated: a number
    assert live.gain_together == kept.gain_share  # one estimated fix: that fix is all of them
    on_disk = json.loads((root / stored.id / "capture.json").read_text())
    assert on_disk["analysis"]["verdict"] == "input_bound"
    with CaptureStore(root, quota_bytes=256 << 20) as reopened:
        restarted = LatestDiagnoses()
        restarted.load(reopened.list())
    assert restarted.latest() == [live]


def _holding(*records: CaptureRecord) -> LatestDiagnoses:
    diagnoses = LatestDiagnoses()
    diagnoses.load(records)
    return diagnoses


def test_the_documented_queries_give_held_gpu_hours_by_cause_and_by_fix(tmp_path: Path) -> None:
    """docs/metrics.md's PromQL, run by promtool over an hour (not a week: promtool evaluates the rules
    every minute) of three held GPUs: GPU 0 input-bound (its fix wins back 30% of the step time), GPU 1
    undiagnosed, GPU 3 diagnosed two days ago; GPU 2, diagnosed but not held, counts in neither."""
    section = catalogue_section(CATALOGUE.read_text(), "Diagnosis")
    documented = re.findall(r"```promql\n(.*?)```", section, re.DOTALL)
    queries = [query.replace("[7d:1m]", "[1h:1m]") for query in documented]
    assert len(queries) == 2 and all("[1h:1m]" in query for query in queries)
    rules = {"groups": [{"name": "docs", "rules": [
        {"record": "by_cause", "expr": queries[0]}, {"record": "by_fix", "expr": queries[1]}]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    held = [{"series": f'gpu_process_info{{instance="a",gpu="{gpu}",uuid="U{gpu}",pid="{gpu}"}}',
             "values": "1x60"} for gpu in (0, 1, 3)]
    diagnosed = [{"series": f'gpuscope_diagnosis_{name}{{instance="a",gpu="{gpu}",uuid="U{gpu}"{extra}}}',
                  "values": f"{value}x60"} for gpu, start in ((0, 0), (2, 0), (3, -2 * 86400))
                 for name, extra, value in (("verdict", ',verdict="input_bound"', "1"),
                                            ("timestamp_seconds", "", str(start)),
                                            ("gain_share", ',finding="input_bound"', "0.3"))]
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": held + diagnosed,
        "promql_expr_test": [
            {"expr": "by_cause", "eval_time": "1h",
             "exp_samples": [{"labels": 'by_cause{verdict="input_bound"}', "value": 1 / 3}]},
            # An hour at 1m steps is 61 samples, both ends included: 0.3 of 61 minutes, in hours.
            {"expr": "by_fix", "eval_time": "1h",
             "exp_samples": [{"labels": 'by_fix{finding="input_bound"}', "value": 0.3 * 61 / 60}]}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run([promtool(), "test", "rules", "tests.yml"], capture_output=True, text=True,
                            timeout=120, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
