"""The last minute or so of each GPU's utilization, for the status page's sparklines.

Two rings per GPU. The driver's own utilization samples (``GpuReading.utilization_samples``, about
six a second, delivered in a batch at each samples read) are what a sparkline draws: a per-tick value
is the mean or, between two samples reads, the driver's current rate, and either hides a GPU that
drops to idle for a fraction of every second. The sample ring keeps the samples of the time the
sparkline spans (``points`` ticks), placed by the driver's timestamps; it is bounded by a length sized
for that span at the driver's rate, with a hard cap. Batches can overlap, so a sample no newer than
the newest kept is dropped. A GPU that keeps no samples (older GPUs), or whose samples reads fail
for longer than the span, falls back to the per-tick ring: one value per tick.

``observe`` is a sampler listener: it runs in the sampler thread once per tick and only appends to
bounded rings (one value per GPU, plus the references of the new samples at a samples read), so it
costs the sampler next to nothing. The status page reads a copy (``series``) from an HTTP thread; a
lock keeps the two apart for the few microseconds either takes. The alert engine keeps a richer
history, but only while alerting is on, and it is shaped for the rules: the page keeps its own, which
exists whatever the configuration.

A GPU in MIG mode has no utilization of its own; each of its MIG devices gets a ring of its busy
share instead: per tick, the growth of its busy-seconds counter (GPM's graphics activity) over the
time since the previous tick. ``series(index, mig_uuid)`` returns it, so the page asks for a MIG
device's sparkline as for a GPU's.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from gpuscope.snapshot import GpuReading, Snapshot, UtilizationSample

DEFAULT_POINTS = 60  # one a tick: a minute at the default 1 s sampling interval
DRIVER_SAMPLES_PER_SECOND = 6  # NVML's utilization sample rate on current GPUs
MAX_SAMPLES = 4096  # per GPU, whatever the span: about 11 min at the driver's rate
_SAMPLE_MARGIN = 1.25  # room in the sample ring for a driver that samples a little faster
_Ring = deque[tuple[float, float | None]]  # (monotonic time, value), oldest first


@dataclass(frozen=True, slots=True)
class UtilizationSeries:
    """One GPU's recent utilization, oldest first.

    ``values``: one per tick, None where it was unreadable that tick. ``samples``: the driver's
    samples of the last ``window_seconds``, as (seconds before the newest sample, value), oldest
    first; empty where the GPU keeps none.
    """

    values: tuple[float | None, ...]
    span_seconds: float  # monotonic time from the oldest point to the newest
    samples: tuple[tuple[float, float], ...] = ()
    window_seconds: float = 0.0  # the time a full sparkline spans


class _GpuRings:
    """One GPU's rings (the lock of the UtilizationHistory held for any access)."""

    __slots__ = ("last_batch", "samples", "ticks", "uuid")

    def __init__(self, uuid: str, points: int, sample_capacity: int) -> None:
        self.uuid = uuid
        self.ticks: _Ring = deque(maxlen=points)
        self.samples: deque[UtilizationSample] = deque(maxlen=sample_capacity)
        self.last_batch = -math.inf  # monotonic time of the last tick that brought new samples


class UtilizationHistory:
    """Rings of the recent utilization per GPU, keyed by GPU index: ``points`` ticks, and the driver
    samples of the same span."""

    def __init__(self, points: int = DEFAULT_POINTS) -> None:
        if points < 2:
            raise ValueError(f"a sparkline needs at least 2 points, got {points}")
        self.points = points
        self._lock = threading.Lock()
        self._window = float(points)  # seconds a full sparkline spans: points x the sampling interval
        self._sample_capacity = sample_capacity(self._window)
        # index -> its rings. A new uuid at an index (a GPU replaced, or re-enumerated) starts fresh
        # rings: another GPU's past is not this one's.
        self._rings: dict[int, _GpuRings] = {}
        # index -> MIG device uuid -> (its busy share ring, its last (monotonic time, busy-seconds)).
        self._mig: dict[int, dict[str, tuple[_Ring, tuple[float, float] | None]]] = {}

    def observe(self, snapshot: Snapshot) -> None:
        """Record one tick (a sampler listener: quick, never raises on a well-formed Snapshot)."""
        with self._lock:
            window = self.points * snapshot.interval_seconds
            if window != self._window and math.isfinite(window) and window > 0:
                self._resize(window)
            seen = set()
            for gpu in snapshot.gpus:
                seen.add(gpu.index)
                rings = self._rings.get(gpu.index)
                if rings is None or rings.uuid != gpu.uuid:
                    rings = _GpuRings(gpu.uuid, self.points, self._sample_capacity)
                    self._rings[gpu.index] = rings
                    self._mig.pop(gpu.index, None)
                rings.ticks.append((snapshot.monotonic, gpu.utilization_ratio if gpu.up else None))
                if gpu.utilization_samples:
                    self._add_samples(rings, gpu.utilization_samples, snapshot.monotonic)
                elif rings.samples and snapshot.monotonic - rings.last_batch > self._window:
                    rings.samples.clear()  # no samples for a whole span: the per-tick values again
                if gpu.mig_devices or gpu.index in self._mig:
                    self._observe_mig(gpu, snapshot.monotonic)
            for gone in self._rings.keys() - seen:  # GPUs NVML no longer lists: bounded by the node's
                del self._rings[gone]
                self._mig.pop(gone, None)

    def _add_samples(self, rings: _GpuRings, batch: tuple[UtilizationSample, ...], t: float) -> None:
        """Append a batch's new samples, then drop those older than the span (lock held)."""
        ring = rings.samples
        if ring and batch[-1].timestamp_us < ring[0].timestamp_us:
            ring.clear()  # the whole batch predates the ring: the driver's clock started again
        newest = ring[-1].timestamp_us if ring else -1
        for sample in batch:  # in time order (decoding sorts them); an overlap's repeats are dropped
            if sample.timestamp_us > newest:
                ring.append(sample)
                newest = sample.timestamp_us
        rings.last_batch = t
        oldest_kept = newest - self._window * 1e6
        while ring and ring[0].timestamp_us < oldest_kept:
            ring.popleft()

    def _resize(self, window: float) -> None:
        """A new sampling interval (lock held): the sample rings get the capacity of the new span."""
        self._window = window
        self._sample_capacity = sample_capacity(window)
        for rings in self._rings.values():
            rings.samples = deque(rings.samples, maxlen=self._sample_capacity)

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
        """A copy of GPU ``index``'s rings (empty if none, or if they belong to another uuid); with the
        UUID of one of its MIG devices, that device's busy share."""
        samples: tuple[UtilizationSample, ...] = ()
        with self._lock:
            window = self._window
            rings = self._rings.get(index)
            if rings is not None and rings.uuid == uuid:
                points = tuple(rings.ticks)
                samples = tuple(rings.samples)
            else:
                device = self._mig.get(index, {}).get(uuid)
                points = tuple(device[0]) if device is not None else ()
        placed: tuple[tuple[float, float], ...] = ()
        if samples:
            newest = samples[-1].timestamp_us
            placed = tuple(((newest - s.timestamp_us) / 1e6, s.value) for s in samples)
        span = points[-1][0] - points[0][0] if points else 0.0
        return UtilizationSeries(tuple(value for _, value in points), span, placed, window)


def sample_capacity(window_seconds: float) -> int:
    """The sample ring's length for a span: the driver's rate over it, with room, at most MAX_SAMPLES."""
    return max(2, min(MAX_SAMPLES, math.ceil(window_seconds * DRIVER_SAMPLES_PER_SECOND * _SAMPLE_MARGIN)))
