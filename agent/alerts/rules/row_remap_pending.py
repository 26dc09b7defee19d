"""GpuRowRemapPending: a remapped memory row waits for a GPU reset to take effect."""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import ForDuration, Rule, RuleConfig, clear_for_field, for_field
from gpuscope.alerts.rules.hardware import latest_reading, mig_note


class RowRemapPendingConfig(RuleConfig):
    severity: Severity = "warning"  # a reset repairs it
    # The health readings change at most every nvml.health_interval: a minute leaves out one odd read.
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(0.0)


class RowRemapPendingRule(Rule[RowRemapPendingConfig]):
    name: ClassVar[str] = "GpuRowRemapPending"
    config_model: ClassVar[type[RowRemapPendingConfig]] = RowRemapPendingConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None or not reading.row_remap_pending:
                continue
            out[gpu] = Condition(
                gpu, {"row_remap_pending": 1.0,
                      "remapped_rows_uncorrectable": float(reading.remapped_rows_uncorrectable_total or 0)},
                f"GPU {gpu} has a memory row remap pending{mig_note(reading)}: drain it and reset the GPU")
        return out
