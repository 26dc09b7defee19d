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
    band_edge,
    clear_for_field,
    for_field,
    percent,
    percent_bound,
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
        busy, stalled = config.min_utilization, config.max_sm_active
        # An active alert holds down to these: utilization and SM activity each move by the hysteresis.
        busy_held, stalled_held = band_edge(busy, -config.hysteresis), band_edge(stalled, config.hysteresis)
        out = {}
        for gpu, window in self._windows(history):
            fraction, util, sm = window.sm_activity()
            if util is None or sm is None or fraction < MIN_COVERAGE:
                continue  # no GPM here (pre-Hopper, MIG) or not for most of the window
            held = gpu in active
            if util >= (busy_held if held else busy) and sm < (stalled_held if held else stalled):
                out[gpu] = Condition(
                    gpu, {"mean_utilization": util, "mean_sm_active": sm,
                          "min_utilization": busy, "max_sm_active": stalled},
                    self._summary(gpu, util, sm, busy_held, stalled_held))
        return out

    def _summary(self, gpu: int, util: float, sm: float, busy_held: float, stalled_held: float) -> str:
        busy, stalled = self.config.min_utilization, self.config.max_sm_active
        if util >= busy and sm < stalled:
            return (f"GPU {gpu} is {percent(util, busy)} busy but its SMs are only {percent(sm, stalled)} "
                    f"active over {self._over} (busy: {percent_bound(busy)} or more, SMs below "
                    f"{percent_bound(stalled)}): kernels wait (host syncs, tiny launches)")
        # Held by the hysteresis: past one of the firing thresholds, not yet past the released ones.
        return (f"GPU {gpu} is {percent(util, busy, busy_held)} busy with its SMs "
                f"{percent(sm, stalled, stalled_held)} active over {self._over}: no longer at the firing "
                f"thresholds ({percent_bound(busy)} busy or more, SMs below {percent_bound(stalled)}), but "
                f"the alert holds until utilization falls below {percent_bound(busy_held)} or SM activity "
                f"reaches {percent_bound(stalled_held)}")
