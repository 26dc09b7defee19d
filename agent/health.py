"""Per-source health, as node_exporter reports its collectors: for each source of what the agent
exports, whether its last run succeeded and how long it took.

The sources: ``nvml`` (the NVML part of a sampling tick), ``processes`` (mapping the GPU processes
to host processes in a tick), ``pods`` (the last kubelet query), ``alerts`` (the last evaluation of
the rules), ``captures`` (the capture worker, and the last capture it processed) and ``otlp`` (the
last OTLP push). Each writes its
own entry after each run; the exporter reads them at scrape time. A source that never ran (pods on a
node without a kubelet) has no entry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

SOURCES = ("nvml", "processes", "pods", "alerts", "captures", "otlp")


@dataclass(frozen=True, slots=True)
class SourceRun:
    """The outcome of a source's last run. ``duration_seconds`` is None before it ran at all (a
    worker that is up but has had nothing to do yet)."""

    success: bool
    duration_seconds: float | None


class SourceHealth:
    """The latest run of each source. Thread-safe: sources record from their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, SourceRun] = {}
        self._dead: dict[str, str | None] = {}  # thread name -> the source it served

    def record(self, source: str, *, success: bool, duration_seconds: float | None) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown source {source!r}; the sources are {', '.join(SOURCES)}")
        run = SourceRun(success, duration_seconds)
        with self._lock:
            self._runs[source] = run

    def runs(self) -> dict[str, SourceRun]:
        """Source -> its latest run, in SOURCES order (a copy); a source one of whose threads died is
        failed whatever its latest run says."""
        with self._lock:
            failed = set(self._dead.values())
            runs = {source: self._runs.get(source, SourceRun(False, None)) for source in SOURCES
                    if source in self._runs or source in failed}
        return {source: SourceRun(False, run.duration_seconds) if source in failed else run
                for source, run in runs.items()}

    def thread_died(self, thread: str, source: str | None) -> None:
        """A long-lived thread ended on an error (see threads.start_thread); for good."""
        with self._lock:
            self._dead[thread] = source

    def dead_threads(self) -> list[str]:
        with self._lock:
            return sorted(self._dead)
