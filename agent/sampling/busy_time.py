"""Busy time: the driver's utilization samples integrated into seconds during which kernels ran.

A utilization gauge shows the last sampling interval only, so a scraper that reads it every 15 s
sees one second in fifteen. A counter of busy seconds gives the busy fraction over any window with
rate(), whatever the scrape interval, as node_cpu_seconds_total does for CPUs.

Each driver sample is the fraction of its sample period during which a kernel ran, so it adds
``value x period``. Its period is the time since the previous sample's driver timestamp. The driver
samples at a fixed period (NVML: between 1/6 s and 1 s, depending on the product) and records nothing
while a GPU has no context; a spacing longer than ``GAP_TOLERANCE`` nominal periods therefore means
samples are missing (no context, or the GPU could not be read) and the sample counts one nominal
period, the rest of the gap none. The nominal period is the shortest spacing seen between two
consecutive samples, 1/6 s until one has been seen; a sample with no predecessor (the first after
the agent started on a GPU whose buffer was empty, or a process's first) also counts one nominal
period.

The first samples read from a GPU are the driver's whole buffer (some 20 s, from before the agent
started, that a previous agent may have counted): they only mark where counting starts, so a counter
starts at 0 with the agent and no sample is ever counted twice, even across a restart. A driver
timestamp at or before the last one counted is skipped.

On a GPU that keeps no samples, the utilization rate (the driver's mean over its last sample period)
times the time since the previous reading stands in; a GPU that could not be read adds nothing for
the time it was down.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

DEFAULT_SAMPLE_PERIOD_US = 166_667  # current data-center GPUs sample utilization six times a second
GAP_TOLERANCE = 1.5  # spacings up to this many nominal periods are one period (timer jitter)
# NVML's sample periods lie between 1/6 s and 1 s: a spacing outside that range (with a margin for timer
# jitter) is not the period, and cannot become the nominal one.
_MIN_PERIOD_US = 100_000
_MAX_PERIOD_US = 1_500_000


class SamplePeriod:
    """The driver's nominal sample period for one stream of samples (a GPU's, or its processes')."""

    __slots__ = ("_seen", "nominal_us")

    def __init__(self) -> None:
        self.nominal_us = DEFAULT_SAMPLE_PERIOD_US
        self._seen = False  # whether nominal_us was learnt from the samples yet

    def weight_us(self, gap_us: int | None) -> int:
        """The period a sample stands for, ``gap_us`` after the previous one (None: no previous one).
        A spacing that could be the driver's period and is the shortest so far becomes the nominal one."""
        if gap_us is None:
            return self.nominal_us
        if _MIN_PERIOD_US <= gap_us <= _MAX_PERIOD_US and (not self._seen or gap_us < self.nominal_us):
            self.nominal_us = gap_us
            self._seen = True
        return gap_us if gap_us <= GAP_TOLERANCE * self.nominal_us else self.nominal_us


class SampleIntegrator:
    """Busy seconds from one stream of driver samples: one GPU's, or one process's on one GPU."""

    __slots__ = ("last_us", "total")

    def __init__(self) -> None:
        self.last_us: int | None = None  # the driver timestamp of the last sample counted (or skipped)
        self.total = 0.0

    def add(self, samples: Iterable[tuple[int, float]], period: SamplePeriod) -> float:
        """Count ``samples`` (driver µs, ratio 0-1), in time order; returns the busy seconds added."""
        last = self.last_us
        added_us = 0.0
        nominal = period.nominal_us
        longest = GAP_TOLERANCE * nominal
        for timestamp, value in samples:  # some 6 samples per stream and second: kept lean
            if last is None:
                weight = nominal
            else:
                gap = timestamp - last
                if gap <= 0:
                    continue  # counted already
                if nominal <= gap <= longest:  # the usual spacing: its own period
                    weight = gap
                else:  # a gap, or a shorter spacing that may become the nominal period
                    weight = period.weight_us(gap)
                    nominal = period.nominal_us
                    longest = GAP_TOLERANCE * nominal
            added_us += value * weight
            last = timestamp
        self.last_us = last
        added = added_us / 1e6
        self.total += added
        return added

    def skip(self, samples: Iterable[tuple[int, float]], period: SamplePeriod) -> None:
        """Mark ``samples`` as counted without counting them (what the driver buffered before the agent
        started), learning the sample period from their spacing."""
        last = self.last_us
        for timestamp, _ in samples:
            if last is not None and timestamp <= last:
                continue
            if last is not None:
                period.weight_us(timestamp - last)
            last = timestamp
        self.last_us = last


