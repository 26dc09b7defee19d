"""GpuThrottled: a GPU whose clocks are held down by a power or thermal limit much of the time."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gpuscope.alerts.history import MIN_COVERAGE, NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    band_edge,
    clear_for_field,
    for_field,
    percent_bound,
    require_clearable,
    value_text,
    window_field,
)
from gpuscope.nvml.clock_events import CLOCK_EVENT_REASONS


class ThrottledConfig(RuleConfig):
    window: WindowDuration = window_field(120.0)
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(60.0)
    min_fraction: float = Field(0.5, gt=0.0, le=1.0,
                                description="Fires when throttled this share of the window.")
    hysteresis: float = Field(0.1, ge=0.0, description="Clears only below min_fraction - this.")
    reasons: list[str] = Field(
        ["sw_power_cap", "hw_power_brake_slowdown", "hw_slowdown", "sw_thermal_slowdown",
         "hw_thermal_slowdown"],
        min_length=1, description="Clock event reasons that count as throttling.")

    @model_validator(mode="after")
    def _valid(self) -> ThrottledConfig:
        known = list(CLOCK_EVENT_REASONS.values())
        unknown = [r for r in self.reasons if r not in known]
        if unknown:
            raise ValueError(f"unknown clock event reason(s) {unknown} (known: {', '.join(known)})")
        require_clearable(self.hysteresis, self.min_fraction, "min_fraction")
        return self


class ThrottledRule(Rule[ThrottledConfig]):
    name: ClassVar[str] = "GpuThrottled"
    config_model: ClassVar[type[ThrottledConfig]] = ThrottledConfig
    captures_by_default: ClassVar[bool] = False  # a power or thermal clamp does not show in a trace

    def __init__(self, config: ThrottledConfig) -> None:
        super().__init__(config)
        self.reasons = frozenset(config.reasons)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        least = config.min_fraction
        release = band_edge(least, -config.hysteresis)  # an active alert holds down to this share
        out = {}
        for gpu, window in self._windows(history):
            known, throttled = window.clock_events(self.reasons)
            if not throttled or known < MIN_COVERAGE * window.n:
                continue
            fraction = throttled / known
            if fraction >= (release if gpu in active else least):
                seen: set[str] = set()
                for p in window.points:
                    if p.clock_event_reasons:
                        seen |= p.clock_event_reasons & self.reasons
                out[gpu] = Condition(
                    gpu, {"throttled_fraction": fraction, "min_fraction": least},
                    self._summary(gpu, ",".join(sorted(seen)), fraction, least, release))
        return out

    def _summary(self, gpu: int, names: str, fraction: float, least: float, release: float) -> str:
        held = f"GPU {gpu} clocks were held down ({names})"
        if fraction >= least:
            return (f"{held} {value_text(fraction, least, decimals=0)}% of the last {self._over} "
                    f"(at least {percent_bound(least)})")
        # Held by the hysteresis: below min_fraction, not yet below min_fraction - hysteresis.
        return (f"{held} {value_text(fraction, least, release, decimals=0)}% of the last {self._over}: no "
                f"longer at least {percent_bound(least)}, but the alert holds until it is below "
                f"{percent_bound(release)}")
