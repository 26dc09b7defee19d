"""Prometheus exposition of the latest Snapshot, as a custom ``prometheus_client`` collector.

Every scrape builds fresh metric families from whatever snapshot the source returns, so a process
or GPU that is gone from the snapshot is gone from the output: there is no labelled state to prune.
A reading that is None in the snapshot is left out, never exported as 0. The catalogue of names,
types, units and labels is docs/metrics.md; tests/test_exporter.py keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from gpuscope.common.process_labels import DEFAULT_MAX_PER_GPU, PROCESS_LABEL_CHOICES
from gpuscope.exporters.families import Collector, CounterMetricFamily, GaugeMetricFamily, Metric, Sample
from gpuscope.exporters.hardware import hardware_families
from gpuscope.exporters.mig import mig_families
from gpuscope.exporters.process_series import ProcessSeries
from gpuscope.nvml.clock_events import CLOCK_EVENT_REASONS
from gpuscope.snapshot import PodContainer, ProcessReading, SlurmJob, Snapshot, SnapshotSource
from gpuscope.version import __version__

GPU_LABELS = ("gpu", "uuid")
POD_LABELS = ("pod", "namespace", "container")
SLURM_LABELS = ("job_id", "step", "user")


class _Reading(NamedTuple):
    """One plain per-GPU reading: a GpuReading attribute exported as one series per GPU."""

    attr: str
    name: str  # for counters, without the ``_total`` suffix (prometheus_client appends it)
    counter: bool
    unit: str
    help: str


# The per-GPU readings that map one attribute to one series, in export order.
_GPU_EARLY_READINGS: tuple[_Reading, ...] = (
    _Reading("utilization_ratio", "gpu_utilization_ratio", False, "ratio",
             "Fraction of time (0-1) during which at least one kernel was running on the GPU, "
             "the mean of the driver's utilization samples since they were last read (every "
             "nvml.samples_interval), else the driver's current rate."),
    _Reading("busy_seconds_total", "gpu_busy_seconds", True, "seconds",
             "Time during which at least one kernel was running on the GPU since the agent started, in "
             "seconds: the driver's utilization samples, each times its sample period. rate() of it is "
             "the busy fraction over any window."),
    _Reading("memory_utilization_ratio", "gpu_memory_utilization_ratio", False, "ratio",
             "Fraction of time (0-1) during which device memory was being read or written "
             "over the driver's last sample period."),
    _Reading("memory_used_bytes", "gpu_memory_used_bytes", False, "bytes",
             "Device memory allocated by contexts, in bytes (memory reserved by the driver excluded)."),
    _Reading("memory_reserved_bytes", "gpu_memory_reserved_bytes", False, "bytes",
             "Device memory reserved by the driver and firmware, in bytes."),
    _Reading("memory_total_bytes", "gpu_memory_total_bytes", False, "bytes",
             "Total device memory, in bytes."),
    _Reading("power_watts", "gpu_power_watts", False, "watts",
             "Power draw of the GPU board, in watts."),
    _Reading("power_limit_watts", "gpu_power_limit_watts", False, "watts",
             "Power limit enforced by the driver, in watts."),
    _Reading("energy_joules_total", "gpu_energy_joules", True, "joules",
             "Energy consumed by the GPU, in joules (monotonic across driver counter resets)."),
    _Reading("idle_energy_joules_total", "gpu_idle_energy_joules", True, "joules",
             "Energy of the GPU since the agent started that is attributed to no process (idle time, and "
             "busy time no process's samples account for), in joules; an estimate."),
    _Reading("temperature_celsius", "gpu_temperature_celsius", False, "celsius",
             "GPU core temperature, in degrees Celsius."),
    _Reading("sm_clock_hertz", "gpu_sm_clock_hertz", False, "hertz",
             "Current streaming multiprocessor (SM) clock, in hertz."),
    _Reading("memory_clock_hertz", "gpu_memory_clock_hertz", False, "hertz",
             "Current memory clock, in hertz."),
)
# ... gpu_clock_event_active comes here in the export order ...
_GPU_PCIE_READINGS: tuple[_Reading, ...] = (
    _Reading("pcie_tx_bytes_total", "gpu_pcie_tx_bytes", True, "bytes",
             "Data transmitted by the GPU over PCIe, in bytes."),
    _Reading("pcie_rx_bytes_total", "gpu_pcie_rx_bytes", True, "bytes",
             "Data received by the GPU over PCIe, in bytes."),
)
# ... gpu_xid_errors_total comes here in the export order ...
_GPU_LATE_READINGS: tuple[_Reading, ...] = (
    _Reading("ecc_uncorrected_errors_total", "gpu_ecc_uncorrected_errors", True, "",
             "Uncorrected ECC errors since the driver was last loaded (volatile count), in errors."),
    _Reading("sm_active_ratio", "gpu_sm_active_ratio", False, "ratio",
             "Fraction of time (0-1) at least one warp was resident on an SM, averaged over all SMs."),
    _Reading("sm_active_seconds_total", "gpu_sm_active_seconds", True, "seconds",
             "Time during which at least one warp was resident on an SM, averaged over all SMs, since the "
             "agent started, in seconds (GPM's SM activity times the interval it covers)."),
    _Reading("sm_occupancy_ratio", "gpu_sm_occupancy_ratio", False, "ratio",
             "Resident warps as a fraction (0-1) of the maximum an SM can hold, averaged over all SMs."),
    _Reading("tensor_active_ratio", "gpu_tensor_active_ratio", False, "ratio",
             "Fraction of time (0-1) the tensor cores were active, averaged over all SMs."),
    _Reading("tensor_active_seconds_total", "gpu_tensor_active_seconds", True, "seconds",
             "Time during which the tensor cores were active, averaged over all SMs, since the agent "
             "started, in seconds (GPM's tensor activity times the interval it covers)."),
    _Reading("dram_active_ratio", "gpu_dram_active_ratio", False, "ratio",
             "Fraction of time (0-1) the device memory interface was busy sending or receiving data."),
    _Reading("idle_dips_total", "gpu_idle_dips", True, "",
             "Runs of driver utilization samples below the idle-dip threshold between busier samples, "
             "in dips since the agent started."),
)

_HELP_GPU_INFO = ("Facts about the GPU (value always 1): model name, PCI bus id and driver version.")
_HELP_GPU_UP = "Whether the GPU could be read in the last sampling tick (1) or not (0)."
_HELP_CLOCK_EVENT = ("Whether a clock event (throttle) reason is active (1) or not (0), "
                     "one series per reason the agent knows.")
_HELP_XID = "Xid error events reported by the driver since the agent started, by Xid code, in events."
_HELP_POD_INFO = ("A pod container the kubelet allocated the GPU to (value always 1); join on gpu and "
                  "uuid to attribute any GPU series to pods. Several per GPU when it is time-sliced.")
_HELP_SLURM_JOB_INFO = ("A Slurm job step with a process on the GPU (value always 1), from the process's "
                        "cgroup; join on gpu and uuid to attribute any GPU series to jobs.")
_HELP_PROCESSES = "Number of compute processes holding a context on the GPU."
_HELP_BUILD_INFO = "Build facts about the gpuscope agent (value always 1)."
_HELP_NVML_UP = "Whether the NVML library is initialised and answering (1) or not (0)."
_HELP_GPUS = "Number of GPUs discovered by NVML."
_HELP_SAMPLE_DURATION = "Time the last sampling tick took, in seconds."
_HELP_LAST_SAMPLE = "Unix time at which the last sampling tick finished, in seconds."
_HELP_SAMPLE_ERRORS = "Failed readings since the agent started, by reading, in failures."
_HELP_STUCK_CALLS = ("NVML calls that did not return within watchdog.stuck_after since the agent started, "
                     "in calls; a GPU read's GPU was reported down meanwhile, an Xid check's Xid counts "
                     "stood still.")

_Family = GaugeMetricFamily | CounterMetricFamily
_CLOCK_EVENT_NAMES: tuple[str, ...] = tuple(CLOCK_EVENT_REASONS.values())


class SnapshotCollector(Collector):
    """Renders the latest Snapshot of ``source`` as Prometheus metric families on every collect.

    The families are a function of the latest snapshot and of whether it is stale, nothing else that
    changes: ``/metrics`` collects them once per sampling tick and serves that tick's render to every
    scraper (web/tick_exposition.py). ``describe`` and ``collect`` must keep it so.

    Before the first sampling tick (no snapshot yet) only the build info and ``gpuscope_nvml_up 0``
    are exported. While the snapshot is stale (the sampler stuck as a whole) only the agent's own
    ``gpuscope_*`` families are: frozen ``gpu_*`` values would look current, absent ones let Prometheus
    mark the series stale. The per-process series are process_series.py's: ``process_labels`` is the
    allow-list of their labels, ``max_per_gpu`` their cap per GPU; ``include_cmdline`` adds a ``cmdline``
    label (off by default: command lines can hold secrets and are high-cardinality);
    ``include_processes`` False leaves them out altogether (``processes.export``).
    """

    def __init__(self, source: SnapshotSource, *, include_cmdline: bool = False,
                 include_processes: bool = True, process_labels: Sequence[str] = PROCESS_LABEL_CHOICES,
                 max_per_gpu: int = DEFAULT_MAX_PER_GPU) -> None:
        self._source = source
        self._include_processes = include_processes
        self._processes = ProcessSeries(labels=process_labels, include_cmdline=include_cmdline,
                                        max_per_gpu=max_per_gpu)

    def describe(self) -> Iterable[Metric]:
        # Empty on purpose: registering must not trigger a collect (the sampler may not run yet).
        return []

    def collect(self) -> Iterable[Metric]:
        snapshot = self._source.latest()
        families: list[Metric] = [
            _gauge("gpuscope_build_info", _HELP_BUILD_INFO, ("version",), [((__version__,), 1)])
        ]
        if snapshot is None:
            families.append(_gauge("gpuscope_nvml_up", _HELP_NVML_UP, (), [((), 0)]))
            return families
        families.extend(_agent_families(snapshot))
        if not self._source.snapshot_is_stale():
            families.extend(_gpu_families(snapshot))
            if self._include_processes:
                families.extend(self._processes.families(snapshot.gpus))
        if self._include_processes:
            families.append(self._processes.dropped_family())
        return [family for family in families if family.samples]


def _slurm_job_label_values(processes: Iterable[ProcessReading]) -> list[tuple[str, str, str]]:
    """(job_id, step, user) once per job step among ``processes``, in the order first seen.

    Many ranks of one step on a GPU make one series, not one each: the job is what is joined on.
    The user is the first process's (a step runs as one user); its uid where no name was read.
    """
    seen: dict[tuple[str, str], str] = {}
    for process in processes:
        job = process.slurm_job
        if job is None or not process.host_visible or (job.job_id, job.step) in seen:
            continue
        seen[(job.job_id, job.step)] = _slurm_user(process, job)
    return [(job_id, step, user) for (job_id, step), user in seen.items()]


def _slurm_user(process: ProcessReading, job: SlurmJob) -> str:
    if process.user:
        return process.user
    return "" if job.uid is None else str(job.uid)


def _pod_label_values(pod: PodContainer) -> tuple[str, str, str]:
    return (pod.pod, pod.namespace, pod.container)


def _gauge(name: str, help_text: str, labelnames: tuple[str, ...],
           samples: Iterable[tuple[tuple[str, ...], float]], unit: str = "") -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labelnames, unit=unit)
    for labels, value in samples:
        family.add_metric(labels, value)
    return family


def _agent_families(snapshot: Snapshot) -> list[Metric]:
    errors = CounterMetricFamily("gpuscope_sample_errors", _HELP_SAMPLE_ERRORS, labels=("reading",))
    for reading in sorted(snapshot.sample_errors):
        errors.add_metric((reading,), snapshot.sample_errors[reading])
    return [
        _gauge("gpuscope_nvml_up", _HELP_NVML_UP, (), [((), 1 if snapshot.nvml_up else 0)]),
        _gauge("gpuscope_gpus", _HELP_GPUS, (), [((), len(snapshot.gpus))]),
        _gauge("gpuscope_sample_duration_seconds", _HELP_SAMPLE_DURATION, (),
               [((), snapshot.sample_duration_seconds)], unit="seconds"),
        _gauge("gpuscope_last_sample_timestamp_seconds", _HELP_LAST_SAMPLE, (),
               [((), snapshot.timestamp)], unit="seconds"),
        errors,
        CounterMetricFamily("gpuscope_nvml_stuck_calls", _HELP_STUCK_CALLS,
                            value=snapshot.nvml_stuck_calls_total),
    ]


def _gpu_families(snapshot: Snapshot) -> list[Metric]:
    driver_version = snapshot.driver_version or ""
    info = GaugeMetricFamily("gpu_info", _HELP_GPU_INFO,
                             labels=(*GPU_LABELS, "name", "pci_bus_id", "driver_version"))
    up = GaugeMetricFamily("gpu_up", _HELP_GPU_UP, labels=GPU_LABELS)
    early, pcie, late = (_reading_families(specs) for specs in
                         (_GPU_EARLY_READINGS, _GPU_PCIE_READINGS, _GPU_LATE_READINGS))
    readings = early + pcie + late
    clock_events = GaugeMetricFamily("gpu_clock_event_active", _HELP_CLOCK_EVENT,
                                     labels=(*GPU_LABELS, "reason"))
    xid = CounterMetricFamily("gpu_xid_errors", _HELP_XID, labels=(*GPU_LABELS, "xid"))
    processes = GaugeMetricFamily("gpu_processes", _HELP_PROCESSES, labels=GPU_LABELS)
    pod_info = GaugeMetricFamily("gpu_pod_info", _HELP_POD_INFO, labels=(*GPU_LABELS, *POD_LABELS))
    slurm_info = GaugeMetricFamily("gpu_slurm_job_info", _HELP_SLURM_JOB_INFO,
                                   labels=(*GPU_LABELS, *SLURM_LABELS))

    # (attribute, the family's samples.append, its sample's name) per reading: a GPU's readings share
    # one labels dict and skip add_metric's, the bulk of a scrape's collection (nothing changes a
    # sample's labels once collected).
    appenders = [(attr, family.samples.append, family.name + ("_total" if family.type == "counter" else ""))
                 for attr, family in readings]
    for gpu in snapshot.gpus:
        labels = (str(gpu.index), gpu.uuid)
        gpu_labels = {"gpu": labels[0], "uuid": labels[1]}
        info.add_metric((*labels, gpu.name, gpu.pci_bus_id, driver_version), 1)
        up.samples.append(Sample("gpu_up", gpu_labels, 1 if gpu.up else 0, None))
        for pod in gpu.pods:  # allocations hold while a GPU is unreadable: still exported
            pod_info.add_metric((*labels, *_pod_label_values(pod)), 1)
        # Counters must not vanish while the GPU is known, even when it cannot be read right now.
        for code in sorted(gpu.xid_errors):
            xid.add_metric((*labels, str(code)), gpu.xid_errors[code])
        if not gpu.up:
            continue
        for attr, append, sample_name in appenders:
            value = getattr(gpu, attr)
            if value is not None:
                append(Sample(sample_name, gpu_labels, value, None))
        reasons = gpu.clock_event_reasons
        if reasons is not None:
            for reason in _CLOCK_EVENT_NAMES:
                clock_events.samples.append(Sample("gpu_clock_event_active", {**gpu_labels, "reason": reason},
                                                   1 if reason in reasons else 0, None))
        processes.samples.append(Sample("gpu_processes", gpu_labels,
                                        sum(1 for p in gpu.processes if p.kind == "compute"), None))
        for job_labels in _slurm_job_label_values(gpu.processes):
            slurm_info.add_metric((*labels, *job_labels), 1)

    return [
        info, up,
        *(family for _, family in early), clock_events,
        *(family for _, family in pcie), xid,
        *(family for _, family in late), processes, pod_info, slurm_info,
        *hardware_families(snapshot.gpus), *mig_families(snapshot.gpus),
    ]


def _reading_families(specs: Iterable[_Reading]) -> list[tuple[str, _Family]]:
    return [
        (spec.attr, (CounterMetricFamily if spec.counter else GaugeMetricFamily)(
            spec.name, spec.help, labels=GPU_LABELS, unit=spec.unit))
        for spec in specs
    ]
