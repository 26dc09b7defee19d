"""The findings a diagnosis reports: their names, severities and thresholds, and how they rank.

Each finding is a share of the steps' time (or a count per step) with a threshold for ``moderate`` and
one for ``high``; ``low`` is what is worth knowing but is not what holds the step back (an
opportunity, or a cost the device hides for now). The verdict is the first finding that is not
``low``: a trace with only low findings is healthy.

Findings come in two groups, in the order an expert reads a trace: first *is the device idle, and
why* (``IDLE_KINDS``), then *what is it busy with* (``BUSY_KINDS``). At equal severity, an idle finding
comes first: the device's work is not on the critical path while the device waits for the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["high", "moderate", "low"]
SEVERITIES: tuple[Severity, ...] = ("high", "moderate", "low")

IDLE_KINDS = ("input_bound", "host_bound", "host_sync", "launch_bound", "communication_wait",
              "idle_between_steps", "shared_gpu")
BUSY_KINDS = ("tensor_cores_idle", "costly_op", "dominant_op", "layout_conversion", "small_grids",
              "optimizer_heavy")
FINDING_KINDS = IDLE_KINDS + BUSY_KINDS
HEALTHY = "healthy"
UNREADABLE = "unreadable"  # nothing in the trace could be diagnosed
INCONCLUSIVE = "inconclusive"  # no finding holds, and the trace shows too little to call it healthy


@dataclass(frozen=True, slots=True)
class Bounds:
    """From ``moderate`` the finding is reported, from ``high`` it is severe; a finding whose bounds
    start at ``low`` is reported as low from there and never higher."""

    moderate: float
    high: float
    low: float | None = None

    @property
    def reported_from(self) -> float:
        """The share from which a finding is made at all: its checklist threshold."""
        return self.low if self.low is not None else self.moderate

    def severity(self, share: float) -> Severity | None:
        if share >= self.high:
            return "high"
        if share >= self.moderate:
            return "moderate"
        if self.low is not None and share >= self.low:
            return "low"
        return None


NEVER = float("inf")
# TensorFlow's input-pipeline analysis calls a step "moderately" input-bound from 5% and "highly" from
# 20%: the same bounds serve every share of idle time, so that one scale reads them all.
IDLE_BOUNDS = Bounds(0.05, 0.20)
BOUNDS: dict[str, Bounds] = {
    **dict.fromkeys(IDLE_KINDS, IDLE_BOUNDS),
    "tensor_cores_idle": Bounds(0.10, 0.25),  # fp32 matrix kernels, of the step time
    # One operation's kernels, of the DEVICE's time (not the step's): how much of the work one fusion
    # would remove. Idle time is the idle findings' to report, and caps this one at low.
    "dominant_op": Bounds(0.30, 0.50),
    "layout_conversion": Bounds(0.05, 0.20),
    "costly_op": Bounds(0.10, 0.20),  # one data-dependent operation's kernels, of the step time
    "small_grids": Bounds(0.20, 0.40),  # kernels with fewer thread blocks than SMs, of the step time
    "optimizer_heavy": Bounds(NEVER, NEVER, low=0.20),  # an opportunity, never the bottleneck
}
SYNCS_PER_STEP = 1.0  # synchronisation points per step that are worth a finding when they cannot be timed


@dataclass(frozen=True, slots=True)
class Evidence:
    name: str  # an operation, kernel or Python function
    count: int  # occurrences in the measured steps
    time_ms: float  # its time (for input and idle: the device idle time behind it) in the steps
    site: str = ""  # the Python call site outside library code, when the trace has stacks
    detail: str = ""  # the kernel behind an operation, or the operation behind a kernel


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    severity: Severity
    share: float | None  # of the steps' time; None where it cannot be measured (CPU traces)
    per_step: float | None  # occurrences per step, where counting is the measure
    summary: str
    evidence: tuple[Evidence, ...]
    remedy: str


@dataclass(frozen=True, slots=True)
class Check:
    """One item of the checklist, as measured, whether or not it made a finding."""

    kind: str
    value: float  # a share of the steps' time, or a count per step (``unit``)
    threshold: float  # from which it is reported
    unit: str = "share"  # "share" or "per_step"
    note: str = ""  # what the value is of (the costliest operation, ...)

    @property
    def passed(self) -> bool:
        return self.value < self.threshold


def rank(finding: Finding) -> tuple[int, int, float, int]:
    """Sort key: most severe first; at equal severity the device's idle time before its work; then the
    larger share; then the checklist's order."""
    return rank_of(finding.kind, finding.severity, finding.share)


def rank_of(kind: str, severity: str, share: float | None) -> tuple[int, int, float, int]:
    """``rank`` of a finding as its parts (a finding read back from JSON)."""
    return (SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES),
            kind not in IDLE_KINDS, -(share if share is not None else IDLE_BOUNDS.moderate),
            FINDING_KINDS.index(kind) if kind in FINDING_KINDS else len(FINDING_KINDS))


def verdict_of(findings: tuple[Finding, ...] | list[Finding]) -> str:
    """The first finding that holds the step back, or ``healthy``."""
    for finding in sorted(findings, key=rank):
        if finding.severity != "low":
            return finding.kind
    return HEALTHY


def percent(share: float) -> str:
    return f"{share * 100:.0f}%"
