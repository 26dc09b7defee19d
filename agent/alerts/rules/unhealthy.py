"""GpuUnhealthy: the GPU's health (``GpuReading.health``) is other than ok: the one alert to drain on."""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import ForDuration, Rule, RuleConfig, clear_for_field, for_field
from gpuscope.alerts.rules.hardware import latest_reading, mig_note
from gpuscope.snapshot import HEALTH_STATES

# What to do after draining, by health state (the summary's end).
ACTIONS = {"reset_required": "reset the GPU", "replace": "replace the GPU",
           "lost": "reset the GPU or reboot the node"}
assert set(ACTIONS) == set(HEALTH_STATES) - {"ok"}


class UnhealthyConfig(RuleConfig):
    # The urgency is in the alerts with the cause (GpuRowRemapFailed is critical).
    severity: Severity = "warning"
    for_: ForDuration = for_field(60.0)
    clear_for: ForDuration = clear_for_field(0.0)


class UnhealthyRule(Rule[UnhealthyConfig]):
    name: ClassVar[str] = "GpuUnhealthy"
    config_model: ClassVar[type[UnhealthyConfig]] = UnhealthyConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it
    include_down: ClassVar[bool] = True  # "lost" is a GPU that is down

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        for gpu in sorted(history.present):
            reading = latest_reading(history, gpu)
            if reading is None or (state := reading.health) == "ok":
                continue
            out[gpu] = Condition(
                gpu, {state: 1.0},
                f"GPU {gpu} is unhealthy ({state}){mig_note(reading)}: drain the node, then {ACTIONS[state]}")
        return out
