"""GpuEccUncorrectable: the GPU counted uncorrectable (double-bit) ECC memory errors in the window."""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    for_field,
    window_field,
)
from gpuscope.alerts.rules.hardware import CounterIncreases, latest_reading, mig_note
from gpuscope.common.durations import format_duration


class EccUncorrectableConfig(RuleConfig):
    # An uncorrectable error ends the job that touched the memory (Xid 48/94/95), and the row it
    # hit is remapped: critical, as GpuXidError is for the same event.
    severity: Severity = "critical"
    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(0.0)


class EccUncorrectableRule(Rule[EccUncorrectableConfig]):
    name: ClassVar[str] = "GpuEccUncorrectable"
    config_model: ClassVar[type[EccUncorrectableConfig]] = EccUncorrectableConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def __init__(self, config: EccUncorrectableConfig) -> None:
        super().__init__(config)
        # Judged from its own record of the counters' changes (CounterIncreases): the history keeps
        # neither points nor marks for it.
        self.window_seconds = None
        self.counted_seconds = config.window
        self.over_text = format_duration(config.window)
        self._counters = CounterIncreases(self.counted_seconds)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        self._counters.keep(history.uuid(gpu) for gpu in history.present)
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None:
                continue
            rose = self._counters.increase(reading.uuid, "ecc_uncorrected",
                                           reading.ecc_uncorrected_errors_total, history.now)
            if rose:
                out[gpu] = Condition(
                    gpu, {"ecc_uncorrected_errors": float(rose)},
                    f"GPU {gpu} counted {rose} uncorrectable ECC error{'s' if rose > 1 else ''}"
                    f"{mig_note(reading)} in the last {self.over_text}: check for a row remap pending or "
                    "failed")
        return out
