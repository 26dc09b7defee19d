"""GpuRowRemapFailed: a failing memory row could not be remapped; the GPU needs replacing."""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import ForDuration, Rule, RuleConfig, clear_for_field, for_field
from gpuscope.alerts.rules.hardware import latest_reading, mig_note


class RowRemapFailedConfig(RuleConfig):
    severity: Severity = "critical"  # a reset does not help: the memory stays bad
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(0.0)


class RowRemapFailedRule(Rule[RowRemapFailedConfig]):
    name: ClassVar[str] = "GpuRowRemapFailed"
    config_model: ClassVar[type[RowRemapFailedConfig]] = RowRemapFailedConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None or not reading.row_remap_failed:
                continue
            out[gpu] = Condition(
                gpu, {"row_remap_failed": 1.0,
                      "remapped_rows_uncorrectable": float(reading.remapped_rows_uncorrectable_total or 0)},
                f"GPU {gpu} could not remap a failing memory row{mig_note(reading)}: drain it and replace "
                "the GPU")
        return out
