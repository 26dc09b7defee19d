"""The evidence rows of a finding: which events, how often, how long, and from where in the user's
Python code they were called (when the trace has stacks)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from typing import Any

from gpuscope.analysis.findings import Evidence
from gpuscope.analysis.intervals import IntervalSet
from gpuscope.analysis.model import Kind, Trace
from gpuscope.analysis.patterns import LIBRARY_FRAME

MAX_EVIDENCE = 5
_SITE_SCAN = 20_000  # Python frames looked at, backwards, for one call site
_SITE_SAMPLES = 50  # events of one name whose call site is looked up


class EvidenceFinder:
    """Evidence from one trace's events within the measured steps ``window``."""

    def __init__(self, trace: Trace, window: tuple[float, float]) -> None:
        self.trace = trace
        self.window = window

    def rows(self, indices: Iterable[Any], weight: IntervalSet | None, *, kind: Kind | None = None,
             by_count: bool = False) -> tuple[Evidence, ...]:
        """The names of these events with their counts and time (or time within ``weight``), largest
        first, with a call site each. ``indices`` are (kind, index) pairs, or indices of ``kind``."""
        totals: dict[str, list[Any]] = {}
        a, b = self.window
        for item in indices:
            k, i = (kind, item) if kind is not None else item
            spans = self.trace.spans[k]
            start, end = spans.start[i], spans.start[i] + spans.dur[i]
            if not a <= start < b:
                continue
            entry = totals.setdefault(self.trace.names[spans.name[i]], [0, 0.0, []])
            entry[0] += 1
            entry[1] += weight.covered(start, end) if weight is not None else end - start
            if len(entry[2]) < _SITE_SAMPLES:
                entry[2].append((start, end, spans.track[i]))
        ranked = sorted(totals.items(), key=lambda kv: -(kv[1][0] if by_count else kv[1][1]))[:MAX_EVIDENCE]
        return tuple(Evidence(name, count, round(time / 1e3, 3), self.site_of(name, samples))
                     for name, (count, time, samples) in ranked)

    def site_of(self, name: str, samples: list[tuple[float, float, int]]) -> str:
        """The most frequent innermost Python frame outside library code that encloses these events."""
        python = self.trace.spans[Kind.PYTHON]
        if not len(python):
            return ""
        sites: dict[str, int] = {}
        for start, end, track in samples[:_SITE_SAMPLES]:
            site = self._caller(name, start, end, track) or self._callee(name, start, end, track)
            if site:
                sites[site] = sites.get(site, 0) + 1
        return max(sites, key=sites.__getitem__) if sites else ""

    def _caller(self, name: str, start: float, end: float, track: int) -> str:
        """The innermost user frame around the event."""
        python, names = self.trace.spans[Kind.PYTHON], self.trace.names
        i = bisect_right(python.start, start)
        for j in range(i - 1, max(i - 1 - _SITE_SCAN, -1), -1):
            if python.track[j] != track or python.start[j] + python.dur[j] < end:
                continue
            frame = names[python.name[j]]
            if frame != name and not LIBRARY_FRAME.search(frame):
                return frame
        return ""

    def _callee(self, name: str, start: float, end: float, track: int) -> str:
        """The outermost user frame inside the event (a capture that began inside the caller records
        no caller): "calls gen.py:4 batches" for a ``next`` on a generator."""
        python, names = self.trace.spans[Kind.PYTHON], self.trace.names
        first = max(bisect_right(python.start, start) - 1, 0)
        for j in range(first, min(first + _SITE_SCAN, len(python))):
            if python.start[j] >= end:
                break
            if python.track[j] != track or python.start[j] < start or python.start[j] + python.dur[j] > end:
                continue
            frame = names[python.name[j]]
            if frame != name and not LIBRARY_FRAME.search(frame):
                return f"calls {frame}"
        return ""

    def host_overlap(self, idle: IntervalSet, wrapper_us: float) -> tuple[Evidence, ...]:
        """The host's outermost operations and Python frames by their overlap with ``idle``, spans of
        ``wrapper_us`` or longer left out (they wrap the loop, not a step's work)."""
        overlap: dict[str, list[float]] = {}
        for kind in (Kind.HOST_OP, Kind.PYTHON):
            spans = self.trace.spans[kind]
            open_until: dict[int, float] = {}
            for i in range(len(spans)):
                start, end = spans.start[i], spans.start[i] + spans.dur[i]
                if start < open_until.get(spans.track[i], float("-inf")) or spans.dur[i] >= wrapper_us:
                    continue
                open_until[spans.track[i]] = end
                covered = idle.covered(start, end)
                if covered > 0:
                    entry = overlap.setdefault(self.trace.names[spans.name[i]], [0, 0.0])
                    entry[0] += 1
                    entry[1] += covered
        return tuple(Evidence(name, int(count), round(time / 1e3, 3))
                     for name, (count, time) in sorted(overlap.items(), key=lambda kv: -kv[1][1])
                     [:MAX_EVIDENCE])
