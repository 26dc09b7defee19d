"""Energy by owner: each interval's GPU energy divided among the processes that kept the GPU busy.

NVML measures energy per GPU only, so this is an estimate, as per-pod energy is in Kepler. Over each
interval between two energy readings, a process gets the part of the energy that equals its part of
the interval: its busy seconds in the interval (its SM utilization samples, integrated) over the
interval's length. Where the processes' parts add up to more than the whole (kernels of several
processes overlapping, as under MPS), they are scaled down to add up to it. The remainder is idle
energy: the GPU's idle time, and busy time that no process's samples account for. Processes and
idle energy add up to the GPU's energy.

The split is by time, not by power: a busy second draws more than an idle one, so a process's part
is a lower bound of what the GPU drew while its kernels ran, and idle energy holds the rest.
"""

from __future__ import annotations

from collections.abc import Mapping


class EnergySplit:
    """One GPU's energy, split between its processes and idle time, reading by reading.

    State is kept for the processes passed to ``update`` and dropped as soon as one is missing, so it
    is bounded by the processes alive on the GPU.
    """

    __slots__ = ("_at", "_busy_at", "_energy", "by_pid", "idle_total")

    def __init__(self) -> None:
        self._energy: float | None = None  # the GPU's energy total at the last reading, joules
        self._at = 0.0  # when that was read (monotonic seconds)
        self._busy_at: dict[int, float] = {}  # each process's busy seconds then
        self.by_pid: dict[int, float] = {}  # joules attributed to each process since it was first seen
        self.idle_total = 0.0  # joules attributed to no process

    def update(self, energy_total: float | None, now: float, busy: Mapping[int, float]) -> None:
        """``energy_total``: the GPU's energy counter (joules, monotonic), None when it could not be
        read this tick; ``busy``: the busy seconds so far of each process on the GPU now."""
        by_pid, busy_at = self.by_pid, self._busy_at
        for pid in [pid for pid in by_pid if pid not in busy]:
            del by_pid[pid]
            busy_at.pop(pid, None)
        if energy_total is None:  # the next reading's interval covers this one too
            for pid in busy:
                by_pid.setdefault(pid, 0.0)
            return
        previous, elapsed = self._energy, now - self._at
        self._energy, self._at = energy_total, now
        spent: list[tuple[int, float]] = []  # (pid, its busy seconds in the interval)
        spent_total = 0.0
        for pid, seconds in busy.items():
            if pid not in by_pid:
                by_pid[pid] = 0.0
            busy_seconds = seconds - busy_at.get(pid, 0.0)
            busy_at[pid] = seconds
            if busy_seconds > 0.0:
                spent.append((pid, busy_seconds))
                spent_total += busy_seconds
        if previous is None:
            return  # the first reading: the interval starts here
        delta = energy_total - previous
        if not spent or elapsed <= 0.0:
            self.idle_total += delta
            return
        # Each process's share of the interval, scaled down where together they exceed it.
        scale = delta / max(elapsed, spent_total)
        attributed = 0.0
        largest, largest_part = spent[0][0], -1.0
        for pid, busy_seconds in spent:
            part = busy_seconds * scale
            by_pid[pid] += part
            attributed += part
            if part > largest_part:
                largest, largest_part = pid, part
        idle = delta - attributed
        if idle < 0.0:  # rounding, when the shares were scaled to add up to 1: a counter never goes back
            by_pid[largest] += idle
            idle = 0.0
        self.idle_total += idle
