"""The capture data model shared by backends, the store, the policy and the control API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from gpuscope.common.unixfs import NewFile

# captured: a trace was stored. busy: the target was already profiling (another session).
# empty: the target answered with an empty trace (it was idle). exited: the target process ended
# before its trace was complete (a PyTorch job that exits while the agent waits for its trace file).
# unreachable: no answer within the deadline (no server, a process that does not poll). refused: the
# policy said no (cooldown, budget, quota, busy node). failed: anything else (a protocol error, a disk
# error, a trace that stopped growing); ``error`` says what.
Outcome = Literal["captured", "busy", "empty", "exited", "unreachable", "refused", "failed"]
TargetKind = Literal["tsl", "kineto"]  # tsl: TensorFlow/JAX ProfilerService; kineto: PyTorch on-demand
TriggerKind = Literal["alert", "user", "webhook", "fleet"]
MAX_ERROR_CHARS = 500  # an outcome's error message (from a target, a protocol) is clipped to this
_KIND_NAMES: dict[TargetKind, str] = {"tsl": "TSL profiler", "kineto": "Kineto"}


class CaptureError(Exception):
    """Base of the capture subsystem's errors (the store, ids and records, the Kineto daemon, the
    Alertmanager webhook): what the CLI and the API turn into a one-line message."""


def clip_error(text: str) -> str:
    """An error message from outside (a target's, a protocol's), clipped to MAX_ERROR_CHARS."""
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"


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


class StagingArea(Protocol):
    """Where a backend writes one capture's files: a private directory of the store (its Staging)."""

    @property
    def run(self) -> str:
        """The TensorBoard run name of this capture's traces."""
        ...

    def new_file(self, stem: str, suffix: str, *, folders: tuple[str, ...] = ()) -> NewFile:
        """A file ``<folders>/<stem>[-N]<suffix>`` to write and then publish (``NewFile.publish``
        returns its path relative to the capture); unpublished, it is removed."""
        ...


class CaptureBackend(Protocol):
    """One profiler protocol. ``capture`` blocks for about ``duration_s`` plus protocol overhead, never
    longer than ``deadline_s``, writes its files into ``staging`` and returns an outcome: it never
    raises. (Kineto's backend is the one exception: ``deadline_s`` bounds the wait for the job to take
    its config; the job then writes its trace at its own pace, which has bounds of its own.)"""

    kind: TargetKind

    def capture(self, target: CaptureTarget, duration_s: float, staging: StagingArea, *,
                deadline_s: float) -> BackendResult: ...


def request_problem(target: CaptureTarget, kind: TargetKind, duration_s: float,
                    deadline_s: float) -> str | None:
    """Why a backend of ``kind`` cannot take this request (None when it can): checked before any
    target is contacted."""
    if target.kind != kind or (target.address is None if kind == "tsl" else target.pid is None):
        return f"not a {_KIND_NAMES[kind]} target: {target.describe()}"
    if not duration_s > 0:
        return f"the capture length ({duration_s:g} s) must be positive"
    if not deadline_s > duration_s:
        return f"the deadline ({deadline_s:g} s) must exceed the capture length ({duration_s:g} s)"
    return None


@dataclass(frozen=True, slots=True)
class Trigger:
    kind: TriggerKind
    alertname: str | None = None  # for alert and webhook triggers
    user: str | None = None  # for user triggers: who asked (uid or token name)
    # For the agent's alert triggers: the samples the alert judged when it fired, from its window
    # before the condition first held to the moment it fired (wall clock), and its summary then;
    # capture/alert_context.py sets them beside what the capture saw.
    judged_since: float | None = None
    judged_until: float | None = None
    alert_summary: str | None = None


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
    # What the traces show (gpuscope.capture.analysis_worker's summary), added after the capture;
    # None until then, and for captures without a trace.
    analysis: dict[str, Any] | None = None
    # A user or fleet capture: what it cost the alert captures (the hourly budget they share).
    notice: str | None = None
    version: int = 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["target"] = ", ".join(t.target.describe() for t in self.targets) or None
        return data


OUTCOME_RANK: Sequence[Outcome] = ("captured", "busy", "empty", "exited", "unreachable", "failed", "refused")


def best_outcome(outcomes: Sequence[Outcome]) -> Outcome:
    """The most useful outcome among several targets' (a capture is 'captured' if any target was)."""
    return min(outcomes, key=OUTCOME_RANK.index) if outcomes else "failed"
