"""The `alerting.rules:` section: one sub-section per rule, keyed by the rule's name.

```yaml
alerting:
  rules:
    GpuLowUtilization: {threshold: 0.7, window: 5m, for: 5m}
    GpuSharedByProcesses: {allow: [nvidia-cuda-mps-server, my-sidecar]}
    GpuThrottled: {enabled: false}
```

An unknown rule name or key is refused with its path; thresholds are range-checked here, and
``validate_against_interval`` checks the windows against the sample interval (the settings call
it, since the interval lives outside this section). docs/alerts.md justifies every default.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gpuscope.alerts.model import Severity
from gpuscope.alerts.rules import (
    BusyButStalled,
    FrequentIdleDips,
    LowUtilization,
    Rule,
    SharedByProcesses,
    Throttled,
    UtilizationSkew,
    XidError,
)
from gpuscope.common.durations import format_duration, parse_duration
from gpuscope.nvml.clock_events import CLOCK_EVENT_REASONS

MAX_WINDOW_SECONDS = 3600.0  # bounds the history kept per GPU
MAX_WINDOW_POINTS = 7200  # ... and at a short sample interval, the points per window
MAX_FOR_SECONDS = 86400.0


def _window_range(seconds: float) -> float:
    if not 0 < seconds <= MAX_WINDOW_SECONDS:
        raise ValueError(f"a window must be longer than 0 and at most 1h, got {format_duration(seconds)}")
    return seconds


def _for_range(seconds: float) -> float:
    if seconds > MAX_FOR_SECONDS:
        raise ValueError(f"must be at most 24h, got {format_duration(seconds)}")
    return seconds


WindowDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_window_range)]
ForDuration = Annotated[float, BeforeValidator(parse_duration), AfterValidator(_for_range)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]


def _window(default: float) -> float:
    return Field(default, description="Span of history the condition is judged over (at least the sample "
                                      "interval, at most 1h).")


def _for(default: float) -> float:
    return Field(default, alias="for", description="How long the condition must hold before the alert fires.")


def _clear_for(default: float) -> float:
    return Field(default, description="How long the condition must be false before a firing alert resolves.")


class _RuleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    enabled: bool = True
    severity: Severity = "warning"


class LowUtilizationConfig(_RuleConfig):
    window: WindowDuration = _window(120.0)
    for_: ForDuration = _for(120.0)
    clear_for: ForDuration = _clear_for(60.0)
    threshold: float = Field(0.80, gt=0.0, le=1.0, description="Fires below this mean utilization.")
    hysteresis: float = Field(0.05, ge=0.0, le=0.5, description="Clears only at threshold + this.")

    @model_validator(mode="after")
    def _reachable(self) -> LowUtilizationConfig:
        if self.threshold + self.hysteresis > 1.0:
            raise ValueError("threshold + hysteresis must be at most 1 (else the alert could never clear)")
        return self


class SharedByProcessesConfig(_RuleConfig):
    for_: ForDuration = _for(30.0)
    clear_for: ForDuration = _clear_for(30.0)
    max_processes: int = Field(1, ge=1, le=1024, description="Fires above this many compute processes.")
    allow: list[Annotated[str, Field(min_length=1)]] = Field(
        ["nvidia-cuda-mps-server", "nvidia-cuda-mps-control"],
        description="Process names that do not count (e.g. the MPS server).")


class FrequentIdleDipsConfig(_RuleConfig):
    window: WindowDuration = _window(60.0)
    for_: ForDuration = _for(60.0)
    clear_for: ForDuration = _clear_for(60.0)
    max_per_minute: float = Field(6.0, gt=0.0, le=360.0, description="Fires above this many dips a minute.")
    hysteresis: float = Field(1.0, ge=0.0, description="Clears only at max_per_minute - this or fewer.")
    min_utilization: Ratio = Field(0.30, description="Only on a GPU at least this busy (mean).")

    @model_validator(mode="after")
    def _reachable(self) -> FrequentIdleDipsConfig:
        if self.hysteresis >= self.max_per_minute:
            raise ValueError("hysteresis must be below max_per_minute (else the alert could never clear)")
        return self


class UtilizationSkewConfig(_RuleConfig):
    window: WindowDuration = _window(120.0)
    for_: ForDuration = _for(120.0)
    clear_for: ForDuration = _clear_for(60.0)
    max_spread: float = Field(0.20, gt=0.0, lt=1.0, description="Fires on GPUs this far below the busiest.")
    hysteresis: float = Field(0.05, ge=0.0, description="Clears only at a gap of max_spread - this.")
    min_gpus: int = Field(2, ge=2, le=64, description="Busy GPUs needed to compare.")

    @model_validator(mode="after")
    def _reachable(self) -> UtilizationSkewConfig:
        if self.hysteresis >= self.max_spread:
            raise ValueError("hysteresis must be below max_spread (else the alert could never clear)")
        return self


class BusyButStalledConfig(_RuleConfig):
    window: WindowDuration = _window(60.0)
    for_: ForDuration = _for(60.0)
    clear_for: ForDuration = _clear_for(60.0)
    min_utilization: float = Field(0.80, gt=0.0, le=1.0, description="Busy: mean utilization at least this.")
    max_sm_active: float = Field(0.30, gt=0.0, le=1.0, description="Stalled: mean SM activity below this.")
    hysteresis: float = Field(0.05, ge=0.0, le=0.5, description="Applied to both thresholds once active.")

    @model_validator(mode="after")
    def _reachable(self) -> BusyButStalledConfig:
        if self.max_sm_active >= self.min_utilization:
            raise ValueError("max_sm_active must be below min_utilization (SM activity never exceeds "
                             "utilization)")
        return self


class ThrottledConfig(_RuleConfig):
    window: WindowDuration = _window(120.0)
    for_: ForDuration = _for(60.0)
    clear_for: ForDuration = _clear_for(60.0)
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
        if self.hysteresis >= self.min_fraction:
            raise ValueError("hysteresis must be below min_fraction (else the alert could never clear)")
        return self


class XidErrorConfig(_RuleConfig):
    severity: Severity = "critical"
    window: WindowDuration = _window(30.0)
    for_: ForDuration = _for(0.0)
    clear_for: ForDuration = _clear_for(300.0)
    benign: list[Annotated[int, Field(ge=1)]] = Field(
        [13, 31, 43, 45], description="Xid codes that do not alert (application-caused).")


class RulesConfig(BaseModel):
    """Per-rule settings; the field names are the alert names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    GpuLowUtilization: LowUtilizationConfig = LowUtilizationConfig()
    GpuSharedByProcesses: SharedByProcessesConfig = SharedByProcessesConfig()
    GpuFrequentIdleDips: FrequentIdleDipsConfig = FrequentIdleDipsConfig()
    GpuUtilizationSkew: UtilizationSkewConfig = UtilizationSkewConfig()
    GpuBusyButStalled: BusyButStalledConfig = BusyButStalledConfig()
    GpuThrottled: ThrottledConfig = ThrottledConfig()
    GpuXidError: XidErrorConfig = XidErrorConfig()


