"""The last minute or so of each GPU's utilization, for the status page's sparklines.

``observe`` is a sampler listener: it runs in the sampler thread once per tick and only appends one
number per GPU to a bounded ring, so it costs the sampler next to nothing. The status page reads a
copy (``series``) from an HTTP thread; a lock keeps the two apart for the few microseconds either
takes. The alert engine keeps a richer history, but only while alerting is on, and it is shaped for
the rules: the page keeps its own, which exists whatever the configuration.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from gpuscope.snapshot import Snapshot

DEFAULT_POINTS = 60  # one a tick: a minute at the default 1 s sampling interval


@dataclass(frozen=True, slots=True)
class UtilizationSeries:
    """One GPU's recent utilization, oldest first; None where it was unreadable that tick."""

    values: tuple[float | None, ...]
    span_seconds: float  # monotonic time from the oldest point to the newest


class UtilizationHistory:
    """A ring of the last ``points`` utilization readings per GPU, keyed by GPU index."""

    def __init__(self, points: int = DEFAULT_POINTS) -> None:
        if points < 2:
            raise ValueError(f"a sparkline needs at least 2 points, got {points}")
        self.points = points
        self._lock = threading.Lock()
        # index -> (uuid, ring of (monotonic time, utilization)). A new uuid at an index (a GPU
        # replaced, or re-enumerated) starts a fresh ring: another GPU's past is not this one's.
        self._rings: dict[int, tuple[str, deque[tuple[float, float | None]]]] = {}

    def observe(self, snapshot: Snapshot) -> None:
        """Record one tick (a sampler listener: quick, never raises on a well-formed Snapshot)."""
        with self._lock:
            seen = set()
            for gpu in snapshot.gpus:
                seen.add(gpu.index)
                entry = self._rings.get(gpu.index)
                if entry is None or entry[0] != gpu.uuid:
                    entry = (gpu.uuid, deque(maxlen=self.points))
                    self._rings[gpu.index] = entry
                entry[1].append((snapshot.monotonic, gpu.utilization_ratio if gpu.up else None))
            for gone in self._rings.keys() - seen:  # GPUs NVML no longer lists: bounded by the node's
                del self._rings[gone]

    def series(self, index: int, uuid: str) -> UtilizationSeries:
        """A copy of GPU ``index``'s ring (empty if none, or if it belongs to another uuid)."""
        with self._lock:
            entry = self._rings.get(index)
            points = tuple(entry[1]) if entry is not None and entry[0] == uuid else ()
        if not points:
            return UtilizationSeries((), 0.0)
        return UtilizationSeries(tuple(value for _, value in points), points[-1][0] - points[0][0])
