"""GpuPcieErrors: the GPU's PCIe link counted uncorrectable (fatal or non-fatal) errors, or many replays,
in the window."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import listing
from gpuscope.alerts.rules.hardware import CounterRule, CounterRuleConfig, counted_text, mig_note
from gpuscope.snapshot import GpuReading

UNCORRECTABLE_TYPES = ("fatal", "non_fatal")  # any one in the window loses a transfer


class PcieErrorsConfig(CounterRuleConfig):
    severity: Severity = "warning"
    replays_per_minute: Annotated[float, Field(gt=0, le=1e9)] = Field(
        8.0, description="PCIe replays a minute over the window above which the alert fires (NVIDIA's DCGM "
                         "limit).")


class PcieErrorsRule(CounterRule[PcieErrorsConfig]):
    name: ClassVar[str] = "GpuPcieErrors"
    config_model: ClassVar[type[PcieErrorsConfig]] = PcieErrorsConfig

    def __init__(self, config: PcieErrorsConfig) -> None:
        super().__init__(config)
        self.replay_limit = config.replays_per_minute * self.counted_seconds / 60.0

    def judge(self, gpu: int, reading: GpuReading, now: float) -> Condition | None:
        over = {kind: n for kind, n in self.counters.increases(
            reading.uuid, "pcie:", reading.pcie_errors_total, UNCORRECTABLE_TYPES, now).items() if n > 0}
        replays = self.counters.increase(reading.uuid, "pcie_replays", reading.pcie_replays_total, now)
        if replays is not None and replays > self.replay_limit:
            over["replay"] = replays
        if not over:
            return None
        counted = listing([counted_text(n, "replay" if kind == "replay" else f"{kind} error")
                           for kind, n in over.items()])
        return Condition(gpu, {kind: float(n) for kind, n in over.items()},
                         f"GPU {gpu} counted PCIe errors{mig_note(reading)} in the last {self.over_text}: "
                         f"{counted}")
