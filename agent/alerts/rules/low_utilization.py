"""GpuLowUtilization: a GPU that runs a job but is busy less than the threshold on average.

On a GPU in MIG mode (no utilization of its own), each MIG device is judged instead: a device on which
a compute process ran during most of the window, and whose busy share over it (its busy-seconds
counter, from GPM's graphics activity) is below the threshold. A device GPM does not measure (before
Hopper, or its first seconds) is not judged.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, InstanceKey
from gpuscope.alerts.rules.base import (
    BUSY_FRACTION,
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    band_edge,
    clear_for_field,
    for_field,
    instance_labels,
    instance_text,
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
    judges_instances: ClassVar[bool] = True

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        threshold = self.config.threshold
        release = band_edge(threshold, self.config.hysteresis)  # an active alert holds below this
        out = {}
        for gpu, _, mean in self._busy_means(history):
            if mean < (release if gpu in active else threshold):
                out[gpu] = Condition(gpu, {"mean_utilization": mean, "threshold": threshold},
                                     self._summary(gpu, mean, threshold, release))
        return out

    def evaluate_instances(self, history: NodeHistory,
                           active: frozenset[InstanceKey]) -> dict[InstanceKey, Condition]:
        threshold = self.config.threshold
        release = band_edge(threshold, self.config.hysteresis)
        assert self.window_seconds is not None
        out = {}
        for gpu, device in self._instances(history):
            window = history.window(gpu, self.window_seconds)
            if window is None or window.last.utilization is not None:
                continue  # too early; or the GPU has utilization of its own, judged by evaluate
            fraction, share = window.instance_activity(device)
            if share is None or fraction < BUSY_FRACTION:
                continue  # not measured (no GPM), or no job on it for most of the window
            mig = device.reading
            key = InstanceKey(gpu, mig.uuid)
            if share < (release if key in active else threshold):
                where = instance_text(gpu, mig)
                if share < threshold:
                    summary = (f"{where} runs a job but was busy {percent(share, threshold)} of the last "
                               f"{self._over} (below {percent_bound(threshold)})")
                else:
                    summary = (f"{where} runs a job and was busy {percent(share, threshold, release)} of "
                               f"the last {self._over}: no longer below {percent_bound(threshold)}, but the "
                               f"alert holds until it reaches {percent_bound(release)}")
                out[key] = Condition(gpu, {"mean_utilization": share, "threshold": threshold}, summary,
                                     instance_labels(mig))
        return out

    def _summary(self, gpu: int, mean: float, threshold: float, release: float) -> str:
        if mean < threshold:
            return (f"GPU {gpu} runs a job but its mean utilization is {percent(mean, threshold)} over "
                    f"{self._over} (below {percent_bound(threshold)})")
        # Held by the hysteresis: no longer below the threshold, not yet back at threshold + hysteresis.
        return (f"GPU {gpu} runs a job at {percent(mean, threshold, release)} mean utilization over "
                f"{self._over}: no longer below {percent_bound(threshold)}, but the alert holds until it "
                f"reaches {percent_bound(release)}")
