"""Each Prometheus family's OTLP metric: its name, instrument, unit and attributes.

The OTLP side pushes what the Prometheus side renders (the same families, built from the same
snapshot with the same per-process label allow-list, cap and command-line default), renamed here:
a reading the OpenTelemetry hardware conventions name goes under its ``hw.*`` name and unit
(``hw.gpu.utilization``, ``hw.gpu.memory.usage``, ``hw.gpu.io``, ``hw.power``, ``hw.energy``,
``hw.errors``, ``hw.status``), every other under ``gpuscope.*``. Several families may make one
metric, told apart by an attribute the rule fixes (PCIe transmitted and received bytes are
``hw.gpu.io`` with ``network.io.direction``). A family listed in NOT_PUSHED is the agent's own state,
left to ``/metrics``. tests/test_otlp_mapping.py checks that every family has exactly one of the two,
and docs/metrics.md ("OpenTelemetry (OTLP)") lists them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Instrument = Literal["gauge", "counter", "updowncounter"]
HW_ID = "hw.id"
HW_PARENT = "hw.parent"
DROP = ""  # a label whose value another attribute already carries

# How a GPU's label set becomes attributes: ``uuid`` is the component's hw.id; the index (``gpu``)
# is dropped, as hw.name carries it with the GPU's other descriptors (encode.gpu_descriptors).
_GPU = {"gpu": DROP, "uuid": HW_ID}
_MIG = {"gpu": DROP, "uuid": HW_PARENT, "mig_uuid": HW_ID, "gpu_instance": "gpuscope.mig.gpu_instance",
        "compute_instance": "gpuscope.mig.compute_instance", "mig_profile": "gpuscope.mig.profile"}
_POD = {"pod": "k8s.pod.name", "namespace": "k8s.namespace.name", "container": "k8s.container.name"}
# The per-process labels (processes.labels chooses among them) and their attributes.
_PROCESS = {**_GPU, "gpu_instance": "gpuscope.mig.gpu_instance", "pid": "process.pid",
            "process": "process.executable.name", "user": "process.owner", "container_id": "container.id",
            **_POD, "cmdline": "process.command_line"}
INT_ATTRIBUTES = frozenset({"process.pid"})  # the conventions type these as integers
# gpuscope's health states as hw.state's well-known values.
HEALTH_TO_HW_STATE = {"ok": "ok", "reset_required": "degraded", "replace": "predicted_failure",
                      "lost": "failed"}


@dataclass(frozen=True)
class OtlpRule:
    name: str
    instrument: Instrument
    unit: str  # UCUM, as the conventions write it
    labels: Mapping[str, str]  # Prometheus label -> attribute (DROP: left out)
    fixed: tuple[tuple[str, str], ...] = ()  # attributes every point of the family carries
    values: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # label -> value renames

    @property
    def per_gpu(self) -> bool:
        """The points describe a GPU (or a MIG device of one): they carry hw.type and its descriptors."""
        return self.labels.get("uuid") == HW_ID

    @property
    def cumulative(self) -> bool:
        """Sent as a cumulative Sum (with a start time) rather than a Gauge."""
        return self.instrument != "gauge"


def _gpu(metric: str, instrument: Instrument, unit: str, /, *fixed: tuple[str, str],
         **extra: str) -> OtlpRule:
    """A per-GPU family's rule; ``extra``: its other labels' attributes."""
    return OtlpRule(metric, instrument, unit, {**_GPU, **extra}, tuple(fixed))


def _mig(metric: str, instrument: Instrument, unit: str, /, **extra: str) -> OtlpRule:
    return OtlpRule(metric, instrument, unit, {**_MIG, **extra})


_TX = ("network.io.direction", "transmit")
_RX = ("network.io.direction", "receive")

# Prometheus family (as exposed, counters with _total) -> its OTLP metric.
RULES: dict[str, OtlpRule] = {
    # -- GPU ---------------------------------------------------------------------------------------------
    "gpu_info": _gpu("gpuscope.gpu.info", "gauge", "1", name=DROP, driver_version=DROP,
                     pci_bus_id="gpuscope.gpu.pci_bus_id"),
    "gpu_up": _gpu("gpuscope.gpu.up", "gauge", "1"),
    "gpu_utilization_ratio": _gpu("hw.gpu.utilization", "gauge", "1", ("hw.gpu.task", "general")),
    "gpu_encoder_utilization_ratio": _gpu("hw.gpu.utilization", "gauge", "1", ("hw.gpu.task", "encoder")),
    "gpu_decoder_utilization_ratio": _gpu("hw.gpu.utilization", "gauge", "1", ("hw.gpu.task", "decoder")),
    "gpu_busy_seconds_total": _gpu("gpuscope.gpu.busy_time", "counter", "s"),
    # NVML's memory "utilization" is the time the memory interface was busy; the conventions'
    # hw.gpu.memory.utilization is the fraction of memory used (encode.py derives it).
    "gpu_memory_utilization_ratio": _gpu("gpuscope.gpu.memory.controller.utilization", "gauge", "1"),
    "gpu_memory_used_bytes": _gpu("hw.gpu.memory.usage", "updowncounter", "By"),
    "gpu_memory_reserved_bytes": _gpu("gpuscope.gpu.memory.reserved", "updowncounter", "By"),
    "gpu_memory_total_bytes": _gpu("hw.gpu.memory.limit", "updowncounter", "By"),
    "gpu_power_watts": _gpu("hw.power", "gauge", "W"),
    "gpu_power_limit_watts": _gpu("gpuscope.gpu.power.limit", "gauge", "W"),
    "gpu_energy_joules_total": _gpu("hw.energy", "counter", "J"),
    "gpu_idle_energy_joules_total": _gpu("gpuscope.gpu.idle_energy", "counter", "J"),
    "gpu_temperature_celsius": _gpu("gpuscope.gpu.temperature", "gauge", "Cel"),
    "gpu_sm_clock_hertz": _gpu("gpuscope.gpu.sm.clock", "gauge", "Hz"),
    "gpu_memory_clock_hertz": _gpu("gpuscope.gpu.memory.clock", "gauge", "Hz"),
    "gpu_clock_event_active": _gpu("gpuscope.gpu.clock_event.active", "gauge", "1",
                                   reason="gpuscope.clock_event.reason"),
    "gpu_pcie_tx_bytes_total": _gpu("hw.gpu.io", "counter", "By", _TX),
    "gpu_pcie_rx_bytes_total": _gpu("hw.gpu.io", "counter", "By", _RX),
    "gpu_xid_errors_total": _gpu("gpuscope.gpu.xid_errors", "counter", "{event}", xid="gpuscope.xid"),
    "gpu_ecc_uncorrected_errors_total": _gpu("hw.errors", "counter", "{error}",
                                             ("error.type", "uncorrected")),
    "gpu_ecc_corrected_errors_total": _gpu("hw.errors", "counter", "{error}", ("error.type", "corrected")),
    "gpu_sm_active_ratio": _gpu("gpuscope.gpu.sm.active", "gauge", "1"),
    "gpu_sm_active_seconds_total": _gpu("gpuscope.gpu.sm.active_time", "counter", "s"),
    "gpu_sm_occupancy_ratio": _gpu("gpuscope.gpu.sm.occupancy", "gauge", "1"),
    "gpu_tensor_active_ratio": _gpu("gpuscope.gpu.tensor.active", "gauge", "1"),
    "gpu_tensor_active_seconds_total": _gpu("gpuscope.gpu.tensor.active_time", "counter", "s"),
    "gpu_dram_active_ratio": _gpu("gpuscope.gpu.dram.active", "gauge", "1"),
    "gpu_fp16_active_ratio": _gpu("gpuscope.gpu.pipe.active", "gauge", "1", ("gpuscope.gpu.pipe", "fp16")),
    "gpu_fp32_active_ratio": _gpu("gpuscope.gpu.pipe.active", "gauge", "1", ("gpuscope.gpu.pipe", "fp32")),
    "gpu_fp64_active_ratio": _gpu("gpuscope.gpu.pipe.active", "gauge", "1", ("gpuscope.gpu.pipe", "fp64")),
    "gpu_idle_dips_total": _gpu("gpuscope.gpu.idle_dips", "counter", "{dip}"),
    "gpu_processes": _gpu("gpuscope.gpu.processes", "gauge", "{process}"),
    "gpu_pod_info": _gpu("gpuscope.gpu.pod.info", "gauge", "1", **_POD),
    "gpu_slurm_job_info": _gpu("gpuscope.gpu.slurm_job.info", "gauge", "1", job_id="gpuscope.slurm.job.id",
                               step="gpuscope.slurm.job.step", user="gpuscope.slurm.job.user"),
    # -- hardware health ---------------------------------------------------------------------------------
    "gpu_health": OtlpRule("hw.status", "updowncounter", "1", {**_GPU, "state": "hw.state"},
                           values={"state": HEALTH_TO_HW_STATE}),
    "gpu_clock_throttle_seconds_total": _gpu("gpuscope.gpu.throttle_time", "counter", "s",
                                             reason="gpuscope.throttle.reason"),
    "gpu_remapped_rows_total": _gpu("gpuscope.gpu.memory.remapped_rows", "counter", "{row}",
                                    cause="gpuscope.remap.cause"),
    "gpu_row_remap_pending": _gpu("gpuscope.gpu.memory.row_remap.pending", "gauge", "1"),
    "gpu_row_remap_failed": _gpu("gpuscope.gpu.memory.row_remap.failed", "gauge", "1"),
    "gpu_pcie_replays_total": _gpu("gpuscope.gpu.pcie.replays", "counter", "{replay}"),
    "gpu_pcie_errors_total": _gpu("gpuscope.gpu.pcie.errors", "counter", "{error}", type="error.type"),
    "gpu_memory_temperature_celsius": _gpu("gpuscope.gpu.memory.temperature", "gauge", "Cel"),
    # -- NVLink ------------------------------------------------------------------------------------------
    "gpu_nvlink_active_links": _gpu("gpuscope.gpu.nvlink.active_links", "gauge", "{link}"),
    "gpu_nvlink_transmit_bytes_total": _gpu("gpuscope.gpu.nvlink.io", "counter", "By", _TX),
    "gpu_nvlink_receive_bytes_total": _gpu("gpuscope.gpu.nvlink.io", "counter", "By", _RX),
    "gpu_nvlink_errors_total": _gpu("gpuscope.gpu.nvlink.errors", "counter", "{error}", type="error.type"),
    "gpu_nvlink_link_transmit_bytes_total": _gpu("gpuscope.gpu.nvlink.link.io", "counter", "By", _TX,
                                                 link="gpuscope.nvlink.link"),
    "gpu_nvlink_link_receive_bytes_total": _gpu("gpuscope.gpu.nvlink.link.io", "counter", "By", _RX,
                                                link="gpuscope.nvlink.link"),
    "gpu_nvlink_link_errors_total": _gpu("gpuscope.gpu.nvlink.link.errors", "counter", "{error}",
                                         link="gpuscope.nvlink.link", type="error.type"),
    # -- MIG: the MIG device is the component (hw.id), its GPU the parent ---------------------------------
    "gpu_mig_info": _mig("gpuscope.mig.info", "gauge", "1"),
    "gpu_mig_memory_used_bytes": _mig("gpuscope.mig.memory.usage", "updowncounter", "By"),
    "gpu_mig_memory_total_bytes": _mig("gpuscope.mig.memory.limit", "updowncounter", "By"),
    "gpu_mig_sm_active_ratio": _mig("gpuscope.mig.sm.active", "gauge", "1"),
    "gpu_mig_tensor_active_ratio": _mig("gpuscope.mig.tensor.active", "gauge", "1"),
    "gpu_mig_dram_active_ratio": _mig("gpuscope.mig.dram.active", "gauge", "1"),
    "gpu_mig_busy_seconds_total": _mig("gpuscope.mig.busy_time", "counter", "s"),
    "gpu_mig_pod_info": _mig("gpuscope.mig.pod.info", "gauge", "1", **_POD),
    # -- processes: the same allow-list and cap as the Prometheus side (process_series.py) ----------------
    "gpu_process_memory_used_bytes": OtlpRule("gpuscope.process.memory.usage", "updowncounter", "By",
                                              _PROCESS),
    "gpu_process_sm_utilization_ratio": OtlpRule("gpuscope.process.sm.utilization", "gauge", "1", _PROCESS),
    "gpu_process_busy_seconds_total": OtlpRule("gpuscope.process.busy_time", "counter", "s", _PROCESS),
    "gpu_process_energy_joules_total": OtlpRule("gpuscope.process.energy", "counter", "J", _PROCESS),
    "gpu_process_info": OtlpRule("gpuscope.process.info", "gauge", "{process}",
                                 {**_PROCESS, "type": "gpuscope.process.type"}),
    "gpuscope_processes_dropped_total": OtlpRule("gpuscope.processes.dropped", "counter", "{process}", {}),
    # -- the sampler -------------------------------------------------------------------------------------
    "gpuscope_nvml_up": OtlpRule("gpuscope.nvml.up", "gauge", "1", {}),
    "gpuscope_gpus": OtlpRule("gpuscope.gpus", "gauge", "{gpu}", {}),
    "gpuscope_sample_duration_seconds": OtlpRule("gpuscope.sample.duration", "gauge", "s", {}),
    "gpuscope_sample_errors_total": OtlpRule("gpuscope.sample.errors", "counter", "{error}",
                                             {"reading": "gpuscope.reading"}),
    "gpuscope_nvml_stuck_calls_total": OtlpRule("gpuscope.nvml.stuck_calls", "counter", "{call}", {}),
    # -- sources and alerts ------------------------------------------------------------------------------
    "gpuscope_collector_success": OtlpRule("gpuscope.source.success", "gauge", "1",
                                           {"collector": "gpuscope.source"}),
    "gpuscope_collector_duration_seconds": OtlpRule("gpuscope.source.duration", "gauge", "s",
                                                    {"collector": "gpuscope.source"}),
    "gpuscope_alert_firing": OtlpRule("gpuscope.alert.firing", "gauge", "1", {
        "alertname": "gpuscope.alert.name", "gpu": DROP, "uuid": HW_ID,
        "severity": "gpuscope.alert.severity"}),
    "gpuscope_alert_transitions_total": OtlpRule("gpuscope.alert.transitions", "counter", "{transition}", {
        "alertname": "gpuscope.alert.name", "state": "gpuscope.alert.state"}),
}

# Readings the encoder derives from the snapshot, with no family of their own: (metric, instrument,
# unit, what it is). Listed for the documentation.
DERIVED: tuple[tuple[str, Instrument, str, str], ...] = (
    ("hw.gpu.memory.utilization", "gauge", "1",
     "gpu_memory_used_bytes / gpu_memory_total_bytes (the fraction of the GPU's memory in use)"),
)

# Families the agent serves on /metrics only, and why.
NOT_PUSHED: dict[str, str] = {
    "gpuscope_build_info": "the resource's service.version",
    "gpuscope_last_sample_timestamp_seconds": "every point's time is its sample's",
}
