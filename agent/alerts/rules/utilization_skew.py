"""GpuUtilizationSkew: a busy GPU that lags the busiest one of the node (a straggler)."""

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
    require_clearable,
    window_field,
)

_LAGGARD = {"laggard": "true"}


class UtilizationSkewConfig(RuleConfig):
    window: WindowDuration = window_field(120.0)
    for_: ForDuration = for_field(120.0)
    clear_for: ForDuration = clear_for_field(60.0)
    max_spread: float = Field(0.20, gt=0.0, lt=1.0, description="Fires on GPUs this far below the busiest.")
    hysteresis: float = Field(0.05, ge=0.0, description="Clears only at a gap of max_spread - this.")
    min_gpus: int = Field(2, ge=2, le=64, description="Busy GPUs needed to compare.")

    @model_validator(mode="after")
    def _reachable(self) -> UtilizationSkewConfig:
        require_clearable(self.hysteresis, self.max_spread, "max_spread")
        return self


class UtilizationSkewRule(Rule[UtilizationSkewConfig]):
    name: ClassVar[str] = "GpuUtilizationSkew"
    config_model: ClassVar[type[UtilizationSkewConfig]] = UtilizationSkewConfig
    captures_by_default: ClassVar[bool] = True  # a trace of the straggler shows what holds it back

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        means = {gpu: mean for gpu, _, mean in self._busy_means(history)}
        if len(means) < config.min_gpus:
            return {}
        leader = max(means, key=lambda g: (means[g], -g))
        top = means[leader]
        spread = top - min(means.values())
        out = {}
        for gpu, mean in means.items():
            gap = top - mean
            limit = config.max_spread - (config.hysteresis if gpu in active else 0.0)
            if gpu != leader and gap > limit:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "leader_gpu": float(leader), "leader_utilization": top,
                          "gap": gap, "spread": spread, "max_spread": config.max_spread},
                    f"GPU {gpu} lags its peers: {mean:.1%} mean utilization against {top:.1%} on GPU "
                    f"{leader} over {self._over} (gap {gap:.1%} > {config.max_spread:.0%})",
                    _LAGGARD)
        return out
