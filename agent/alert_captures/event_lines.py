"""The alert event log's lines about captures: what a capture an alert triggered showed once it was
analysed (``capture_analysis``), and a capture trigger the agent refused (``capture_refused``).

The line format is the event log's (``gpuscope.alerts.eventlog``); these listeners read the capture
records and refusals that the alerts package does not import.
"""

from __future__ import annotations

import time

from gpuscope.alerts.eventlog import AlertEventLog
from gpuscope.capture.alert_context import alert_context
from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.record_gains import verdict_gain_text
from gpuscope.capture.refusals import RefusedTrigger


class CaptureEventLines:
    """Listeners (of the analysis worker, of the refusal log) that write to ``event_log``."""

    def __init__(self, event_log: AlertEventLog) -> None:
        self._event_log = event_log

    def record_analysis(self, record: CaptureRecord) -> None:
        """Queue the line of an analysed capture that an alert triggered (an analysis listener): the
        alert's transitions are then followed by what its capture showed."""
        analysis = record.analysis or {}
        if record.trigger.kind != "alert" or not analysis:
            return
        context = alert_context(record.to_json())
        self._event_log.record_event("capture_analysis", {
            "name": record.trigger.alertname, "gpu": record.gpu, "capture_id": record.id,
            "at": time.time(), "verdict": analysis.get("verdict"),
            "headline": analysis.get("headline"), "skipped": analysis.get("skipped"),
            "findings": [{k: f.get(k) for k in ("kind", "severity", "share", "summary", "gain")}
                         for f in analysis.get("findings") or ()],
            # What fixing the verdict's finding would buy, in the words of the alert's capture_gain.
            "verdict_gain": verdict_gain_text(analysis), "gain_together": analysis.get("gain_together"),
            "alert": context.to_json() if context is not None else None})

    def record_refusal(self, refused: RefusedTrigger) -> None:
        """Queue the line of a refused capture trigger (a refusal log listener; never blocks on I/O)."""
        trigger = refused.trigger
        self._event_log.record_event("capture_refused", {
            "at": refused.at, "trigger": trigger.kind, "name": trigger.alertname, "user": trigger.user,
            "gpu": refused.gpu, "pid": refused.pid, "mig_uuid": refused.mig_uuid,
            "reason": refused.reason, "message": refused.message, "allowed_at": refused.allowed_at})
