"""GpuFrequentIdleDips: a mostly busy GPU that drops to idle many times a minute.

The dips say that the GPU waits between steps, not for what: NVML's samples cannot tell an input
pipeline that cannot keep up from host work between kernels (a synchronisation, Python overhead) or
a wait for other ranks. The summary names those likely causes; the capture the alert triggers names
the one it finds (its verdict reaches the alert's notifications).
"""

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
    band_edge,
    bound_text,
    clear_for_field,
    for_field,
    percent,
    require_clearable,
    value_text,
    window_field,
)

# What the dips alone cannot tell apart, in the summary of a firing alert.
LIKELY_CAUSES = ("the GPU waits between steps, for its input, for host work (a synchronisation such as "
                 ".item(), Python overhead) or for other ranks; a capture shows which")


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
    captures_by_default: ClassVar[bool] = True  # a trace shows what the GPU waits for between steps

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        most = config.max_per_minute
        release = band_edge(most, -config.hysteresis)  # an active alert holds above this
        out = {}
        for gpu, window, mean in self._busy_means(history):
            counted = window.idle_dips()
            if mean < config.min_utilization or counted is None or counted[1] <= 0:
                continue
            dips, seconds = counted
            rate = dips / seconds * 60.0
            if rate > (release if gpu in active else most):
                out[gpu] = Condition(
                    gpu, {"dips_per_minute": rate, "mean_utilization": mean, "max_per_minute": most},
                    self._summary(gpu, rate, mean, most, release))
        return out

    def _summary(self, gpu: int, rate: float, mean: float, most: float, release: float) -> str:
        at = f"at {percent(mean)} mean utilization over {self._over}"
        if rate > most:
            return (f"GPU {gpu} dips to idle {value_text(rate, most, scale=1.0, decimals=0)} times a minute "
                    f"(more than {bound_text(most, scale=1.0)}) {at}: {LIKELY_CAUSES}")
        # Held by the hysteresis: no longer above max_per_minute, not yet down to max - hysteresis.
        return (f"GPU {gpu} dips to idle {value_text(rate, most, release, scale=1.0, decimals=0)} times a "
                f"minute {at}: no longer more than {bound_text(most, scale=1.0)}, but the alert holds "
                f"until it is {bound_text(release, scale=1.0)} or fewer")
