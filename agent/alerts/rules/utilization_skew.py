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
    band_edge,
    bound_text,
    clear_for_field,
    for_field,
    require_clearable,
    value_text,
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
        spread = round(top - min(means.values()), 9)  # differences of means: without float noise
        most = config.max_spread
        release = band_edge(most, -config.hysteresis)  # an active alert holds above this gap
        out = {}
        for gpu, mean in means.items():
            gap = round(top - mean, 9)
            if gpu != leader and gap > (release if gpu in active else most):
                out[gpu] = Condition(
                    gpu, {"mean_utilization": mean, "leader_gpu": float(leader), "leader_utilization": top,
                          "gap": gap, "spread": spread, "max_spread": most},
                    self._summary(gpu, mean, leader, top, gap),
                    _LAGGARD)
        return out

    def _summary(self, gpu: int, mean: float, leader: int, top: float, gap: float) -> str:
        most = self.config.max_spread
        release = band_edge(most, -self.config.hysteresis)
        held = gap <= most  # held by the hysteresis: no longer above max_spread, not yet down to the release
        shown_mean, shown_top, shown_gap = _shown_gap(mean, top, gap, (most, release) if held else (most,))
        lag = (f"GPU {gpu} lags its peers: {shown_mean}% mean utilization against {shown_top}% on GPU "
               f"{leader} over {self._over}, a gap of {shown_gap} points")
        if not held:
            return f"{lag} (more than {bound_text(most)})"
        return (f"{lag}: no longer more than {bound_text(most)}, but the alert holds until it is "
                f"{bound_text(release)} or less")


def _shown_gap(mean: float, top: float, gap: float, bounds: tuple[float, ...]) -> tuple[str, str, str]:
    """The mean, the leader's mean and the gap in percent as a summary shows them: the gap shown is
    the difference of the means shown, and compares with each bound as the real gap does."""
    marks = [(float(bound_text(b)), (gap > b) - (gap < b)) for b in bounds]
    for d in (1, 2, 3):
        shown_top, shown_mean = round(top * 100, d), round(mean * 100, d)
        shown_gap = round(shown_top - shown_mean, d)
        if all(((shown_gap > b) - (shown_gap < b)) == s for b, s in marks):
            return f"{shown_mean:.{d}f}", f"{shown_top:.{d}f}", f"{shown_gap:.{d}f}"
    return f"{mean * 100:.1f}", f"{top * 100:.1f}", value_text(gap, *bounds)
