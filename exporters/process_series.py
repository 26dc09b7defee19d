"""The per-process series (gpu_process_*) under a label allow-list and a per-GPU cap.

Every series carries ``gpu``, ``uuid`` and ``gpu_instance`` (the MIG GPU instance the process runs in,
empty off MIG); the other labels are the ones ``processes.labels`` lists.
Without ``pid`` among them, the processes of one GPU that share every exported label make one series:
gauges are summed, ``gpu_process_info`` counts the processes, and the counters are summed and keep the
last total of a member that has exited for as long as the series lives, so the sum never falls (a
falling counter reads as a reset, and rate() would count the survivors' totals a second time). A series
none of whose processes is left disappears at the next scrape, as a process's own series does.

``processes.max_per_gpu`` bounds the processes exported per GPU: those using the most device memory are
kept, and each process left out is counted once in ``gpuscope_processes_dropped_total``. Alerts,
captures and ``gpu_processes`` still see every process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from gpuscope.common.process_labels import DEFAULT_MAX_PER_GPU, PROCESS_LABEL_CHOICES
from gpuscope.exporters.families import CounterMetricFamily, GaugeMetricFamily, Metric
from gpuscope.snapshot import GpuReading, PodContainer, ProcessReading

CMDLINE_MAX_CHARS = 256  # keeps label values (and series size) bounded for long argv lists
_NO_POD = ("", "", "")

_HELP_PROC_MEMORY = "Device memory used by the process on this GPU, in bytes."
_HELP_PROC_SM = ("Fraction of time (0-1) during which a kernel of the process was running on this GPU "
                 "over the last sampling interval.")
_HELP_PROC_BUSY = ("Time during which a kernel of the process was running on this GPU since the agent first "
                   "saw the process, in seconds: the driver's per-process samples, each times its sample "
                   "period.")
_HELP_PROC_ENERGY = ("The part of the GPU's energy attributed to the process since the agent first saw it, "
                     "in joules: each interval's energy times the share of the interval during which the "
                     "process's kernels ran; an estimate.")
_HELP_PROC_INFO = ("A process holding a context on the GPU (value 1; without the pid label, the number of "
                   "processes sharing these labels), with its type (compute or graphics) and host details.")
_HELP_DROPPED = ("GPU processes left out of the per-process series by processes.max_per_gpu since the agent "
                 "started, each counted once per GPU, in processes.")

# (family name, ProcessReading field, counter?, unit, help) for the families with one value per process.
_VALUED = (
    ("gpu_process_memory_used_bytes", "memory_used_bytes", False, "bytes", _HELP_PROC_MEMORY),
    ("gpu_process_sm_utilization_ratio", "sm_utilization_ratio", False, "ratio", _HELP_PROC_SM),
    ("gpu_process_busy_seconds", "busy_seconds_total", True, "seconds", _HELP_PROC_BUSY),
    ("gpu_process_energy_joules", "energy_joules_total", True, "joules", _HELP_PROC_ENERGY),
)

_SeriesKey = tuple[str, tuple[str, ...]]  # (family name, label values)


class ProcessSeries:
    """Builds the gpu_process_* families of one scrape; keeps what the counters' sums need between scrapes.

    Thread-safe: scrapes may run at once.
    """

    def __init__(self, *, labels: Sequence[str] = PROCESS_LABEL_CHOICES, include_cmdline: bool = False,
                 max_per_gpu: int = DEFAULT_MAX_PER_GPU) -> None:
        unknown = [name for name in labels if name not in PROCESS_LABEL_CHOICES]
        if unknown:
            raise ValueError(f"unknown per-process label(s) {unknown}; "
                             f"choose from {list(PROCESS_LABEL_CHOICES)}")
        self._labels = tuple(name for name in PROCESS_LABEL_CHOICES if name in labels)
        self._include_cmdline = include_cmdline
        self._max_per_gpu = max_per_gpu
        cmdline = ("cmdline",) if include_cmdline else ()
        self.labelnames: tuple[str, ...] = ("gpu", "uuid", "gpu_instance", *self._labels, *cmdline)
        # With pid among the labels a series has one process, and its series goes when it does: nothing
        # to carry. Without, processes share series and the counters' sums are kept from falling.
        self._summing = "pid" not in self._labels
        self._lock = threading.Lock()
        # Per counter series: the last total of each member seen, and the totals of members gone since.
        self._members: dict[_SeriesKey, dict[int, float]] = {}
        self._retired: dict[_SeriesKey, float] = {}
        self._dropped_now: set[tuple[str, int]] = set()  # (uuid, pid) left out by the cap at the last scrape
        self._dropped_total = 0

    def families(self, gpus: Iterable[GpuReading]) -> list[Metric]:
        """gpu_process_{memory_used_bytes,sm_utilization_ratio,busy_seconds_total,energy_joules_total,info}."""
        # Per family: label values -> {pid: value}; a pid listed twice (compute and graphics) counts once.
        values: dict[str, dict[tuple[str, ...], dict[int, float]]] = {name: {} for name, *_ in _VALUED}
        info: dict[tuple[str, ...], set[int]] = {}
        dropped: set[tuple[str, int]] = set()
        for gpu in gpus:
            if not gpu.up:
                continue
            pod = _process_pod_labels(gpu.pods)
            # On MIG, a process's pod is its instance's: the kubelet allocates MIG devices, not the GPU.
            instance_pods = {(m.gpu_instance, m.compute_instance): _process_pod_labels(m.pods)
                             for m in gpu.mig_devices}
            kept = self._kept(gpu.processes)
            if kept is not None:
                dropped.update((gpu.uuid, p.pid) for p in gpu.processes if p.pid not in kept)
            for process in gpu.processes:
                if kept is not None and process.pid not in kept:
                    continue
                process_pod = pod if process.gpu_instance is None else instance_pods.get(
                    (process.gpu_instance, process.compute_instance or 0), _NO_POD)
                labels = self._label_values(str(gpu.index), gpu.uuid, process, process_pod)
                info.setdefault((*labels, process.kind), set()).add(process.pid)
                for name, attribute, *_ in _VALUED:
                    value = getattr(process, attribute)
                    if value is not None:
                        values[name].setdefault(labels, {}).setdefault(process.pid, value)
        with self._lock:
            self._dropped_total += len(dropped - self._dropped_now)
            self._dropped_now = dropped
            families: list[Metric] = []
            for name, _, counter, unit, help_text in _VALUED:
                family_type = CounterMetricFamily if counter else GaugeMetricFamily
                family = family_type(name, help_text, labels=self.labelnames, unit=unit)
                carry = counter and self._summing
                for labels, members in values[name].items():
                    total = sum(members.values())
                    if carry:
                        total += self._carry_exited(name, labels, members)
                    family.add_metric(labels, total)
                families.append(family)
            if self._summing:
                self._forget_series_gone(values)
        info_family = GaugeMetricFamily("gpu_process_info", _HELP_PROC_INFO,
                                        labels=(*self.labelnames, "type"))
        for labels, pids in info.items():
            info_family.add_metric(labels, len(pids))
        families.append(info_family)
        return families

    def dropped_family(self) -> Metric:
        return CounterMetricFamily("gpuscope_processes_dropped", _HELP_DROPPED, value=self._dropped_total)

    def _kept(self, processes: Sequence[ProcessReading]) -> set[int] | None:
        """The pids to export; None for all of them (the common case, without building a set)."""
        if len(processes) <= self._max_per_gpu:
            return None
        pids = {p.pid for p in processes}
        if len(pids) <= self._max_per_gpu:
            return None
        memory: dict[int, int] = {}
        for p in processes:
            memory[p.pid] = max(memory.get(p.pid, 0), p.memory_used_bytes or 0)
        # The largest holders of device memory first; the lower pid on a tie, so the choice is stable.
        return set(sorted(memory, key=lambda pid: (-memory[pid], pid))[:self._max_per_gpu])

    def _carry_exited(self, name: str, labels: tuple[str, ...], members: dict[int, float]) -> float:
        """What the counter series (name, labels) keeps of members that are gone; records ``members``."""
        key = (name, labels)
        previous = self._members.get(key, {})
        retired = self._retired.get(key, 0.0) + sum(v for pid, v in previous.items() if pid not in members)
        self._members[key] = dict(members)
        if retired:
            self._retired[key] = retired
        return retired

    def _forget_series_gone(self, values: dict[str, dict[tuple[str, ...], dict[int, float]]]) -> None:
        for key in [key for key in self._members if key[1] not in values[key[0]]]:
            del self._members[key]
            self._retired.pop(key, None)

    def _label_values(self, gpu_label: str, uuid: str, process: ProcessReading,
                      pod: tuple[str, str, str]) -> tuple[str, ...]:
        visible = process.host_visible
        available = {
            "pid": str(process.pid),
            "process": (process.name or "") if visible else "",
            "user": (process.user or "") if visible else "",
            "container_id": (process.container_id or "") if visible else "",
            "pod": pod[0], "namespace": pod[1], "container": pod[2],
        }
        instance = "" if process.gpu_instance is None else str(process.gpu_instance)
        values = (gpu_label, uuid, instance, *(available[name] for name in self._labels))
        if self._include_cmdline:
            cmdline = process.cmdline if visible else None
            values = (*values, " ".join(cmdline)[:CMDLINE_MAX_CHARS] if cmdline else "")
        return values


def _process_pod_labels(pods: tuple[PodContainer, ...]) -> tuple[str, str, str]:
    """(pod, namespace, container) for the processes on a GPU held by ``pods``. For a GPU
    time-sliced between pods the kubelet cannot say which process is whose: no pod. Between
    containers of one pod: the pod, without a container."""
    if not pods:
        return _NO_POD
    first = pods[0]
    if any((p.namespace, p.pod) != (first.namespace, first.pod) for p in pods[1:]):
        return _NO_POD
    return (first.pod, first.namespace, first.container if len(pods) == 1 else "")