class GpuBusyTime:
    """One GPU's busy seconds: from its utilization samples, or from the utilization rate where it
    keeps none."""

    __slots__ = ("_period", "_rate_at", "_samples", "total")

    def __init__(self) -> None:
        self._samples = SampleIntegrator()
        self._period = SamplePeriod()
        self._rate_at: float | None = None  # when the rate was last read (monotonic seconds)
        self.total = 0.0

    def add_samples(self, samples: Iterable[tuple[int, float]], *, from_history: bool) -> float:
        """This tick's new samples; ``from_history``: the driver's buffer at start, not counted."""
        self._rate_at = None
        if from_history:
            self._samples.skip(samples, self._period)
            return 0.0
        added = self._samples.add(samples, self._period)
        self.total += added
        return added

    def add_rate(self, ratio: float, now: float) -> float:
        """The utilization rate read at ``now`` (monotonic seconds), on a GPU without samples."""
        previous, self._rate_at = self._rate_at, now
        if previous is None or now <= previous:
            return 0.0  # the first reading (or the first since the GPU was down) starts the count
        added = ratio * (now - previous)
        self.total += added
        return added

    def interrupted(self) -> None:
        """The GPU could not be read this tick: the time until it can is not counted."""
        self._rate_at = None


class ProcessBusyTime:
    """Busy seconds of each process on one GPU, from the driver's per-process SM utilization samples.

    State is kept for the processes NVML lists on the GPU and dropped as soon as a process is no longer
    listed, so it is bounded by the processes alive on the GPU.
    """

    __slots__ = ("_by_pid", "_period")

    def __init__(self) -> None:
        self._by_pid: dict[int, SampleIntegrator] = {}
        self._period = SamplePeriod()

    def update(self, samples: Mapping[int, Iterable[tuple[int, float]]], listed: Collection[int], *,
               from_history: bool) -> dict[int, float]:
        """Count this tick's samples of the ``listed`` pids (others have exited or are not ours to
        count); returns each listed pid's busy seconds so far."""
        by_pid = self._by_pid
        for pid in [pid for pid in by_pid if pid not in listed]:
            del by_pid[pid]
        period = self._period
        totals = {}
        for pid in listed:
            integrator = by_pid.get(pid)
            if integrator is None:
                integrator = by_pid[pid] = SampleIntegrator()
            rows = samples.get(pid)
            if rows:
                if from_history:
                    integrator.skip(rows, period)
                else:
                    integrator.add(rows, period)
            totals[pid] = integrator.total
        return totals

    def __len__(self) -> int:
        return len(self._by_pid)


class GpmActiveTime:
    """GPM's SM and tensor activity ratios integrated over the intervals they cover. Each GPM reading
    covers the time since the previous one, so consecutive readings tile time and the sums are exact;
    a GPU lost in between starts a new interval (the boundary), so the loss is never counted."""

    __slots__ = ("sm_seconds", "tensor_seconds")

    def __init__(self) -> None:
        self.sm_seconds: float | None = None  # None until GPM reported the ratio once
        self.tensor_seconds: float | None = None

    def add(self, sm_ratio: float | None, tensor_ratio: float | None, seconds: float | None) -> None:
        if seconds is None:
            return
        if sm_ratio is not None:
            self.sm_seconds = (self.sm_seconds or 0.0) + sm_ratio * seconds
        if tensor_ratio is not None:
            self.tensor_seconds = (self.tensor_seconds or 0.0) + tensor_ratio * seconds
