"""The capture data model shared by backends, the store, the policy and the control API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

# captured: a trace was stored. busy: the target was already profiling (another session).
# empty: the target answered with an empty trace (it was idle). unreachable: no answer within the
# deadline (no server, dead process). refused: the policy said no (cooldown, budget, quota, busy node).
# failed: anything else (a protocol error, a disk error); ``error`` says what.
Outcome = Literal["captured", "busy", "empty", "unreachable", "refused", "failed"]
TargetKind = Literal["tsl", "kineto"]  # tsl: TensorFlow/JAX ProfilerService; kineto: PyTorch on-demand
TriggerKind = Literal["alert", "user", "webhook", "fleet"]


@dataclass(frozen=True, slots=True)
class CaptureTarget:
    """One way to profile one process."""

    kind: TargetKind
    pid: int | None  # the process, when known
    address: str | None = None  # "host:port" of a ProfilerService (tsl); None for kineto
    source: str = ""  # how it was found: "kineto-registration", "port 6009 of pid 123", "config"

    def describe(self) -> str:
        where = self.address or f"pid {self.pid}"
        return f"{self.kind} {where}"


@dataclass(frozen=True, slots=True)
class BackendResult:
    """What a backend did for one target. ``files`` are paths relative to the staging directory."""

    outcome: Outcome
    files: tuple[str, ...] = ()
    error: str | None = None


class CaptureBackend(Protocol):
    """One profiler protocol. ``capture`` blocks for about ``duration_s`` plus protocol overhead, never
    longer than ``deadline_s``, and writes its files under ``staging`` (a private directory)."""

    kind: TargetKind

    def capture(self, target: CaptureTarget, duration_s: float, staging: Path, *, run: str,
                deadline_s: float) -> BackendResult: ...


@dataclass(frozen=True, slots=True)
class Trigger:
    kind: TriggerKind
    alertname: str | None = None  # for alert and webhook triggers
    user: str | None = None  # for user triggers: who asked (uid or token name)


@dataclass(frozen=True, slots=True)
class TargetOutcome:
    target: CaptureTarget
    outcome: Outcome
    files: tuple[str, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CaptureRecord:
    """capture.json: one capture, complete or not. ``files`` are relative to the capture directory."""

    id: str
    trigger: Trigger
    gpu: int | None
    pids: tuple[int, ...]
    targets: tuple[TargetOutcome, ...]
    start: float  # wall clock, Unix seconds
    duration_s: float  # requested length
    bytes: int
    outcome: Outcome  # the best outcome over the targets (captured > busy > empty > ...)
    error: str | None = None
    files: tuple[str, ...] = field(default_factory=tuple)
    hostname: str = ""
    version: int = 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target"] = ", ".join(t.target.describe() for t in self.targets) or None
        return data


OUTCOME_RANK: Sequence[Outcome] = ("captured", "busy", "empty", "unreachable", "failed", "refused")


def best_outcome(outcomes: Sequence[Outcome]) -> Outcome:
    """The most useful outcome among several targets' (a capture is 'captured' if any target was)."""
    return min(outcomes, key=OUTCOME_RANK.index) if outcomes else "failed"
