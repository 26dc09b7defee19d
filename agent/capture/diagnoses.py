"""The latest diagnosis of each GPU: what the newest analysed capture of that GPU found.

The analysis worker reports each analysed record (``on_analysed``); at start the agent loads the
stored records (``load``), so the diagnosis of a GPU outlives an agent restart as long as its capture
is in the store. Only a capture with a verdict replaces a GPU's diagnosis: one whose analysis was
skipped (too large, the analysis stopped by its limits) tells nothing about the GPU. A record's
analysis is read from a file anyone with write access to the store could have edited, so only the
closed set of verdict, finding and severity names passes, and shares outside 0..1 are clamped: the
metrics built from it stay bounded.

A capture record names its GPU by index and not its MIG device, so a capture of a MIG device's
processes is the diagnosis of its parent GPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuscope.analysis.findings import FINDING_KINDS, HEALTHY, INCONCLUSIVE, SEVERITIES, UNREADABLE
from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.record_gains import estimated

VERDICTS = (*FINDING_KINDS, HEALTHY, INCONCLUSIVE, UNREADABLE)


@dataclass(frozen=True, slots=True)
class FindingShare:
    """One finding kind of a capture: its largest share of the step time over the capture's traces, the
    severity of that largest one, and the largest estimated gain of a fix of that kind (None when no
    trace's gain of it was estimated). ``share`` None: no trace could measure it (a CPU-only trace)."""

    kind: str
    severity: str
    share: float | None
    gain_share: float | None


@dataclass(frozen=True, slots=True)
class GpuDiagnosis:
    """What the newest analysed capture of one GPU found."""

    gpu: int
    capture_id: str
    start: float  # the capture's start, Unix seconds
    verdict: str
    findings: tuple[FindingShare, ...]  # one per kind, in FINDING_KINDS order
    gain_together: float | None  # all the estimated fixes together; None when none was estimated


def diagnosis_of(record: CaptureRecord) -> GpuDiagnosis | None:
    """The diagnosis ``record``'s analysis gives its GPU; None for a capture of no GPU, one not
    analysed, or one whose verdict is not a name this agent knows."""
    analysis = record.analysis
    if record.gpu is None or not isinstance(analysis, dict) or analysis.get("verdict") not in VERDICTS:
        return None
    kinds: dict[str, FindingShare] = {}
    for raw in analysis.get("findings") or ():
        found = _finding(raw)
        if found is None:
            continue
        kept = kinds.get(found.kind)
        kinds[found.kind] = found if kept is None else _merged(kept, found)
    findings = tuple(kinds[kind] for kind in FINDING_KINDS if kind in kinds)
    gains = [f.gain_share for f in findings if f.gain_share is not None]
    # The record keeps the replay of all of a trace's estimated fixes together where a trace had two
    # or more; with a single estimated fix, that fix is all of them. Never less than the largest single
    # fix: the traces of one capture are its processes, and the largest single fix is one of them.
    together = _gain_share(analysis.get("gain_together"))
    if gains:
        together = max(gains) if together is None else max(together, *gains)
    return GpuDiagnosis(record.gpu, record.id, record.start, str(analysis["verdict"]), findings, together)


def _finding(raw: Any) -> FindingShare | None:
    if not isinstance(raw, dict) or raw.get("kind") not in FINDING_KINDS:
        return None
    severity = raw.get("severity")
    if severity not in SEVERITIES:
        return None
    return FindingShare(str(raw["kind"]), str(severity), _share(raw.get("share")),
                        _gain_share(raw.get("gain")))


def _merged(kept: FindingShare, other: FindingShare) -> FindingShare:
    """Two traces' findings of one kind: the larger share with its severity, the larger gain."""
    unmeasured = -1.0  # a share of None ranks below every measured one
    larger = other if ((other.share if other.share is not None else unmeasured)
                       > (kept.share if kept.share is not None else unmeasured)) else kept
    gains = [g for g in (kept.gain_share, other.gain_share) if g is not None]
    return FindingShare(larger.kind, larger.severity, larger.share, max(gains) if gains else None)


def _gain_share(gain: Any) -> float | None:
    """The share a finding's fix wins back; None when it was not estimated (or the record has none)."""
    found = estimated(gain)
    return _share(found[2]) if found is not None else None


def _share(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))


class LatestDiagnoses:
    """Thread-safe: the analysis thread writes, scrapes read. One diagnosis per GPU, the newest capture's
    (by start time, then id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_gpu: dict[int, GpuDiagnosis] = {}

    def load(self, records: Iterable[CaptureRecord]) -> None:
        """The stored records' diagnoses (the store's listing at start)."""
        for record in records:
            self.on_analysed(record)

    def on_analysed(self, record: CaptureRecord) -> None:
        """An analysis listener: the record's diagnosis replaces its GPU's when it is newer."""
        diagnosis = diagnosis_of(record)
        if diagnosis is None:
            return
        with self._lock:
            kept = self._by_gpu.get(diagnosis.gpu)
            if kept is None or (kept.start, kept.capture_id) <= (diagnosis.start, diagnosis.capture_id):
                self._by_gpu[diagnosis.gpu] = diagnosis

    def latest(self) -> list[GpuDiagnosis]:
        """Each GPU's diagnosis, by GPU index."""
        with self._lock:
            return [self._by_gpu[gpu] for gpu in sorted(self._by_gpu)]
