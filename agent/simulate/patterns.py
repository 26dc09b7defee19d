"""Utilization patterns: how busy a GPU (or one process on it) is as a function of time.

Every pattern maps "seconds since the start of its phase" to a level in [0, 1]. Noise is
deterministic: it is a hash of (stream, key), where the stream names the GPU/process and the key is
the scenario time in milliseconds, so a scenario replays identically whatever the call order.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from gpuscope.common.config_types import Section
from gpuscope.simulate.units import Fraction, PositiveDuration

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # A well-mixed 64-bit hash (SplitMix64 finaliser): cheap, and stable across Python versions,
    # unlike hash() of tuples or the random module's seeding details.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_stream(seed: int, *parts: int) -> int:
    """A stream id for one noise source (e.g. seed, GPU index, process index)."""
    h = _splitmix64(seed & _MASK64)
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h


def noise_unit(stream: int, key: int) -> float:
    """Deterministic jitter in [-1, 1], triangular (sum of two uniforms) so small values dominate."""
    # _splitmix64(stream ^ (key & _MASK64)), inlined: this runs for every simulated tick.
    x = ((stream ^ (key & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    h = x ^ (x >> 31)
    return (h & 0xFFFFFFFF) / 0xFFFFFFFF + (h >> 32) / 0xFFFFFFFF - 1.0


class _Pattern(Section):
    noise: Fraction = Field(0.0, description="Peak jitter added to the level, +-noise.")

    def level_at(self, t: float) -> float:
        """The noiseless level ``t`` seconds after the phase started."""
        raise NotImplementedError

    def value(self, t: float, stream: int, key: int) -> float:
        level = self.level_at(t)
        noise = self.noise
        if noise:
            level += noise * noise_unit(stream, key)
        # min(1.0, max(0.0, level)), spelt out (the same comparisons, NaN included): runs per tick
        level = level if level > 0.0 else 0.0
        return level if level < 1.0 else 1.0


class SteadyPattern(_Pattern):
    """A constant level: a healthy busy GPU (0.95) or an idle one (0)."""

    pattern: Literal["steady"] = "steady"
    level: Fraction

    def level_at(self, t: float) -> float:
        return self.level


class StepsPattern(_Pattern):
    """Training steps with an input-bound gap: busy for ``busy_fraction`` of each ``period``."""

    pattern: Literal["steps"]
    period: PositiveDuration
    busy_fraction: Fraction
    busy_level: Fraction = 1.0
    idle_level: Fraction = 0.0

    def level_at(self, t: float) -> float:
        position = (t % self.period) / self.period
        return self.busy_level if position < self.busy_fraction else self.idle_level


class RampPattern(_Pattern):
    """A linear change from ``start`` to ``end`` over ``over`` seconds, then holds ``end``."""

    pattern: Literal["ramp"]
    start: Fraction
    end: Fraction
    over: PositiveDuration

    def level_at(self, t: float) -> float:
        progress = min(1.0, max(0.0, t / self.over))
        return self.start + (self.end - self.start) * progress


def _shorthand(value: Any) -> Any:
    # "utilization: 0.9" and "{level: 0.9, noise: 0.02}" are the common case: a steady pattern.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"pattern": "steady", "level": value}
    if isinstance(value, dict) and "pattern" not in value:
        return {"pattern": "steady", **value}
    return value


Pattern = Annotated[
    Annotated[SteadyPattern | StepsPattern | RampPattern, Field(discriminator="pattern")],
    BeforeValidator(_shorthand),
]
PATTERN_NAMES = frozenset({"steady", "steps", "ramp"})
