"""GpuEccUncorrectable: the GPU counted uncorrectable (double-bit) ECC memory errors in the window."""

from __future__ import annotations

from typing import ClassVar

from gpuscope.alerts.model import Condition, Severity
from gpuscope.alerts.rules.hardware import CounterRule, CounterRuleConfig, mig_note
from gpuscope.snapshot import GpuReading


class EccUncorrectableConfig(CounterRuleConfig):
    # An uncorrectable error ends the job that touched the memory (Xid 48/94/95), and the row it
    # hit is remapped: critical, as GpuXidError is for the same event.
    severity: Severity = "critical"


class EccUncorrectableRule(CounterRule[EccUncorrectableConfig]):
    name: ClassVar[str] = "GpuEccUncorrectable"
    config_model: ClassVar[type[EccUncorrectableConfig]] = EccUncorrectableConfig

    def judge(self, gpu: int, reading: GpuReading, now: float) -> Condition | None:
        rose = self.counters.increase(reading.uuid, "ecc_uncorrected", reading.ecc_uncorrected_errors_total,
                                      now)
        if not rose:
            return None
        return Condition(gpu, {"ecc_uncorrected_errors": float(rose)},
                         f"GPU {gpu} counted {rose} uncorrectable ECC error{'s' if rose > 1 else ''}"
                         f"{mig_note(reading)} in the last {self.over_text}: check for a row remap pending "
                         "or failed")
