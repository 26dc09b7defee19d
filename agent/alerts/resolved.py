"""The alerts that resolved lately, kept for the readers that show what an alert's capture was about
after the alert is gone (the status page's captures table): a listener of the engine's transitions
that keeps the last few resolutions in memory (the event log has them all)."""

from __future__ import annotations

import threading
from collections import deque

from gpuscope.alerts.model import Transition

KEPT = 256  # resolutions kept: more than the captures the status page lists, on a busy node


class ResolvedAlerts:
    """``__call__`` is an engine listener (sampler thread); ``recent`` may be called from any thread."""

    def __init__(self, kept: int = KEPT) -> None:
        self._lock = threading.Lock()
        self._resolved: deque[Transition] = deque(maxlen=kept)

    def __call__(self, transition: Transition) -> None:
        if transition.state == "resolved":
            with self._lock:
                self._resolved.append(transition)

    def recent(self) -> list[Transition]:
        """The resolutions kept, newest first."""
        with self._lock:
            return list(reversed(self._resolved))
