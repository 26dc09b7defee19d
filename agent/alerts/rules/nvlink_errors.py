"""GpuNvlinkErrors: the GPU's NVLink links (summed) counted recovery or replay errors, or CRC errors at a
high rate, in the window."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.base import listing
from gpuscope.alerts.rules.hardware import CounterRule, CounterRuleConfig, counted_text, mig_note
from gpuscope.snapshot import GpuReading

ANY_ERROR_TYPES = ("recovery", "replay")  # any one in the window: a link in trouble
CRC_TYPES = ("crc_flit", "crc_data")  # corrected by replay: only a high rate matters


class NvlinkErrorsConfig(CounterRuleConfig):
    severity: Severity = "warning"
    crc_per_second: Annotated[float, Field(gt=0, le=1e9)] = Field(
        100.0, description="CRC errors (flit or data) a second over the window above which the alert fires "
                           "(NVIDIA's DCGM limit).")


class NvlinkErrorsRule(CounterRule[NvlinkErrorsConfig]):
    name: ClassVar[str] = "GpuNvlinkErrors"
    config_model: ClassVar[type[NvlinkErrorsConfig]] = NvlinkErrorsConfig

    def __init__(self, config: NvlinkErrorsConfig) -> None:
        super().__init__(config)
        self.crc_limit = config.crc_per_second * self.counted_seconds

    def judge(self, gpu: int, reading: GpuReading, now: float) -> Condition | None:
        if reading.nvlink_errors_total is None:
            return None  # no NVLink, or its error counters not read
        rose = self.counters.increases(reading.uuid, "nvlink:", reading.nvlink_errors_total,
                                       ANY_ERROR_TYPES + CRC_TYPES, now)
        over = {kind: n for kind, n in rose.items() if n > (0 if kind in ANY_ERROR_TYPES else self.crc_limit)}
        if not over:
            return None
        counted = listing([counted_text(n, f"{kind} error") for kind, n in over.items()], most=4)
        return Condition(gpu, {kind: float(n) for kind, n in over.items()},
                         f"GPU {gpu} counted NVLink errors{mig_note(reading)} in the last {self.over_text}: "
                         f"{counted}")
