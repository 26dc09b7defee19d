"""The verdicts of the captures alerts triggered, kept for the alerts' notifications.

The analysis worker reports each analysed capture here (``on_analysed``); the Alertmanager notifier
asks for the verdict of an alert's capture (``for_alert``, ``alerts.capture_verdicts``).
"""

from __future__ import annotations

import threading

from gpuscope.alerts.capture_verdicts import CAPTURE_EARLY_SECONDS, CaptureVerdict
from gpuscope.capture.alert_context import alert_context
from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.record_gains import verdict_gain_text


class CaptureVerdicts:
    """Thread-safe: the analysis thread writes, the notifier and the event log read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, int], CaptureVerdict] = {}

    def on_analysed(self, record: CaptureRecord) -> None:
        """An analysis listener: keeps the verdict of a capture an alert triggered."""
        analysis = record.analysis or {}
        verdict = analysis.get("verdict")
        alertname = record.trigger.alertname
        if record.trigger.kind != "alert" or not alertname or record.gpu is None or not verdict:
            return
        headline = str(analysis.get("headline") or verdict)
        context = alert_context(record.to_json())
        found = CaptureVerdict(record.id, record.start, str(verdict), headline,
                               context.text if context is not None else "",
                               context.accounts if context is not None else None,
                               verdict_gain_text(analysis) or "")
        with self._lock:
            key = (alertname, record.gpu)
            if key not in self._latest or self._latest[key].start <= record.start:
                self._latest[key] = found

    def for_alert(self, alertname: str, gpu: int, active_since: float) -> CaptureVerdict | None:
        """The verdict of a capture this alert triggered since it became active, or None."""
        with self._lock:
            found = self._latest.get((alertname, gpu))
        return found if found is not None and found.start >= active_since - CAPTURE_EARLY_SECONDS else None
