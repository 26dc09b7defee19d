"""GpuFrequentIdleDips: a mostly busy GPU that drops to idle many times a minute (it waits for input)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import (
    ForDuration,
    Ratio,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    for_field,
    require_clearable,
    window_field,
)


class FrequentIdleDipsConfig(RuleConfig):
    window: WindowDuration = window_field(60.0)
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(60.0)
    max_per_minute: float = Field(6.0, gt=0.0, le=360.0, description="Fires above this many dips a minute.")
    hysteresis: float = Field(1.0, ge=0.0, description="Clears only at max_per_minute - this or fewer.")
    min_utilization: Ratio = Field(0.30, description="Only on a GPU at least this busy (mean).")

    @model_validator(mode="after")
    def _reachable(self) -> FrequentIdleDipsConfig:
        require_clearable(self.hysteresis, self.max_per_minute, "max_per_minute")
        return self


class FrequentIdleDipsRule(Rule[FrequentIdleDipsConfig]):
    name: ClassVar[str] = "GpuFrequentIdleDips"
    config_model: ClassVar[type[FrequentIdleDipsConfig]] = FrequentIdleDipsConfig
    captures_by_default: ClassVar[bool] = True  # a trace shows the input pipeline between the steps

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        out = {}
        for gpu, window, mean in self._busy_means(history):
            counted = window.idle_dips()
            if mean < config.min_utilization or counted is None or counted[1] <= 0:
                continue
            dips, seconds = counted
            rate = dips / seconds * 60.0
            limit = config.max_per_minute - (config.hysteresis if gpu in active else 0.0)
            if rate > limit:
                out[gpu] = Condition(
                    gpu, {"dips_per_minute": rate, "mean_utilization": mean,
                          "max_per_minute": config.max_per_minute},
                    f"GPU {gpu} dips to idle {rate:.0f} times a minute (> {config.max_per_minute:g}) at "
                    f"{mean:.0%} mean utilization over {self._over}: the job waits for its input")
        return out
