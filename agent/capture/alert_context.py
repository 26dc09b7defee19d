"""What a capture an alert triggered says about that alert: which minutes each looked at, and whether
the capture's verdict accounts for the alert.

An alert judges a window of samples that ends when it fires (``GpuLowUtilization``: the 2 minutes
before its condition first held, and the ``for`` it then had to hold); its capture starts seconds
later and sees the next few seconds. A job can change in between: a low-utilization alert raised
while the job built its model and initialised CUDA is followed by a capture of the job at full
speed, which is "healthy". Both are right, about different minutes. The record keeps the alert's
window and summary (``Trigger.judged_since``, ``judged_until``, ``alert_summary``), and every reader
(``gpuscope captures explain``, the Alertmanager ``diagnosis`` annotation, the status page) says the
two spans and, when the verdict does not account for the alert, says so plainly instead of seeming
to contradict it.

Which verdicts account for which alerts: an alert about an idle GPU (low utilization, idle dips, a
laggard, held or allocated idle) is explained by a finding about why the device idles
(``IDLE_KINDS``); ``GpuBusyButStalled`` by one about what the busy device does (``BUSY_KINDS``);
``GpuSharedByProcesses`` by ``shared_gpu``. For the other rules a verdict makes no claim either way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuscope.alerts.model import Transition
from gpuscope.analysis.findings import BUSY_KINDS, HEALTHY, IDLE_KINDS, INCONCLUSIVE, UNREADABLE
from gpuscope.capture.model import Trigger
from gpuscope.common.durations import format_duration

IDLE_ALERTS = ("GpuLowUtilization", "GpuFrequentIdleDips", "GpuUtilizationSkew", "GpuHeldIdle",
               "GpuAllocatedUnused")
_EXPLAINED_BY: Mapping[str, tuple[str, ...]] = {
    **{name: IDLE_KINDS for name in IDLE_ALERTS},
    "GpuBusyButStalled": BUSY_KINDS,
    "GpuSharedByProcesses": ("shared_gpu",),
}
MAX_SUMMARY_CHARS = 500  # an alert summary kept in a capture record


@dataclass(frozen=True, slots=True)
class AlertContext:
    """A capture beside the alert that triggered it."""

    alertname: str
    judged: str  # "10:00:05 to 10:04:05 UTC", or "" when the trigger did not say
    captured: str  # "10:04:07 to 10:04:17 UTC"
    # True: the verdict accounts for the alert; False: it does not; None: no verdict yet, or one
    # that makes no claim about this alert.
    accounts: bool | None
    text: str  # what a reader is told, in a few sentences

    def to_json(self) -> dict[str, Any]:
        return {"alertname": self.alertname, "judged": self.judged, "captured": self.captured,
                "accounts_for_alert": self.accounts, "note": self.text}


def alert_trigger(transition: Transition) -> Trigger:
    """The trigger of the capture an alert's firing asks for: the alert, the samples it judged (its
    window before its condition first held, to now) and its summary."""
    return Trigger("alert", alertname=transition.name,
                   judged_since=transition.active_since - (transition.window_seconds or 0.0),
                   judged_until=transition.at, alert_summary=transition.summary[:MAX_SUMMARY_CHARS])


def alert_context(record: Mapping[str, Any], *, verdict: str | None = None) -> AlertContext | None:
    """The context of a capture record (``CaptureRecord.to_json()`` or capture.json) that an alert
    or Alertmanager's webhook triggered; None for other captures. ``verdict``: the capture's verdict
    when the reader has just diagnosed it; by default the one its analysis stored."""
    trigger = record.get("trigger") or {}
    alertname = trigger.get("alertname")
    if trigger.get("kind") not in ("alert", "webhook") or not isinstance(alertname, str) or not alertname:
        return None
    start = _number(record.get("start"))
    duration = _number(record.get("duration_s")) or 0.0
    captured = _span(start, start + duration) if start is not None else ""
    since, until = _number(trigger.get("judged_since")), _number(trigger.get("judged_until"))
    judged = _span(since, until) if since is not None and until is not None else ""
    if verdict is None:
        analysis = record.get("analysis") or {}
        stored = analysis.get("verdict") if isinstance(analysis, Mapping) else None
        verdict = stored if isinstance(stored, str) else None
    accounts = _accounts(alertname, verdict)
    return AlertContext(alertname, judged, captured, accounts,
                        _text(alertname, judged, captured, start=start, until=until, verdict=verdict,
                              accounts=accounts, summary=trigger.get("alert_summary"),
                              gpu=record.get("gpu") if isinstance(record.get("gpu"), int) else "N"))


def _accounts(alertname: str, verdict: str | None) -> bool | None:
    kinds = _EXPLAINED_BY.get(alertname)
    if verdict is None or kinds is None:
        return None
    return verdict in kinds


def _text(alertname: str, judged: str, captured: str, *, start: float | None, until: float | None,
          verdict: str | None, accounts: bool | None, summary: object, gpu: object) -> str:
    spans = (f"{alertname} judged {judged}; the capture saw {captured}" if judged
             else f"The capture saw {captured}, after {alertname} fired")
    if judged and start is not None and until is not None and start >= until:
        spans += f", {format_duration(round(start - until))} after the alert fired"
    if accounts is None:
        return spans + "."
    if accounts:
        return f"{spans}. Its verdict, {verdict}, accounts for the alert."
    evidence = f" The alert's evidence stands: {summary}." if isinstance(summary, str) and summary else ""
    found = ("no finding over its threshold" if verdict == HEALTHY
             else f"nothing conclusive (its verdict is {verdict}: the trace was read only in part, or not "
                  "at all)" if verdict in (INCONCLUSIVE, UNREADABLE)
             else f"{verdict}, which is about another part of the job's time than the alert")
    return (f"{spans}. In the capture the job showed {found}: this capture does not explain the alert. "
            "The job likely behaved otherwise in the minutes the alert judged (e.g. start-up: model "
            "building, CUDA initialisation, compilation; a data-loading stall; an evaluation or "
            f"checkpoint pass).{evidence} Take another capture while the alert fires "
            f"(gpuscope capture --gpu {gpu}).")


def _span(since: float, until: float) -> str:
    first = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(since))
    last = time.strftime("%H:%M:%S" if int(since) // 86400 == int(until) // 86400 else "%Y-%m-%d %H:%M:%S",
                         time.gmtime(until))
    return f"{first} to {last} UTC"


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
