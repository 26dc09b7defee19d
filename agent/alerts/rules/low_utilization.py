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
    clear_for_field,
    for_field,
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
        if self.threshold + self.hysteresis > 1.0:
            raise ValueError("threshold + hysteresis must be at most 1 (else the alert could never clear)")
        return self


class LowUtilizationRule(Rule[LowUtilizationConfig]):
    name: ClassVar[str] = "GpuLowUtilization"
    config_model: ClassVar[type[LowUtilizationConfig]] = LowUtilizationConfig
    captures_by_default: ClassVar[bool] = True  # a trace shows what the GPU waits for

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        threshold, hysteresis = self.config.threshold, self.config.hysteresis
        out = {}
        for gpu, _, mean in self._busy_means(history):
            limit = threshold + (hysteresis if gpu in active else 0.0)
            if mean < limit:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "threshold": threshold},
                    f"GPU {gpu} runs a job but its mean utilization is {mean:.1%} "
                    f"(< {threshold:.0%}) over {self._over}")
        return out
