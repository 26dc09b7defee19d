"""GpuXidError: the driver reported an Xid error on the GPU that is not application-caused."""

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
    window_field,
)

# Xid codes people ask about; the summary names them (NVIDIA's Xid catalogue has the full list).
XID_MEANINGS = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt", 63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate", 94: "contained ECC error",
    95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
}


class XidErrorConfig(RuleConfig):
    severity: Severity = "critical"
    window: WindowDuration = window_field(30.0)
    for_: ForDuration = for_field(0.0)
    clear_for: ForDuration = clear_for_field(300.0)
    benign: list[Annotated[int, Field(ge=1)]] = Field(
        [13, 31, 43, 45], description="Xid codes that do not alert (application-caused).")


class XidErrorRule(Rule[XidErrorConfig]):
    name: ClassVar[str] = "GpuXidError"
    config_model: ClassVar[type[XidErrorConfig]] = XidErrorConfig
    captures_by_default: ClassVar[bool] = False  # a hardware event does not show in a trace
    include_down: ClassVar[bool] = True  # Xid 79 and friends arrive as the GPU goes down

    def __init__(self, config: XidErrorConfig) -> None:
        super().__init__(config)
        self.benign = frozenset(config.benign)

    def evaluate(self, history: NodeHistory, active: frozenset[int]) -> dict[int, Condition]:
        assert self.window_seconds is not None
        out = {}
        for gpu in sorted(history.present):
            latest = history.latest(gpu)
            if latest is None or not latest.xid_errors:
                continue  # the common case: no Xid since the agent started
            window = history.window(gpu, self.window_seconds, min_coverage=0.0)
            if window is None:
                continue
            new = {code: n for code, n in window.new_xids().items() if code not in self.benign}
            if new:
                codes = sorted(new)
                described = ", ".join(f"{c} ({XID_MEANINGS[c]})" if c in XID_MEANINGS else str(c)
                                      for c in codes)
                out[gpu] = Condition(
                    gpu, {f"xid_{c}": float(new[c]) for c in codes},
                    f"GPU {gpu} reported Xid {described} in the last {self._over}")
        return out
