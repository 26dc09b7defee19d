"""The last minute or so of each GPU's utilization, for the status page's sparklines.

``observe`` is a sampler listener: it runs in the sampler thread once per tick and only appends one
number per GPU to a bounded ring, so it costs the sampler next to nothing. The status page reads a
copy (``series``) from an HTTP thread; a lock keeps the two apart for the few microseconds either
takes. The alert engine keeps a richer history, but only while alerting is on, and it is shaped for
the rules: the page keeps its own, which exists whatever the configuration.

A GPU in MIG mode has no utilization of its own; each of its MIG devices gets a ring of its busy
share instead: per tick, the growth of its busy-seconds counter (GPM's graphics activity) over the
time since the previous tick. ``series(index, mig_uuid)`` returns it, so the page asks for a MIG
device's sparkline as for a GPU's.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from gpuscope.snapshot import GpuReading, Snapshot

DEFAULT_POINTS = 60  # one a tick: a minute at the default 1 s sampling interval
_Ring = deque[tuple[float, float | None]]  # (monotonic time, value), oldest first


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
        # index -> MIG device uuid -> (its busy share ring, its last (monotonic time, busy-seconds)).
        self._mig: dict[int, dict[str, tuple[_Ring, tuple[float, float] | None]]] = {}

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
                    self._mig.pop(gpu.index, None)
                entry[1].append((snapshot.monotonic, gpu.utilization_ratio if gpu.up else None))
                if gpu.mig_devices or gpu.index in self._mig:
                    self._observe_mig(gpu, snapshot.monotonic)
            for gone in self._rings.keys() - seen:  # GPUs NVML no longer lists: bounded by the node's
                del self._rings[gone]
                self._mig.pop(gone, None)

    def _observe_mig(self, gpu: GpuReading, t: float) -> None:
        """One tick of a MIG GPU's devices (lock held): a device no longer listed is forgotten; while
        the GPU is down, its devices' rings get a gap."""
        rings = self._mig.setdefault(gpu.index, {})
        if not gpu.up:
            for uuid, (ring, _) in rings.items():
                ring.append((t, None))
                rings[uuid] = (ring, None)
            return
        listed = {}
        for device in gpu.mig_devices:
            ring, last = rings.get(device.uuid) or (deque(maxlen=self.points), None)
            busy = device.busy_seconds_total
            share = None
            if busy is not None and last is not None and t > last[0] and busy >= last[1]:
                share = min(1.0, (busy - last[1]) / (t - last[0]))
            ring.append((t, share))
            listed[device.uuid] = (ring, (t, busy) if busy is not None else None)
        if listed:
            self._mig[gpu.index] = listed
        else:  # out of MIG mode
            del self._mig[gpu.index]

    def series(self, index: int, uuid: str) -> UtilizationSeries:
        """A copy of GPU ``index``'s ring (empty if none, or if it belongs to another uuid); with the
        UUID of one of its MIG devices, that device's busy share."""
        with self._lock:
            entry = self._rings.get(index)
            if entry is not None and entry[0] == uuid:
                points = tuple(entry[1])
            else:
                device = self._mig.get(index, {}).get(uuid)
                points = tuple(device[0]) if device is not None else ()
        if not points:
            return UtilizationSeries((), 0.0)
        return UtilizationSeries(tuple(value for _, value in points), points[-1][0] - points[0][0])
