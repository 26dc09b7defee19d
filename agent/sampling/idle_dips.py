"""Counting idle dips in the driver's utilization samples: the input-pipeline stall signature.

A dip is a run of samples below the threshold that sits between busier samples: the GPU was working,
stopped for a moment (typically waiting for the next batch), and resumed. A run longer than
``max_duration_us`` is an idle period (a job ended, a checkpoint), not a dip, and is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable


class IdleDipCounter:
    __slots__ = ("_dip_started_us", "_seen_busy", "max_duration_us", "threshold", "total")

    def __init__(self, threshold: float = 0.25, max_duration_us: int = 5_000_000) -> None:
        self.threshold = threshold
        self.max_duration_us = max_duration_us
        self.total = 0
        self._seen_busy = False
        self._dip_started_us: int | None = None

    def update(self, samples: Iterable[tuple[int, float]]) -> int:
        """Feed samples (driver µs timestamp, ratio) in time order; returns the running total."""
        for timestamp_us, value in samples:
            if value < self.threshold:
                if self._seen_busy and self._dip_started_us is None:
                    self._dip_started_us = timestamp_us
                continue
            started = self._dip_started_us
            if started is not None and timestamp_us - started <= self.max_duration_us:
                self.total += 1
            self._dip_started_us = None
            self._seen_busy = True
        return self.total
