"""Turning the driver's raw numbers into monotonic Prometheus counters."""

from __future__ import annotations


class ResetSafeCounter:
    """A running total over a driver counter that restarts from 0 (e.g. energy, after a driver reload).

    The first reading is taken as the total so far (the driver's counter since it loaded); afterwards
    only increases are added, and a value lower than the last one is read as a reset to 0.
    """

    __slots__ = ("_last", "total")

    def __init__(self) -> None:
        self._last: float | None = None
        self.total = 0.0

    @property
    def has_reading(self) -> bool:
        """Whether the counter has been read at least once (``total`` means something)."""
        return self._last is not None

    def update(self, raw: float) -> float:
        if self._last is None:
            self.total = raw
        elif raw >= self._last:
            self.total += raw - self._last
        else:
            self.total += raw  # the counter restarted at 0 since the last reading
        self._last = raw
        return self.total


class RateIntegrator:
    """A cumulative total from instantaneous rates read once per tick (trapezoid rule)."""

    __slots__ = ("_last_at", "_last_rate", "total")

    def __init__(self) -> None:
        self._last_at: float | None = None
        self._last_rate = 0.0
        self.total = 0.0

    def update(self, rate: float, at: float) -> float:
        if self._last_at is not None and at > self._last_at:
            self.total += (rate + self._last_rate) / 2.0 * (at - self._last_at)
        self._last_at, self._last_rate = at, rate
        return self.total
