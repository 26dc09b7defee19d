"""GpuPcieErrors: the GPU's PCIe link counted uncorrectable (fatal or non-fatal) errors, or many replays,
in the window."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from gpuscope.alerts.history import NodeHistory
from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import (
    ForDuration,
    Rule,
    RuleConfig,
    WindowDuration,
    clear_for_field,
    for_field,
    listing,
    window_field,
)
from gpuscope.alerts.rules.hardware import CounterIncreases, counted_text, latest_reading, mig_note
from gpuscope.common.durations import format_duration

UNCORRECTABLE_TYPES = ("fatal", "non_fatal")  # any one in the window loses a transfer


class PcieErrorsConfig(RuleConfig):
    severity: Severity = "warning"
    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(0.0)
    replays_per_minute: Annotated[float, Field(gt=0, le=1e9)] = Field(
        8.0, description="PCIe replays a minute over the window above which the alert fires (NVIDIA's DCGM "
                         "limit).")


class PcieErrorsRule(Rule[PcieErrorsConfig]):
    name: ClassVar[str] = "GpuPcieErrors"
    config_model: ClassVar[type[PcieErrorsConfig]] = PcieErrorsConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def __init__(self, config: PcieErrorsConfig) -> None:
        super().__init__(config)
        # Judged from its own record of the counters' changes (CounterIncreases): the history keeps
        # neither points nor marks for it.
        self.window_seconds = None
        self.counted_seconds = config.window
        self.over_text = format_duration(config.window)
        self.replay_limit = config.replays_per_minute * self.counted_seconds / 60.0
        self._counters = CounterIncreases(self.counted_seconds)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        self._counters.keep(history.uuid(gpu) for gpu in history.present)
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None:
                continue
            over = {kind: n for kind, n in self._counters.increases(
                reading.uuid, "pcie:", reading.pcie_errors_total, UNCORRECTABLE_TYPES, history.now).items()
                if n > 0}
            replays = self._counters.increase(reading.uuid, "pcie_replays", reading.pcie_replays_total,
                                              history.now)
            if replays is not None and replays > self.replay_limit:
                over["replay"] = replays
            if over:
                counted = listing([counted_text(n, "replay" if kind == "replay" else f"{kind} error")
                                   for kind, n in over.items()])
                out[gpu] = Condition(
                    gpu, {kind: float(n) for kind, n in over.items()},
                    f"GPU {gpu} counted PCIe errors{mig_note(reading)} in the last {self.over_text}: "
                    f"{counted}")
        return out