def build_rules(config: RulesConfig) -> list[Rule]:
    """The enabled rules, configured, in the order of RulesConfig's fields."""
    c = config
    rules: list[Rule] = []
    if (lu := c.GpuLowUtilization).enabled:
        rules.append(LowUtilization(
            severity=lu.severity, window_seconds=lu.window, for_seconds=lu.for_,
            clear_for_seconds=lu.clear_for,
            threshold=lu.threshold, hysteresis=lu.hysteresis))
    if (sp := c.GpuSharedByProcesses).enabled:
        rules.append(SharedByProcesses(
            severity=sp.severity, for_seconds=sp.for_, clear_for_seconds=sp.clear_for,
            max_processes=sp.max_processes, allow=frozenset(sp.allow)))
    if (dips := c.GpuFrequentIdleDips).enabled:
        rules.append(FrequentIdleDips(
            severity=dips.severity, window_seconds=dips.window, for_seconds=dips.for_,
            clear_for_seconds=dips.clear_for, max_per_minute=dips.max_per_minute,
            hysteresis=dips.hysteresis, min_utilization=dips.min_utilization))
    if (sk := c.GpuUtilizationSkew).enabled:
        rules.append(UtilizationSkew(
            severity=sk.severity, window_seconds=sk.window, for_seconds=sk.for_,
            clear_for_seconds=sk.clear_for,
            max_spread=sk.max_spread, hysteresis=sk.hysteresis, min_gpus=sk.min_gpus))
    if (st := c.GpuBusyButStalled).enabled:
        rules.append(BusyButStalled(
            severity=st.severity, window_seconds=st.window, for_seconds=st.for_,
            clear_for_seconds=st.clear_for,
            min_utilization=st.min_utilization, max_sm_active=st.max_sm_active, hysteresis=st.hysteresis))
    if (th := c.GpuThrottled).enabled:
        rules.append(Throttled(
            severity=th.severity, window_seconds=th.window, for_seconds=th.for_,
            clear_for_seconds=th.clear_for,
            min_fraction=th.min_fraction, hysteresis=th.hysteresis, reasons=frozenset(th.reasons)))
    if (xid := c.GpuXidError).enabled:
        rules.append(XidError(
            severity=xid.severity, window_seconds=xid.window, for_seconds=xid.for_,
            clear_for_seconds=xid.clear_for, benign=frozenset(xid.benign)))
    return rules


def validate_against_interval(config: RulesConfig, sample_interval: float) -> list[str]:
    """Problems of the rules' windows at this sample interval, as "key.path: reason" lines."""
    problems = []
    for name in RulesConfig.model_fields:
        rule = getattr(config, name)
        window = getattr(rule, "window", None)
        if window is None:
            continue
        path = f"alerting.rules.{name}.window"
        if window < sample_interval - 1e-9:
            problems.append(f"{path}: must be at least the sample interval "
                            f"({format_duration(sample_interval)}), got {format_duration(window)}")
        elif window / sample_interval > MAX_WINDOW_POINTS:
            problems.append(f"{path}: {format_duration(window)} holds {window / sample_interval:.0f} "
                            f"samples at the {format_duration(sample_interval)} sample interval; at most "
                            f"{MAX_WINDOW_POINTS} (shorten the window or lengthen the interval)")
    return problems
