"""GpuLowUtilization: a GPU that runs a job but is busy less than the threshold on average."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    band_edge,
    clear_for_field,
    for_field,
    percent,
    percent_bound,
    require_reachable,
    window_field,
)


class LowUtilizationConfig(RuleConfig):
    window: WindowDuration = window_field(120.0)
    for_: ForDuration = for_field(120.0)
    clear_for: ForDuration = clear_for_field(60.0)
    threshold: float = Field(0.80, gt=0.0, le=1.0, description="Fires below this mean utilization.")
    hysteresis: float = Field(0.05, ge=0.0, le=0.5, description="Clears only at threshold + this.")

    @model_validator(mode="after")
    def _reachable(self) -> LowUtilizationConfig:
        require_reachable(self.threshold, self.hysteresis)
        return self


class LowUtilizationRule(Rule[LowUtilizationConfig]):
    name: ClassVar[str] = "GpuLowUtilization"
    config_model: ClassVar[type[LowUtilizationConfig]] = LowUtilizationConfig
    captures_by_default: ClassVar[bool] = True  # a trace shows what the GPU waits for

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        threshold = self.config.threshold
        release = band_edge(threshold, self.config.hysteresis)  # an active alert holds below this
        out = {}
        for gpu, _, mean in self._busy_means(history):
            if mean < (release if gpu in active else threshold):
                out[gpu] = Condition(gpu, {"mean_utilization": mean, "threshold": threshold},
                                     self._summary(gpu, mean, threshold, release))
        return out

    def _summary(self, gpu: int, mean: float, threshold: float, release: float) -> str:
        if mean < threshold:
            return (f"GPU {gpu} runs a job but its mean utilization is {percent(mean, threshold)} over "
                    f"{self._over} (below {percent_bound(threshold)})")
        # Held by the hysteresis: no longer below the threshold, not yet back at threshold + hysteresis.
        return (f"GPU {gpu} runs a job at {percent(mean, threshold, release)} mean utilization over "
                f"{self._over}: no longer below {percent_bound(threshold)}, but the alert holds until it "
                f"reaches {percent_bound(release)}")
