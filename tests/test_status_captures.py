"""The status page's captures table (web/status_captures.py), rendered from records built here:
verdicts coloured by kind with the explanation under them, triggers in words, and what became of the
alert a capture was taken for (firing now, resolved and when, on which GPU)."""

from __future__ import annotations

import re
from typing import Any

from snapshots import make_snapshot

from gpuscope.alerts.model import Alert, Transition
from gpuscope.alerts.resolved import ResolvedAlerts
from gpuscope.capture.model import CaptureRecord, Trigger
from gpuscope.version import __version__
from gpuscope.web.status_captures import captures_section, trigger_text, verdict_kind
from gpuscope.web.status_page import StatusView, render_status_page
from gpuscope.web.utilization_history import UtilizationHistory

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
STALLED = {"verdict": "input_bound", "headline": "input_bound: the device waits 41% of each step for input",
           "findings": [{"kind": "input_bound", "severity": "high"}]}


def record(n: int, trigger: Trigger, analysis: dict[str, Any] | None = None, gpu: int = 3) -> CaptureRecord:
    return CaptureRecord(id=f"cap-{n}", trigger=trigger, gpu=gpu, pids=(1,), targets=(), start=NOW - 900 + n,
                         duration_s=10.0, bytes=1 << 20, outcome="captured", analysis=analysis)


def rows(html: str) -> dict[str, str]:
    return dict(re.findall(r'<tr class="capture" id="capture-([^"]+)">(.*?)</tr>', html, re.S))


def stalled_alert() -> Alert:
    return Alert(name="GpuBusyButStalled", gpu=3, uuid="GPU-3", severity="warning", state="firing",
                 hostname="n", active_since=NOW - 1000, firing_since=NOW - 940, values={}, summary="stalled")


def resolution(at: float, gpu: int = 3) -> Transition:
    return Transition(name="GpuBusyButStalled", gpu=gpu, uuid=f"GPU-{gpu}", severity="warning", hostname="n",
                      previous="firing", state="resolved", at=at, active_since=NOW - 1000, values={},
                      summary="stalled")


def test_verdicts_are_coloured_by_kind_with_their_explanation_under_them() -> None:
    moderate = {"verdict": "tensor_cores_idle", "headline": "h",
                "findings": [{"kind": "tensor_cores_idle", "severity": "moderate"}]}
    analyses: list[dict[str, Any]] = [
        STALLED, moderate, {"verdict": "healthy", "headline": "healthy: no finding"},
        {"verdict": "inconclusive", "headline": "inconclusive: short"},
        {"verdict": "unreadable", "headline": "unreadable: empty"},
        {"verdict": None, "skipped": "too many waiting"}]
    captures = [record(n, Trigger("user", user="unix"), analysis) for n, analysis in enumerate(analyses, 1)]
    shown = rows(captures_section(captures, (), downloads=False, now=NOW, alerts=[], resolved=[]))
    assert '<span class="verdict high">input_bound</span>' in shown["cap-1"]
    assert "the device waits 41% of each step for input</div>" in shown["cap-1"]
    assert '<span class="verdict moderate">tensor_cores_idle</span>' in shown["cap-2"]
    assert '<span class="verdict healthy">healthy</span>' in shown["cap-3"]
    assert '<span class="verdict unsure">inconclusive</span>' in shown["cap-4"]
    assert '<span class="verdict unsure">unreadable</span>' in shown["cap-5"]
    assert '<span class="verdict unsure" title="too many waiting">not analysed</span>' in shown["cap-6"]
    assert verdict_kind({"verdict": "partial"}) == "unsure"


def test_triggers_read_as_a_person_says_them() -> None:
    assert trigger_text(Trigger("user", user="unix")) == (
        'on demand <span class="muted">(control socket)</span>')
    assert trigger_text(Trigger("user", user="token")) == (
        'on demand <span class="muted">(control API over TCP)</span>')
    assert trigger_text(Trigger("fleet", user="unix")) == (
        'fleet capture <span class="muted">(control socket)</span>')
    assert trigger_text(Trigger("alert", alertname="GpuLowUtilization")) == "alert <b>GpuLowUtilization</b>"
    assert trigger_text(Trigger("webhook", alertname="<x>")) == "Alertmanager's webhook: <b>&lt;x&gt;</b>"
    assert "user unix" not in captures_section([record(1, Trigger("user", user="unix"))], (), downloads=False,
                                               now=NOW, alerts=[], resolved=[])


def test_an_alerts_capture_says_on_which_gpu_it_fired_and_whether_it_resolved_and_when() -> None:
    trigger = Trigger("alert", alertname="GpuBusyButStalled", judged_until=NOW - 940)
    captures = [record(1, trigger, STALLED)]
    firing = rows(captures_section(captures, (), downloads=False, now=NOW, alerts=[stalled_alert()],
                                   resolved=[]))["cap-1"]
    assert "on GPU 3, fired 2027-01-15 07:44:20 UTC; " in firing
    assert '<span class="fate firing">firing now</span>' in firing
    # Resolved: when, from the engine's resolutions (another GPU's, or an earlier episode's, do not count).
    ended = rows(captures_section(captures, (), downloads=False, now=NOW, alerts=[],
                                  resolved=[resolution(NOW - 300, gpu=4), resolution(NOW - 200),
                                            resolution(NOW - 5000)]))["cap-1"]
    assert '<span class="fate resolved">resolved 2027-01-15 07:56:40 UTC</span>' in ended
    assert "input_bound" in ended and "GpuBusyButStalled" in ended
    gone = rows(captures_section(captures, (), downloads=False, now=NOW, alerts=[], resolved=[]))["cap-1"]
    assert '<span class="fate resolved">no longer active</span>' in gone


def test_the_page_wires_the_resolutions_to_the_captures_table() -> None:
    view = StatusView(snapshot=make_snapshot(timestamp=NOW), stale=False, alerts=[],
                      captures=[record(1, Trigger("alert", alertname="GpuBusyButStalled"), STALLED)],
                      history=UtilizationHistory().series, version=__version__, now=NOW,
                      resolved=[resolution(NOW - 200)])
    page = render_status_page(view).decode()
    assert "resolved 2027-01-15 07:56:40 UTC" in page


def test_the_resolutions_kept_are_the_latest_ones_newest_first() -> None:
    kept = ResolvedAlerts(kept=2)
    for at in (1.0, 2.0, 3.0):
        kept(resolution(at))
    firing = Transition(name="GpuThrottled", gpu=0, uuid="GPU-0", severity="warning", hostname="n",
                        previous="pending", state="firing", at=4.0, active_since=0.0, values={}, summary="s")
    kept(firing)  # only resolutions are kept
    assert [t.at for t in kept.recent()] == [3.0, 2.0]
