"""Scenario time as the simulated driver sees it: ticks, phases and integrals.

Time is quantised like the driver's utilization buffer: tick ``k`` covers scenario seconds
[k/6, (k+1)/6), reflects the patterns at its middle, and becomes visible (with the driver timestamp
of its end) once the clock has passed that end. Behaviour is a function of *loop time* (scenario
time modulo ``duration``); cumulative counters (energy, PCIe bytes) and timestamps use absolute time
so that they keep increasing across loops, as a real driver's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from gpuscope.simulate.patterns import Pattern
from gpuscope.simulate.scenario import (
    REASON_BITS,
    ClockSpec,
    GpmLevels,
    GpuSpec,
    PcieRates,
    PowerSpec,
    TemperatureSpec,
)

TICKS_PER_SECOND = 6
EPOCH_US = 1_700_000_000_000_000  # driver timestamps are µs; a fixed epoch keeps them realistic-looking
BUFFER_TICKS = 20 * TICKS_PER_SECOND  # the driver keeps roughly the last 20 s of samples
_M = TypeVar("_M", bound=BaseModel)


def tick_timestamp_us(k: int) -> int:
    """The driver timestamp of tick ``k``: the end of its window."""
    return EPOCH_US + (k + 1) * 1_000_000 // TICKS_PER_SECOND


def last_complete_tick(t: float) -> int:
    """The newest tick whose window has ended at scenario time ``t`` (-1 if none)."""
    return math.floor(t * TICKS_PER_SECOND + 1e-9) - 1


def first_tick_after(cursor_us: int) -> int:
    """The oldest tick whose timestamp is newer than ``cursor_us``."""
    k = max(-1, (cursor_us - EPOCH_US) * TICKS_PER_SECOND // 1_000_000 - 1)
    while tick_timestamp_us(k) <= cursor_us:
        k += 1
    return k


def tick_middle(k: int) -> float:
    return (k + 0.5) / TICKS_PER_SECOND


@dataclass(frozen=True)
class Phase:
    """A GPU's dynamic settings from ``start`` (loop time) until the next phase."""

    start: float
    utilization: Pattern
    power: PowerSpec
    temperature: TemperatureSpec
    clocks: ClockSpec
    pcie: PcieRates
    gpm: GpmLevels
    reasons: int


def _merge(base: _M, override: BaseModel | None) -> _M:
    # A phase's sub-object overrides only the keys it spells out; the rest come from the GPU's base.
    if override is None:
        return base
    return base.model_copy(update={k: getattr(override, k) for k in override.model_fields_set})


def _mask(names: list[str]) -> int:
    mask = 0
    for name in names:
        mask |= REASON_BITS[name]
    return mask


def resolve_phases(gpu: GpuSpec) -> list[Phase]:
    base = Phase(0.0, gpu.utilization, gpu.power, gpu.temperature, gpu.clocks, gpu.pcie, gpu.gpm,
                 _mask(gpu.clock_event_reasons))
    phases = [] if gpu.phases and gpu.phases[0].from_ == 0 else [base]
    for p in gpu.phases:
        phases.append(Phase(
            start=p.from_,
            utilization=p.utilization or base.utilization,
            power=_merge(base.power, p.power),
            temperature=_merge(base.temperature, p.temperature),
            clocks=_merge(base.clocks, p.clocks),
            pcie=_merge(base.pcie, p.pcie),
            gpm=_merge(base.gpm, p.gpm),
            reasons=base.reasons if p.clock_event_reasons is None else _mask(p.clock_event_reasons),
        ))
    return phases


class Integral:
    """The integral over scenario time of a per-tick rate, e.g. watts -> joules.

    Prefix sums over one loop are kept, so a reading costs O(1) once the loop has been seen.
    """

    def __init__(self, rate: Callable[[float], float], period: float | None) -> None:
        self._rate = rate
        self._period = period
        self._prefix = [0.0]
        # The rates of the loop's ticks (a pure function of the tick), kept when the loop bounds them;
        # without a loop only the last one, which the next extension of the prefix sums starts with.
        self._rates: list[float] = []
        self._last: tuple[int, float] = (-1, 0.0)
        self._loop_total: float | None = None

    def _rate_of(self, i: int) -> float:
        if self._period is not None:
            rates = self._rates
            while len(rates) <= i:
                rates.append(self._rate(tick_middle(len(rates))))
            return rates[i]
        if self._last[0] != i:
            self._last = (i, self._rate(tick_middle(i)))
        return self._last[1]

    def _within(self, tau: float) -> float:
        # Prefix sums of the per-tick rates themselves (exact for integer rates), scaled at the end.
        j = math.floor(tau * TICKS_PER_SECOND)
        prefix = self._prefix
        while len(prefix) <= j:
            i = len(prefix) - 1
            prefix.append(prefix[-1] + self._rate_of(i))
        partial = self._rate_of(j) * (tau * TICKS_PER_SECOND - j)
        return (prefix[j] + partial) / TICKS_PER_SECOND

    def at(self, t: float) -> float:
        t = max(0.0, t)
        if self._period is None:
            return self._within(t)
        loops, tau = divmod(t, self._period)
        if self._loop_total is None:
            self._loop_total = self._within(self._period)
        return loops * self._loop_total + self._within(tau)

