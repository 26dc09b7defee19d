"""The agent's own CPU, memory and file descriptors (``process_*``), read from /proc, so that its
overhead can be watched where it runs.

The series are the ones every Prometheus client library exports under these names (with
prometheus_client's help texts): the CPU counter, virtual and resident memory, the start time and
the open and maximum file descriptors. Without /proc (not Linux) there are none.
"""

from __future__ import annotations

import os
import resource

from gpuscope.exporters.families import CounterMetricFamily, GaugeMetricFamily, Metric


class ProcessCollector:
    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._self = os.path.join(proc, "self")
        self._pagesize = resource.getpagesize()
        try:
            self._ticks = float(os.sysconf("SC_CLK_TCK"))
        except (ValueError, OSError):
            self._ticks = 100.0
        self._boot_time = self._read_boot_time()

    def _read_boot_time(self) -> float:
        try:
            with open(os.path.join(self._proc, "stat"), "rb") as stat:
                for line in stat:
                    if line.startswith(b"btime "):
                        return float(line.split()[1])
        except OSError:
            pass
        return 0.0

    def collect(self) -> list[Metric]:
        if not self._boot_time:
            return []
        families: list[Metric] = []
        try:
            with open(os.path.join(self._self, "stat"), "rb") as stat:
                # After the command name in parentheses, which may hold spaces and parentheses itself.
                parts = stat.read().rsplit(b")", 1)[-1].split()
            families += [
                GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                                  value=float(parts[20])),
                GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                                  value=float(parts[21]) * self._pagesize),
                GaugeMetricFamily("process_start_time_seconds",
                                  "Start time of the process since unix epoch in seconds.",
                                  value=float(parts[19]) / self._ticks + self._boot_time),
                CounterMetricFamily("process_cpu_seconds_total",
                                    "Total user and system CPU time spent in seconds.",
                                    value=(float(parts[11]) + float(parts[12])) / self._ticks),
            ]
        except (OSError, IndexError, ValueError):
            pass
        try:
            max_fds = None
            with open(os.path.join(self._self, "limits"), "rb") as limits:
                for line in limits:
                    if line.startswith(b"Max open file"):
                        max_fds = float(line.split()[3])
                        break
            open_fds = len(os.listdir(os.path.join(self._self, "fd")))
            families.append(GaugeMetricFamily("process_open_fds", "Number of open file descriptors.",
                                              value=open_fds))
            if max_fds is not None:
                families.append(GaugeMetricFamily("process_max_fds",
                                                  "Maximum number of open file descriptors.", value=max_fds))
        except (OSError, IndexError, ValueError):
            pass
        return families
