"""What the capture an alert triggered showed, as the alert's own notifications carry it.

An alert (rule, GPU) carries the latest verdict of a capture it triggered while it was active:
Alertmanager gets it as the ``diagnosis`` and ``capture_id`` annotations, so a person paged for a GPU
at 40% reads why as well, as ``capture_context`` which minutes the alert judged and which the
capture saw (a capture that does not account for its alert says so there, and in ``diagnosis``), and
as ``capture_gain`` what fixing the verdict's finding would buy.

The verdicts are kept from analysed capture records by ``gpuscope.alert_captures.verdicts``; this
module holds only what the notifier reads, so that the alerts package imports nothing of the
captures' (which import it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    # What fixing the verdict's finding would buy, in words ("fixing input_bound: 72.0 -> 54.4 ms a
    # step (25% less), assuming ...", or why it was not estimated); "" where the record has no estimate.
    gain: str = ""


class CaptureVerdictSource(Protocol):
    def for_alert(self, alertname: str, gpu: int, active_since: float) -> CaptureVerdict | None:
        """The verdict of a capture this alert triggered since it became active, or None."""
