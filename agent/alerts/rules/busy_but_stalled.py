"""GpuBusyButStalled: a GPU that looks busy (utilization) while its SMs mostly idle (GPM)."""

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
    clear_for_field,
    for_field,
    window_field,
)


class BusyButStalledConfig(RuleConfig):
    window: WindowDuration = window_field(60.0)
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(60.0)
    min_utilization: float = Field(0.80, gt=0.0, le=1.0, description="Busy: mean utilization at least this.")
    max_sm_active: float = Field(0.30, gt=0.0, le=1.0, description="Stalled: mean SM activity below this.")
    hysteresis: float = Field(0.05, ge=0.0, le=0.5, description="Applied to both thresholds once active.")

    @model_validator(mode="after")
    def _reachable(self) -> BusyButStalledConfig:
        if self.max_sm_active >= self.min_utilization:
            raise ValueError("max_sm_active must be below min_utilization (SM activity never exceeds "
                             "utilization)")
        return self


class BusyButStalledRule(Rule[BusyButStalledConfig]):
    name: ClassVar[str] = "GpuBusyButStalled"
    config_model: ClassVar[type[BusyButStalledConfig]] = BusyButStalledConfig
    captures_by_default: ClassVar[bool] = True  # a trace shows the host syncs and tiny launches

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        config = self.config
        out = {}
        for gpu, window in self._windows(history):
            fraction, util, sm = window.sm_activity()
            if util is None or sm is None or fraction < MIN_COVERAGE:
                continue  # no GPM here (pre-Hopper, MIG) or not for most of the window
            slack = config.hysteresis if gpu in active else 0.0
            if util >= config.min_utilization - slack and sm < config.max_sm_active + slack:
                out[gpu] = Condition(
                    gpu, {"mean_utilization": util, "mean_sm_active": sm,
                          "min_utilization": config.min_utilization, "max_sm_active": config.max_sm_active},
                    f"GPU {gpu} is {util:.1%} busy but its SMs are only {sm:.1%} active over "
                    f"{self._over}: kernels wait (host syncs, tiny launches)")
        return out
