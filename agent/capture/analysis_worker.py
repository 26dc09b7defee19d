"""Each stored capture diagnosed right after it is taken, off the sampler's and the capture's paths.

The analysis runs in a child process (``gpuscope explain DIR --json``) with its CPU time and address
space capped by rlimits and at a lower priority: a trace is parsed in that process's memory, never
in the agent's, a pathological trace costs at most its caps, and the agent's footprint does not grow
by what one analysis needed. One capture is analysed at a time; a capture whose traces together pass
``max_trace_bytes`` is not analysed, and its record says why. The summary goes into the capture's
record (``analysis``): the verdict, and the findings with their shares and their top evidence.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuscope.analysis.findings import FINDING_KINDS, HEALTHY, INCONCLUSIVE, UNREADABLE, rank_of
from gpuscope.analysis.sources import is_trace_in_folder
from gpuscope.capture.model import CaptureRecord
from gpuscope.capture.record_gains import estimated, not_estimated_reason
from gpuscope.capture.store import CaptureStore, CaptureStoreError
from gpuscope.common.sizes import format_size
from gpuscope.threads import OnDemandThread

log = logging.getLogger(__name__)

FINDING_NAMES = (*FINDING_KINDS, HEALTHY, INCONCLUSIVE, UNREADABLE)
MAX_OUTPUT_BYTES = 4 << 20  # the child's JSON report
MAX_FINDINGS = 8  # kept in the record, over all of a capture's traces
MAX_ASSUMPTIONS = 4  # of a finding's gain, kept in the record
MAX_TEXT = 300  # characters of a summary or an evidence name kept in the record
_QUEUE_LIMIT = 16
# The child: rlimits first, a lower priority, then what `gpuscope explain --json DIR` does (without the
# command line's parser, which would import the control API's gRPC for nothing).
_CHILD = """\
import os, resource, sys
from pathlib import Path
cpu, memory = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
os.nice(10)
from gpuscope.capture.explanation import explain_path
sys.exit(explain_path(Path(sys.argv[3]), as_json=True))
"""


@dataclass(frozen=True, slots=True)
class AnalysisLimits:
    max_trace_bytes: int
    cpu_seconds: int
    memory_bytes: int


class AnalysisWorker:
    """Queue of captures to diagnose; ``listeners`` hear of each record once its analysis is in it."""

    def __init__(self, store: CaptureStore, limits: AnalysisLimits, *,
                 python: str = sys.executable) -> None:
        self._store = store
        self._limits = limits
        self._python = python
        self._queue: queue.Queue[CaptureRecord | None] = queue.Queue(_QUEUE_LIMIT)
        self._listeners: list[Callable[[CaptureRecord], None]] = []
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(FINDING_NAMES, 0)
        self._worker = OnDemandThread("gpuscope-analysis", self._run)

    def add_listener(self, callback: Callable[[CaptureRecord], None]) -> None:
        self._listeners.append(callback)

    def finding_counts(self) -> dict[str, int]:
        """Findings over the analysed captures since the agent started, by kind (``healthy``: captures
        with none)."""
        with self._lock:
            return dict(self._counts)

    def submit(self, record: CaptureRecord) -> None:
        """Queue a stored capture (a capture listener); never blocks: a full queue skips it, noted."""
        if record.outcome != "captured" or not _trace_files(record):
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._annotate(record, {"verdict": None, "skipped": "too many captures waiting for analysis"})
            return
        self._worker.wake()

    def start(self) -> None:
        """From now on captures are analysed; the thread starts with the first one."""
        self._worker.allow(pending=not self._queue.empty())

    def stop(self, timeout: float = 1.0) -> None:
        self._worker.forbid()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        with contextlib.suppress(queue.Full):  # just emptied: only a racing submit could fill it
            self._queue.put_nowait(None)
        self._worker.join(timeout)

    # ------------------------------------------------------------ the worker

    def _run(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._annotate(record, self.analyse(record))
            except Exception:  # a bug here must not end the worker
                log.exception("analysis of capture %s failed", record.id)

    def analyse(self, record: CaptureRecord) -> dict[str, Any]:
        """The summary of ``record``'s traces (or why there is none), as the record keeps it."""
        started = time.monotonic()
        files = _trace_files(record)
        try:
            directory = self._store.path(record.id)
            size = sum((directory / name).stat().st_size for name in files)
        except (CaptureStoreError, OSError) as err:
            return {"verdict": None, "skipped": f"the capture is gone: {err}"}
        limit = self._limits.max_trace_bytes
        if size > limit:
            return {"verdict": None, "skipped": f"its traces ({format_size(size)}) are larger than "
                                                f"capture.analysis.max_trace_bytes ({format_size(limit)})"}
        report, error = self._explain(directory)
        if report is None:
            return {"verdict": None, "skipped": error}
        summary = summarise(report)
        summary["seconds"] = round(time.monotonic() - started, 3)
        return summary

    def _explain(self, directory: Path) -> tuple[dict[str, Any] | None, str]:
        limits = self._limits
        command = [self._python, "-c", _CHILD, str(limits.cpu_seconds), str(limits.memory_bytes),
                   str(directory)]
        try:
            child = subprocess.run(command, capture_output=True, timeout=limits.cpu_seconds * 2 + 30,
                                   check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, f"the analysis took longer than {limits.cpu_seconds * 2 + 30} s"
        except OSError as err:
            return None, f"cannot start the analysis: {err.strerror or err}"
        if child.returncode != 0:
            last = (child.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
            if child.returncode < 0 or "MemoryError" in last:
                return None, (f"the analysis was stopped by its limits (capture.analysis: cpu_seconds "
                              f"{limits.cpu_seconds}, memory_bytes {format_size(limits.memory_bytes)}): "
                              f"{last[-MAX_TEXT:] or f'signal {-child.returncode}'}")
            return None, last.removeprefix("gpuscope explain: ")[-MAX_TEXT:] or "the analysis failed"
        if len(child.stdout) > MAX_OUTPUT_BYTES:
            return None, "the analysis report is too large"
        try:
            report = json.loads(child.stdout)
        except ValueError:
            return None, "the analysis report is not JSON"
        return (report, "") if isinstance(report, dict) else (None, "the analysis report is not an object")

    def _annotate(self, record: CaptureRecord, summary: dict[str, Any]) -> None:
        try:
            annotated = self._store.annotate(record.id, summary)
        except CaptureStoreError as err:  # evicted meanwhile, or the disk failed
            log.info("capture %s: analysis not stored: %s", record.id, err)
            return
        verdict = summary.get("verdict")
        if verdict is not None:
            with self._lock:
                kinds = {f["kind"] for f in summary.get("findings", ())}
                if verdict in (HEALTHY, INCONCLUSIVE, UNREADABLE):  # no finding, or low ones only
                    kinds.add(verdict)
                for kind in kinds:
                    if kind in self._counts:
                        self._counts[kind] += 1
            log.info("capture %s: %s", record.id, summary.get("headline") or verdict)
        else:
            log.info("capture %s not analysed: %s", record.id, summary.get("skipped"))
        for listener in self._listeners:
            try:
                listener(annotated)
            except Exception:
                log.exception("capture analysis listener %r failed", listener)


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    """What a record keeps of `gpuscope explain --json`: the verdict, a one-line headline, and each
    trace's findings (kind, severity, share, summary, the top evidence), bounded in size."""
    findings: list[dict[str, Any]] = []
    for trace in report.get("traces") or ():
        for finding in trace.get("findings") or ():
            evidence = (finding.get("evidence") or [{}])[0]
            findings.append({
                "kind": str(finding.get("kind")), "severity": str(finding.get("severity")),
                "share": finding.get("share"), "per_step": finding.get("per_step"),
                "summary": str(finding.get("summary", ""))[:MAX_TEXT],
                "evidence": str(evidence.get("name", ""))[:MAX_TEXT],
                "site": str(evidence.get("site", ""))[:MAX_TEXT],
                "trace": Path(str(trace.get("source", ""))).name[:MAX_TEXT],
                "gain": bounded_gain(finding.get("gain"))})
    findings.sort(key=lambda f: rank_of(f["kind"], f["severity"], f["share"]))
    findings = findings[:MAX_FINDINGS]
    # A low finding (an opportunity, a cost the device hides) never makes the verdict.
    top = next((f for f in findings if f["severity"] != "low"), None)
    if top:
        verdict, headline = top["kind"], f"{top['kind']}: {top['summary']}"
    else:
        verdict, headline = _without_finding(report)
    together = next((bounded_gain(t.get("gain_together")) for t in report.get("traces") or ()
                     if isinstance(t, dict) and t.get("gain_together")), None)
    summary = {"verdict": verdict, "headline": headline[:MAX_TEXT], "findings": findings,
               "traces": len(report.get("traces") or ())}
    if together is not None:
        summary["gain_together"] = together
    return summary


def bounded_gain(gain: Any) -> dict[str, Any] | None:
    """What a record keeps of a finding's estimated gain: the step time before and after its fix
    (seconds), the share won back and at most MAX_ASSUMPTIONS assumptions; or why it was not estimated.
    None when the report had none (an analysis from before gains were estimated)."""
    reason = not_estimated_reason(gain)
    if reason is not None:
        return {"not_estimated": reason[:MAX_TEXT]}
    found = estimated(gain)
    if found is None:
        return None
    before, after, share, assumptions = found
    return {"before_s": before, "after_s": after, "share": share,
            "assumptions": [a[:MAX_TEXT] for a in assumptions[:MAX_ASSUMPTIONS]]}


def _without_finding(report: dict[str, Any]) -> tuple[str, str]:
    """The verdict and headline of traces without a finding that holds a step back: healthy only when
    every trace showed enough to say so; unreadable when none could be read, with the reason."""
    traces = [t for t in report.get("traces") or () if isinstance(t, dict)]
    verdicts = [t.get("verdict") for t in traces]
    if traces and all(v == UNREADABLE for v in verdicts):
        return UNREADABLE, f"{UNREADABLE}: {traces[0].get('unreadable') or 'nothing in the traces was read'}"
    unsure = next((t for t in traces if t.get("verdict") in (INCONCLUSIVE, UNREADABLE)), None)
    if unsure is not None:
        reason = next(iter(unsure.get("partial") or unsure.get("limits") or ()), "the trace shows too little")
        return INCONCLUSIVE, f"{INCONCLUSIVE}: {reason}"
    return HEALTHY, f"{HEALTHY}: no finding over its threshold"


def _trace_files(record: CaptureRecord) -> list[str]:
    return [name for name in record.files if is_trace_in_folder(name)]
