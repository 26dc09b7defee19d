"""Something done every so many seconds by a schedule that ticks at its own interval: the sampler's
reads that are not needed every tick (energy, utilization samples, health, throttle counters, GPM) and
the alert engine's evaluation of the rules.

It is due at the first tick, then at the first tick at least ``period_seconds`` after the last time it
was done, less half a tick: ticks come a little early or late, and without that slack "every 10 s"
at a 1 s tick would become every 11 s. A period of zero (or one shorter than half a tick) is every
tick. Times are one monotonic clock's seconds.
"""

from __future__ import annotations


class Cadence:
    __slots__ = ("last", "period_seconds", "tick_seconds")

    def __init__(self, period_seconds: float, tick_seconds: float) -> None:
        if period_seconds < 0 or tick_seconds < 0:
            raise ValueError(f"a cadence needs a period and a tick of 0 s or more, not "
                             f"{period_seconds} s and {tick_seconds} s")
        self.period_seconds = period_seconds
        self.tick_seconds = tick_seconds  # may change between ticks (the engine's, from each snapshot)
        self.last: float | None = None  # when it was last done; None: never, or to be done again now

    @property
    def every_tick(self) -> bool:
        """No period: it is done at every tick."""
        return self.period_seconds <= 0

    def due(self, now: float) -> bool:
        """Whether it is to be done at the tick at ``now``."""
        last = self.last
        return last is None or now - last >= max(0.0, self.period_seconds - self.tick_seconds / 2)

    def done(self, now: float) -> None:
        """It was done at the tick at ``now``: the next time is a period later."""
        self.last = now

    def reset(self) -> None:
        """Due again at the next tick, whenever it was last done."""
        self.last = None

    def __repr__(self) -> str:
        return f"Cadence(every {self.period_seconds:g} s, tick {self.tick_seconds:g} s, last {self.last})"
