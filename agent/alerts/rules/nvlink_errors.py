"""GpuNvlinkErrors: the GPU's NVLink links (summed) counted recovery or replay errors, or CRC errors at a
high rate, in the window."""

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

ANY_ERROR_TYPES = ("recovery", "replay")  # any one in the window: a link in trouble
CRC_TYPES = ("crc_flit", "crc_data")  # corrected by replay: only a high rate matters


class NvlinkErrorsConfig(RuleConfig):
    severity: Severity = "warning"
    # An error keeps the alert up for the window it stays in, as PromQL's increase() over 10m does.
    window: WindowDuration = window_field(600.0)
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(0.0)
    crc_per_second: Annotated[float, Field(gt=0, le=1e9)] = Field(
        100.0, description="CRC errors (flit or data) a second over the window above which the alert fires "
                           "(NVIDIA's DCGM limit).")


class NvlinkErrorsRule(Rule[NvlinkErrorsConfig]):
    name: ClassVar[str] = "GpuNvlinkErrors"
    config_model: ClassVar[type[NvlinkErrorsConfig]] = NvlinkErrorsConfig
    captures_by_default: ClassVar[bool] = False  # hardware: a profiler trace cannot show it

    def __init__(self, config: NvlinkErrorsConfig) -> None:
        super().__init__(config)
        # Judged from its own record of the counters' changes (CounterIncreases): the history keeps
        # neither points nor marks for it.
        self.window_seconds = None
        self.counted_seconds = config.window
        self.over_text = format_duration(config.window)
        self.crc_limit = config.crc_per_second * self.counted_seconds
        self._counters = CounterIncreases(self.counted_seconds)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        out = {}
        self._counters.keep(history.uuid(gpu) for gpu in history.present)
        for gpu in sorted(history.up):
            reading = latest_reading(history, gpu)
            if reading is None or reading.nvlink_errors_total is None:
                continue  # no NVLink, or its error counters not read
            rose = self._counters.increases(reading.uuid, "nvlink:", reading.nvlink_errors_total,
                                            ANY_ERROR_TYPES + CRC_TYPES, history.now)
            over = {kind: n for kind, n in rose.items()
                    if n > (0 if kind in ANY_ERROR_TYPES else self.crc_limit)}
            if over:
                counted = listing([counted_text(n, f"{kind} error") for kind, n in over.items()], most=4)
                out[gpu] = Condition(
                    gpu, {kind: float(n) for kind, n in over.items()},
                    f"GPU {gpu} counted NVLink errors{mig_note(reading)} in the last {self.over_text}: "
                    f"{counted}")
        return out
