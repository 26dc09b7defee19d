"""What the capture an alert triggered showed, for the alert's own notifications.

The analysis worker reports each analysed capture here; an alert (rule, GPU) then carries the latest
verdict of a capture it triggered while it was active: Alertmanager gets it as the ``diagnosis`` and
``capture_id`` annotations, so a person paged for a GPU at 40% reads why as well, and as
``capture_context`` which minutes the alert judged and which the capture saw (a capture that does
not account for its alert says so there, and in ``diagnosis``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpuscope.capture.alert_context import alert_context
from gpuscope.capture.model import CaptureRecord

CAPTURE_EARLY_SECONDS = 5.0  # a capture may start just before the engine's clock marks the alert active


@dataclass(frozen=True, slots=True)
class CaptureVerdict:
    capture_id: str
    start: float  # Unix seconds
    verdict: str
    headline: str
    # The minutes the alert judged and those the capture saw, and whether the verdict accounts for
    # the alert (capture/alert_context.py); "" and None where the record does not say.
    context: str = ""
    accounts: bool | None = None


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
                               context.accounts if context is not None else None)
        with self._lock:
            key = (alertname, record.gpu)
            if key not in self._latest or self._latest[key].start <= record.start:
                self._latest[key] = found

    def for_alert(self, alertname: str, gpu: int, active_since: float) -> CaptureVerdict | None:
        """The verdict of a capture this alert triggered since it became active, or None."""
        with self._lock:
            found = self._latest.get((alertname, gpu))
        return found if found is not None and found.start >= active_since - CAPTURE_EARLY_SECONDS else None
