"""The per-GPU hardware families: health (throttle time, row remapping, ECC, PCIe, memory temperature,
the health summary), NVLink, the video engines and GPM's floating-point pipes.

As everywhere in the exposition, a reading the GPU does not give is left out, never exported as 0;
the NVLink families exist only on GPUs with NVLink links.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuscope.exporters.families import GaugeMetricFamily, Metric, Sample, new_family
from gpuscope.snapshot import HEALTH_STATES, GpuReading

_GPU_LABELS = ("gpu", "uuid")

# (GpuReading attribute, family name without _total, counter?, unit, help): one series per GPU.
PLAIN_READINGS: tuple[tuple[str, str, bool, str, str], ...] = (
    ("fp16_active_ratio", "gpu_fp16_active_ratio", False, "ratio",
     "Fraction of time (0-1) the SMs' FP16 pipes (non-tensor) were active, averaged over all SMs."),
    ("fp32_active_ratio", "gpu_fp32_active_ratio", False, "ratio",
     "Fraction of time (0-1) the SMs' FP32 pipes (non-tensor) were active, averaged over all SMs."),
    ("fp64_active_ratio", "gpu_fp64_active_ratio", False, "ratio",
     "Fraction of time (0-1) the SMs' FP64 pipes (non-tensor) were active, averaged over all SMs."),
    ("encoder_utilization_ratio", "gpu_encoder_utilization_ratio", False, "ratio",
     "Fraction of time (0-1) the video encoder was busy over the driver's last sample period."),
    ("decoder_utilization_ratio", "gpu_decoder_utilization_ratio", False, "ratio",
     "Fraction of time (0-1) the video decoder was busy over the driver's last sample period."),
    ("memory_temperature_celsius", "gpu_memory_temperature_celsius", False, "celsius",
     "Device memory (HBM) temperature, in degrees Celsius."),
    ("ecc_corrected_errors_total", "gpu_ecc_corrected_errors", True, "",
     "Corrected (single-bit) ECC errors since the driver was last loaded (volatile count), in errors."),
    ("row_remap_pending", "gpu_row_remap_pending", False, "",
     "Whether a remapped memory row waits for a GPU reset to take effect (1) or not (0)."),
    ("row_remap_failed", "gpu_row_remap_failed", False, "",
     "Whether a memory row could not be remapped (1: the GPU needs replacing) or not (0)."),
    ("pcie_replays_total", "gpu_pcie_replays", True, "",
     "PCIe replays (packets sent again after a link-level error), in replays."),
    ("nvlink_active_links", "gpu_nvlink_active_links", False, "",
     "NVLink links of the GPU that are up, in links."),
    ("nvlink_transmit_bytes_total", "gpu_nvlink_transmit_bytes", True, "bytes",
     "Data transmitted over the GPU's NVLink links, summed over the links, in bytes."),
    ("nvlink_receive_bytes_total", "gpu_nvlink_receive_bytes", True, "bytes",
     "Data received over the GPU's NVLink links, summed over the links, in bytes."),
)
_HELP_THROTTLE = ("Time the GPU's clocks were held below their target since the driver was loaded, by "
                  "reason (NVML's violation counters), in seconds; rate() of it is the throttled share.")
_HELP_REMAPPED = "Memory rows remapped to spare rows, by the cause of the remap, in rows."
_HELP_PCIE_ERRORS = "PCIe link errors counted by the GPU, by type, in errors."
_HELP_NVLINK_ERRORS = "NVLink errors summed over the GPU's links, by type, in errors."
_HELP_LINK_TX = "Data transmitted over one NVLink link, in bytes (nvml.nvlink_per_link)."
_HELP_LINK_RX = "Data received over one NVLink link, in bytes (nvml.nvlink_per_link)."
_HELP_LINK_ERRORS = "NVLink errors of one link, by type, in errors (nvml.nvlink_per_link)."
_HELP_HEALTH = ("The GPU's health (1 for its state, 0 for the others): ok; reset_required, a remapped "
                "row waits for a GPU reset; replace, a row could not be remapped; lost, the GPU cannot "
                "be read.")


def hardware_families(gpus: Iterable[GpuReading]) -> list[Metric]:
    plain = [(attr, new_family(counter, name, help_text, _GPU_LABELS, unit))
             for attr, name, counter, unit, help_text in PLAIN_READINGS]
    link_labels = (*_GPU_LABELS, "link")
    throttle = new_family(True, "gpu_clock_throttle_seconds", _HELP_THROTTLE, (*_GPU_LABELS, "reason"),
                          "seconds")
    remapped = new_family(True, "gpu_remapped_rows", _HELP_REMAPPED, (*_GPU_LABELS, "cause"))
    pcie_errors = new_family(True, "gpu_pcie_errors", _HELP_PCIE_ERRORS, (*_GPU_LABELS, "type"))
    nvlink_errors = new_family(True, "gpu_nvlink_errors", _HELP_NVLINK_ERRORS, (*_GPU_LABELS, "type"))
    link_tx = new_family(True, "gpu_nvlink_link_transmit_bytes", _HELP_LINK_TX, link_labels, "bytes")
    link_rx = new_family(True, "gpu_nvlink_link_receive_bytes", _HELP_LINK_RX, link_labels, "bytes")
    link_errors = new_family(True, "gpu_nvlink_link_errors", _HELP_LINK_ERRORS, (*link_labels, "type"))
    health = GaugeMetricFamily("gpu_health", _HELP_HEALTH, labels=(*_GPU_LABELS, "state"))
    for gpu in gpus:
        labels = (str(gpu.index), gpu.uuid)
        state = gpu.health
        for candidate in HEALTH_STATES:
            health.add_metric((*labels, candidate), 1 if candidate == state else 0)
        if not gpu.up:
            continue
        gpu_labels = {"gpu": labels[0], "uuid": labels[1]}
        for attr, family in plain:
            value = getattr(gpu, attr)
            if value is not None:
                sample_name = family.name + ("_total" if family.type == "counter" else "")
                family.samples.append(Sample(sample_name, gpu_labels, float(value), None))
        for reason, seconds in (gpu.clock_throttle_seconds_total or {}).items():
            throttle.add_metric((*labels, reason), seconds)
        for cause, rows in (("correctable", gpu.remapped_rows_correctable_total),
                            ("uncorrectable", gpu.remapped_rows_uncorrectable_total)):
            if rows is not None:
                remapped.add_metric((*labels, cause), rows)
        for kind, count in (gpu.pcie_errors_total or {}).items():
            pcie_errors.add_metric((*labels, kind), count)
        for kind, count in (gpu.nvlink_errors_total or {}).items():
            nvlink_errors.add_metric((*labels, kind), count)
        for link, counters in sorted((gpu.nvlink_link_bytes or {}).items()):
            link_tx.add_metric((*labels, str(link)), counters["transmit_bytes"])
            link_rx.add_metric((*labels, str(link)), counters["receive_bytes"])
        for link, counts in sorted((gpu.nvlink_link_errors_total or {}).items()):
            for kind, count in counts.items():
                link_errors.add_metric((*labels, str(link), kind), count)
    return [*(family for _, family in plain), throttle, remapped, pcie_errors, nvlink_errors,
            link_tx, link_rx, link_errors, health]

