"""Per-GPU history for the alert rules: a bounded ring of compact points, one per sampler tick.

``NodeHistory.observe(snapshot)`` runs in the sampler thread, so it keeps only what the rules read
(a NamedTuple per GPU per tick). Each point also carries running sums (busy ticks and their
utilization, SM activity, idle dips, readable clock-event reasons), so a window's mean or count
is the difference of two points: O(1), whatever the window's length. Rules ask for a ``Window``
(the points of the last N seconds of monotonic time); windows are cached for the tick, so rules
that judge the same window share it.

Each point stands for the interval that ends at it (its utilization is the mean of the driver
samples since the previous tick), so the history *covers* ``now - oldest + interval`` seconds.

Rules whose windows are long (minutes of a GPU held or allocated while idle) do not need every tick:
each GPU also keeps *marks*, one of its points every few seconds (a sixtieth of the shortest such
window, at least a tick), and ``NodeHistory.span`` differences the latest point against the mark at
the window's start. Ten minutes at a 1 s interval are then 60 marks rather than 600 points. Each GPU
also keeps what such rules read of the present: its latest reading, since when each of its compute
processes has held it, since when each pod container has been allocated it, and when a process last
held a context on it (``Occupancy``, in ``alerts/occupancy.py``).

A GPU in MIG mode has no utilization of its own: rules judge each of its MIG devices instead. Each
point then also carries, per MIG device (by its UUID), the device's busy-seconds counter as read and
a running count of the points at which a compute process ran on it (``MigPoint``), so a window's or
span's busy share and job fraction are differences too; and the occupancy keeps the same "who holds
it since when" per MIG device (``InstanceOccupancy``). A tick at which the GPU is down, or its MIG
devices could not be listed, carries the previous point's MIG devices forward with their busy
counters as last read, so that the running counts go on across it: a down GPU's devices had no job
at that tick (as a down GPU's point has no utilization); those that could not be listed had one where
a compute process ran in them as last listed. While the devices cannot be listed,
``NodeHistory.mig_unknown`` names the GPU, and the rules do not judge its devices (their alerts keep
their state).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Collection, Iterator, Mapping
from typing import NamedTuple

from gpuscope.alerts.occupancy import InstanceOccupancy, Occupancy, mig_listed
from gpuscope.snapshot import GpuReading, Snapshot

# The occupancy's types are named here too: the rules read them beside the history that keeps them.
__all__ = ["MARKS_PER_WINDOW", "MIN_COVERAGE", "InstanceOccupancy", "MigPoint", "NodeHistory", "Occupancy",
           "Point", "Span", "Window", "mig_listed", "point_of"]

# Below this fraction of a window covered by history (the agent's first seconds, a GPU just seen),
# rules do not judge the window: a few seconds of data are no evidence of a trend.
MIN_COVERAGE = 0.8
_MARGIN_POINTS = 5  # points kept beyond the longest window (a baseline before it, clock jitter)
MARKS_PER_WINDOW = 60  # marks per shortest span window: its start is placed to a sixtieth of it
_NO_XIDS: Mapping[int, int] = {}
# NVML readings whose failure leaves a tick's process lists unknown (Snapshot.sample_errors keys).
_PROCESS_READINGS = ("processes", "graphics_processes")
_MIG_READING = "mig_devices"  # ... and the one whose failure leaves its MIG devices unknown


class MigPoint(NamedTuple):
    """One MIG device at one tick (a point's ``mig`` entry)."""

    busy: float | None  # MigReading.busy_seconds_total as read: cumulative, None before GPM measured it
    job: bool  # a compute process ran on the device at this tick
    n_job: int  # points so far at which one did, this one included (counted since the device's
    # first point in a row: a tick without it starts the count again)


_NO_MIG: Mapping[str, MigPoint] = {}


class Point(NamedTuple):
    """One GPU at one tick: what the rules read, plus running sums that make window means O(1).

    The ``n_*``/``sum_*`` fields are cumulative over this GPU's history up to and including this
    point: a window's total is the difference between its last point and the point before it.
    """

    t: float  # Snapshot.monotonic
    up: bool
    utilization: float | None
    sm_active: float | None  # GPM; None where unsupported (pre-Hopper, MIG) or not yet available
    clock_event_reasons: frozenset[str] | None
    compute_processes: tuple[str | None, ...]  # names (None: not visible from the host)
    xid_errors: Mapping[int, int]  # code -> events since the agent started (cumulative)
    idle_dips_total: int | None  # the sampler's cumulative counter, as read
    n_busy: int  # points with utilization and at least one compute process
    sum_busy: float  # ... the sum of their utilization
    n_sm: int  # points with both utilization and SM activity
    sum_sm_util: float  # ... the sum of their utilization
    sum_sm: float  # ... the sum of their SM activity
    n_dips: int  # points with an idle-dip counter reading
    dips: int  # idle dips counted (the counter's increments; a counter that went down restarts)
    n_reasons: int  # points with clock event reasons
    k: int  # points so far (this one included)
    n_util: int  # points with utilization, with or without a process
    sum_util: float  # ... the sum of their utilization
    mig: Mapping[str, MigPoint]  # MIG device UUID -> its reading at this tick (MIG mode only)


_ZERO = Point(0.0, False, None, None, None, (), _NO_XIDS, None, 0, 0.0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0.0,
              _NO_MIG)


def point_of(reading: GpuReading, t: float, prev: Point | None, last_dips: int | None,
             mig_known: bool = True, *, devices: Mapping[str, InstanceOccupancy] | None = None) -> Point:
    """The reading as a Point, its running sums continued from ``prev`` (None: the first point);
    ``last_dips``: the latest idle-dip counter reading before this one. ``mig_known`` False: a MIG
    device listing failed this tick. Where the GPU is down, or its MIG devices are not listed
    (``mig_listed``), the previous point's MIG devices are carried forward (``_held``); ``devices``:
    the GPU's MIG devices as last listed, which the processes read this tick are matched against
    then."""
    p = prev or _ZERO
    util = reading.utilization_ratio
    names = tuple([q.name for q in reading.processes if q.kind == "compute"])
    n_busy, sum_busy = p.n_busy, p.sum_busy
    if names and util is not None:
        n_busy += 1
        sum_busy += util
    sm = reading.sm_active_ratio
    n_sm, sum_sm_util, sum_sm = p.n_sm, p.sum_sm_util, p.sum_sm
    if sm is not None and util is not None:
        n_sm += 1
        sum_sm_util += util
        sum_sm += sm
    dips_total = reading.idle_dips_total
    n_dips, dips = p.n_dips, p.dips
    if dips_total is not None:
        n_dips += 1
        if last_dips is not None:
            dips += dips_total - last_dips if dips_total >= last_dips else dips_total
    reasons = reading.clock_event_reasons
    n_util, sum_util = p.n_util, p.sum_util
    if util is not None:
        n_util += 1
        sum_util += util
    return Point(t, reading.up, util, sm, reasons, names, reading.xid_errors or _NO_XIDS, dips_total,
                 n_busy, sum_busy, n_sm, sum_sm_util, sum_sm, n_dips, dips,
                 p.n_reasons + (reasons is not None), p.k + 1, n_util, sum_util,
                 (_mig_points(reading, p.mig) if reading.mig_devices else _NO_MIG)
                 if mig_listed(reading, mig_known) else _held(reading, p.mig, devices))


def _held(reading: GpuReading, prev: Mapping[str, MigPoint],
          devices: Mapping[str, InstanceOccupancy] | None) -> Mapping[str, MigPoint]:
    """The MIG devices of the previous point at a tick where they were not read: their busy counters
    as last read, and their job counts going on rather than starting again. A job on one where a
    compute process of the GPU (up: its devices could not be listed) ran in it as last listed
    (``devices``); none on those of a GPU that is down, as a down GPU's point has no utilization."""
    if not prev:
        return prev
    compute = [q for q in reading.processes if q.kind == "compute" and q.gpu_instance is not None] \
        if reading.up and devices else []
    out = {}
    for uuid, m in prev.items():
        device = devices.get(uuid) if compute and devices else None
        job = device is not None and any(device.reading.runs(q) for q in compute)
        out[uuid] = MigPoint(m.busy, job, m.n_job + job)
    return out


def _mig_points(reading: GpuReading, prev: Mapping[str, MigPoint]) -> dict[str, MigPoint]:
    out = {}
    compute = [p for p in reading.processes if p.kind == "compute" and p.gpu_instance is not None]
    for device in reading.mig_devices:
        job = any(device.runs(p) for p in compute)
        before = prev.get(device.uuid)
        out[device.uuid] = MigPoint(device.busy_seconds_total, job, (before.n_job if before else 0) + job)
    return out


class Window:
    """The points of one GPU within ``(now - seconds, now]``, and their totals.

    ``baseline`` is the last point before the window (None when the history does not reach that
    far): counters (idle dips, Xids) are differenced against it, so a window of one interval still
    sees the events of that interval.
    """

    __slots__ = ("_base", "_deque", "_gpu", "_start", "baseline", "last", "n", "seconds")

    def __init__(self, gpu: _GpuHistory, start: int, seconds: float) -> None:
        points = gpu.points
        self._gpu = gpu
        self._deque = points
        self._start = start
        self.seconds = seconds
        self.n = len(points) - start
        self.last = points[-1]
        self.baseline = points[start - 1] if start > 0 else None
        # The running sums just before the window. Without a point before it, the window starts
        # at the oldest point kept: its sums less its own share.
        self._base = self.baseline if self.baseline is not None else _before(points[start])

    @property
    def points(self) -> Iterator[Point]:
        return itertools.islice(self._deque, self._start, None)

    def busy_utilization(self) -> tuple[float, float | None]:
        """(fraction of the window's points at which the GPU reported utilization and ran at least
        one compute process; mean utilization over those points, None if none)."""
        n = self.last.n_busy - self._base.n_busy
        return n / self.n, _mean(self.last.sum_busy - self._base.sum_busy, n) if n else None

    def sm_activity(self) -> tuple[float, float | None, float | None]:
        """(fraction of points with both utilization and GPM SM activity; mean utilization and mean
        SM activity over those points, None if none)."""
        last, base = self.last, self._base
        n = last.n_sm - base.n_sm
        if not n:
            return 0.0, None, None
        return n / self.n, _mean(last.sum_sm_util - base.sum_sm_util, n), _mean(last.sum_sm - base.sum_sm, n)

    def idle_dips(self) -> tuple[int, float] | None:
        """(dips counted in the window, seconds they were counted over), or None without counter
        readings to count between (unsupported: MIG, no driver samples). Counted from the point
        before the window, or at start-up from the window's first point."""
        ref = self.baseline if self.baseline is not None else self._deque[self._start]
        last = self.last
        if last.n_dips == ref.n_dips or last.t <= ref.t:
            return None
        return last.dips - ref.dips, last.t - ref.t

    def clock_events(self, reasons: frozenset[str]) -> tuple[int, int]:
        """(points with clock event reasons, points where any of ``reasons`` was active)."""
        counts = self._gpu.reason_counts(reasons)
        start = self._start
        if start > 0:
            matched = counts[-1] - counts[start - 1]
        else:
            first = self._deque[0].clock_event_reasons
            matched = counts[-1] - counts[0] + (first is not None and not reasons.isdisjoint(first))
        return self.last.n_reasons - self._base.n_reasons, matched

    def instance_activity(self, device: InstanceOccupancy) -> tuple[float, float | None]:
        """(fraction of the window's points at which a compute process ran on the MIG device; the
        share of the window it was busy, from its busy-seconds counter: None where that covers less
        than MIN_COVERAGE of the window)."""
        uuid = device.reading.uuid
        last = self.last.mig.get(uuid)
        if last is None:
            return 0.0, None
        if self.baseline is not None:
            base = self.baseline
            before = base.mig.get(uuid)
            n0 = before.n_job if before is not None else 0
        else:  # start-up: from the window's first point, less its own share
            base = self._deque[self._start]
            first = base.mig.get(uuid)
            n0 = first.n_job - first.job if first is not None else 0
        return (last.n_job - n0) / self.n, _busy_share(base, self.last, device, self.seconds)

    def new_xids(self) -> dict[int, int]:
        """Xid code -> events within the window (a count that went down restarted from 0)."""
        last = self.last.xid_errors
        if not last:
            return {}
        base = self.baseline.xid_errors if self.baseline is not None else _NO_XIDS
        out = {}
        for code, count in last.items():
            before = base.get(code, 0)
            new = count - before if count >= before else count
            if new > 0:
                out[code] = new
        return out


def _mean(total: float, n: float) -> float:
    """A window mean from the difference of two running sums, without the rounding noise of that
    difference (0.3 held for a minute is 0.3, not 0.29999999999999993): 9 decimals of a ratio."""
    return round(total / n, 9)


def _busy_share(base: Point, last: Point, device: InstanceOccupancy, seconds: float) -> float | None:
    """The share of (base, last] the MIG device was busy, from its busy-seconds counter at both ends.
    Where ``base`` has no reading of it (the device's first ticks, GPM's first sample) the counter's
    first reading after ``base`` starts it; None when what is left covers less than MIN_COVERAGE of
    ``seconds`` (or the counter went down: not the same device)."""
    uuid = device.reading.uuid
    end = last.mig.get(uuid)
    if end is None or end.busy is None:
        return None
    start = base.mig.get(uuid)
    if start is not None and start.busy is not None:
        t0, busy0 = base.t, start.busy
    elif device.first_busy is not None and device.first_busy[0] >= base.t:
        t0, busy0 = device.first_busy
    else:
        return None
    covered = last.t - t0
    if covered <= 0 or covered < MIN_COVERAGE * seconds - 1e-9 or end.busy < busy0:
        return None
    return min(1.0, _mean(end.busy - busy0, covered))


def _before(p: Point) -> Point:
    """The running sums of the point before ``p`` (p's sums less p's own share)."""
    busy = bool(p.compute_processes) and p.utilization is not None
    sm = p.sm_active is not None and p.utilization is not None
    return p._replace(
        n_busy=p.n_busy - busy, sum_busy=p.sum_busy - (p.utilization or 0.0) * busy,
        n_sm=p.n_sm - sm, sum_sm_util=p.sum_sm_util - (p.utilization or 0.0) * sm,
        sum_sm=p.sum_sm - (p.sm_active or 0.0) * sm,
        n_reasons=p.n_reasons - (p.clock_event_reasons is not None),
        k=p.k - 1, n_util=p.n_util - (p.utilization is not None),
        sum_util=p.sum_util - (p.utilization or 0.0))


class Span:
    """One GPU's totals from a mark at (or just before) the start of a long window to its latest
    point: the window rounded out to the mark before it (see ``NodeHistory.span``)."""

    __slots__ = ("_base", "last", "n")

    def __init__(self, base: Point, last: Point) -> None:
        self._base = base
        self.last = last
        self.n = last.k - base.k  # the points after the mark, up to and including the latest

    def utilization(self) -> tuple[float, float | None]:
        """(fraction of the span's points with a utilization reading, with or without a process;
        their mean utilization, None if none)."""
        n = self.last.n_util - self._base.n_util
        if not n:
            return 0.0, None
        return n / self.n, _mean(self.last.sum_util - self._base.sum_util, n)

    def instance_busy(self, device: InstanceOccupancy, seconds: float) -> float | None:
        """The share of the span the MIG device was busy (its busy-seconds counter from the mark to
        now); None where that counter covers less than MIN_COVERAGE of ``seconds``."""
        return _busy_share(self._base, self.last, device, seconds)


class _GpuHistory:
    """One GPU's points, its marks (every ``mark_step`` seconds, for spans), its occupancy, and per
    set of clock event reasons a rule asked about, the running count of points at which one of them
    was active (a deque aligned with the points)."""

    __slots__ = ("_matches", "last_dips", "mark_step", "marks", "occupancy", "points", "uuid")

    def __init__(self, uuid: str, maxlen: int, *, mark_step: float, marks: int, t: float,
                 reading: GpuReading) -> None:
        self.uuid = uuid
        self.points: deque[Point] = deque(maxlen=maxlen)
        self.mark_step = mark_step
        self.marks: deque[Point] = deque(maxlen=marks)
        self.occupancy = Occupancy(t, reading)
        self.last_dips: int | None = None  # the latest idle-dip counter reading
        self._matches: dict[frozenset[str], deque[int]] = {}

    def append(self, point: Point, reading: GpuReading, processes_known: bool, mig_known: bool) -> None:
        self.points.append(point)
        marks = self.marks
        if marks.maxlen and (not marks or point.t - marks[-1].t >= self.mark_step - 1e-9):
            marks.append(point)
        self.occupancy.update(point.t, reading, processes_known, mig_known)
        if point.idle_dips_total is not None:
            self.last_dips = point.idle_dips_total
        if self._matches:
            active = point.clock_event_reasons
            for reasons, counts in self._matches.items():
                counts.append(counts[-1] + (active is not None and not reasons.isdisjoint(active)))

    def reason_counts(self, reasons: frozenset[str]) -> deque[int]:
        counts = self._matches.get(reasons)
        if counts is None:  # first asked: count over the points kept, then keep up on each append
            counts = self._matches[reasons] = deque(maxlen=self.points.maxlen)
            total = 0
            for p in self.points:
                active = p.clock_event_reasons
                total += active is not None and not reasons.isdisjoint(active)
                counts.append(total)
        return counts


class NodeHistory:
    """The recent past of every GPU of the node, fed one Snapshot per tick (sampler thread).

    ``longest_window_seconds`` sizes the per-tick ring (``window``); ``span_windows`` are the windows
    rules judge from marks (``span``), which size the marks and their spacing (none: no marks).
    """

    def __init__(self, longest_window_seconds: float, span_windows: Collection[float] = ()) -> None:
        self.longest_window_seconds = longest_window_seconds
        self.span_windows = tuple(sorted(span_windows))
        self.now = 0.0  # monotonic time of the latest snapshot
        self.interval = 1.0  # the sampler's interval (from the snapshots)
        self.present: frozenset[int] = frozenset()  # GPUs in the latest snapshot
        self.up: frozenset[int] = frozenset()  # ... of which readable
        # ... of which in MIG mode with their MIG devices not listed this tick (the listing failed):
        # their devices are not judged, and their alerts keep their state.
        self.mig_unknown: frozenset[int] = frozenset()
        self._gpus: dict[int, _GpuHistory] = {}
        self._windows: dict[tuple[int, float, float], Window | None] = {}
        self._process_errors = 0  # failed process listings so far (Snapshot.sample_errors)
        self._mig_errors = 0  # failed MIG device listings so far

    def maxlen(self, interval: float) -> int:
        """Points kept per GPU: the longest window at this interval, plus a small margin."""
        return math.ceil(self.longest_window_seconds / interval * 1.1) + _MARGIN_POINTS

    def mark_step(self, interval: float) -> float:
        """Seconds between marks: a sixtieth of the shortest span window, at least one interval."""
        spans = self.span_windows
        return max(interval, spans[0] / MARKS_PER_WINDOW) if spans else 0.0

    def marks(self, interval: float) -> int:
        """Marks kept per GPU: the longest span window, plus a small margin (0 without spans)."""
        spans = self.span_windows
        return math.ceil(spans[-1] / self.mark_step(interval)) + _MARGIN_POINTS if spans else 0

    def observe(self, snapshot: Snapshot) -> None:
        t = snapshot.monotonic
        self.now = t
        interval = self.interval = snapshot.interval_seconds
        self._windows.clear()
        errors = snapshot.sample_errors
        process_errors = sum([errors.get(r, 0) for r in _PROCESS_READINGS]) if errors else 0
        processes_known = process_errors == self._process_errors  # no process listing failed this tick
        self._process_errors = process_errors
        mig_errors = errors.get(_MIG_READING, 0) if errors else 0
        mig_known = mig_errors == self._mig_errors  # no MIG device listing failed this tick
        self._mig_errors = mig_errors
        gpus = self._gpus
        up = []
        mig_unknown = []
        for reading in snapshot.gpus:
            history = gpus.get(reading.index)
            if history is None or history.uuid != reading.uuid:  # new, or another GPU at this index
                history = gpus[reading.index] = _GpuHistory(
                    reading.uuid, self.maxlen(interval), mark_step=self.mark_step(interval),
                    marks=self.marks(interval), t=t, reading=reading)
            points = history.points
            history.append(point_of(reading, t, points[-1] if points else None, history.last_dips, mig_known,
                                    devices=history.occupancy.instances),
                           reading, processes_known, mig_known)
            if reading.up:
                up.append(reading.index)
                if not mig_listed(reading, mig_known):
                    mig_unknown.append(reading.index)
        self.present = frozenset(r.index for r in snapshot.gpus)
        self.up = frozenset(up)
        self.mig_unknown = frozenset(mig_unknown)

    def uuid(self, gpu: int) -> str:
        history = self._gpus.get(gpu)
        return history.uuid if history is not None else ""

    def latest(self, gpu: int) -> Point | None:
        history = self._gpus.get(gpu)
        return history.points[-1] if history is not None and history.points else None

    def occupancy(self, gpu: int) -> Occupancy | None:
        """Who holds the GPU and since when; None for a GPU never seen."""
        history = self._gpus.get(gpu)
        return history.occupancy if history is not None else None

    def instances(self, gpu: int) -> Mapping[str, InstanceOccupancy]:
        """The GPU's MIG devices as last listed, by UUID, with who holds each: none off MIG."""
        history = self._gpus.get(gpu)
        return history.occupancy.instances if history is not None else {}

    def span(self, gpu: int, seconds: float, min_coverage: float = MIN_COVERAGE) -> Span | None:
        """The GPU's totals over the last ``seconds`` (one of ``span_windows``), from the newest mark
        at or before their start: up to one mark step more. Early on, from the GPU's first point
        once the history covers ``min_coverage`` of them. None when it covers less, the GPU has no
        point now, or the window is longer than the marks kept."""
        history = self._gpus.get(gpu)
        if history is None or not history.marks or history.points[-1].t != self.now:
            return None
        marks = history.marks
        last = history.points[-1]
        i = bisect.bisect_right(marks, self.now - seconds + 1e-9, key=_time)
        if i > 0:
            return Span(marks[i - 1], last)
        first = marks[0]
        if first.k != 1 or self.now - first.t + self.interval < min_coverage * seconds - 1e-9:
            return None
        return Span(_before(first), last)

    def window(self, gpu: int, seconds: float, min_coverage: float = MIN_COVERAGE) -> Window | None:
        """The GPU's points of the last ``seconds``; None when the history covers less than
        ``min_coverage`` of that (start-up, a GPU just seen) or the GPU has no point now."""
        key = (gpu, seconds, min_coverage)
        try:
            return self._windows[key]
        except KeyError:
            window = self._windows[key] = self._window(gpu, seconds, min_coverage)
            return window

    def _window(self, gpu: int, seconds: float, min_coverage: float) -> Window | None:
        history = self._gpus.get(gpu)
        if history is None or not history.points:
            return None
        points = history.points
        if points[-1].t != self.now:
            return None  # not in the latest snapshot
        if self.now - points[0].t + self.interval < min_coverage * seconds - 1e-9:
            return None
        cutoff = self.now - seconds + 1e-9
        # Most windows start a fixed number of ticks back: guess, then bisect only when wrong.
        n = len(points)
        start = n - round(seconds / self.interval)
        if not (0 < start < n and points[start].t > cutoff >= points[start - 1].t):
            start = bisect.bisect_right(points, cutoff, key=_time)
        start = min(start, n - 1)  # a window shorter than a tick still holds the last point
        return Window(history, start, seconds)


def _time(point: Point) -> float:
    return point.t
