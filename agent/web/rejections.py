"""Counts of the requests the HTTP port refused before they reached an endpoint, by reason
(``gpuscope_http_rejected_requests_total{reason}``): a rise in ``unauthorized`` is a misconfigured
scraper or someone guessing; ``busy`` means web.max_requests is too low for the scrapers."""

from __future__ import annotations

import threading

REASONS = ("busy", "unauthorized", "rate_limited", "tls_handshake")


class Rejections:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
