"""What the NVML boundary reads from one GPU in one tick, in base units: plain values, free of pynvml.

A reading is None when this GPU does not provide it or when it failed this tick. Fields that
``GpuReading`` (the Snapshot) has by the same name are passed into it unchanged by the sampler;
the others (samples, counters, processes) are what the sampler derives its own values from. So
adding a plain reading touches this class, the NVML call that fills it, the Snapshot, the
collector and the metrics catalogue, and not the sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

ProcessKind = Literal["compute", "graphics"]


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    mig_enabled: bool


@dataclass(frozen=True, slots=True)
class RawProcess:
    """A process with a context on the GPU, as NVML lists it (a host pid)."""

    pid: int
    kind: ProcessKind
    memory_used_bytes: int | None
    # The MIG instance the process runs in (NVML's GPU and compute instance ids); None off MIG.
    gpu_instance: int | None = None
    compute_instance: int | None = None


@dataclass(frozen=True, slots=True)
class PcieReading:
    """Either cumulative byte counters (exact) or instantaneous rates (to be integrated by the caller)."""

    cumulative: bool
    tx: float  # bytes (cumulative) or bytes/s (rate)
    rx: float


@dataclass(frozen=True, slots=True)
class MigIdentity:
    """A MIG device of a GPU in MIG mode: one compute instance of one GPU instance."""

    index: int  # NVML's MIG device index on its parent
    gpu_instance: int
    compute_instance: int
    uuid: str  # "MIG-…"
    profile: str  # "1g.10gb": the name's part after "MIG "


@dataclass(frozen=True, slots=True)
class MigDeviceReadings:
    """One tick's readings of one MIG device, in base units; None where NVML gives nothing."""

    identity: MigIdentity
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    # GPM per GPU instance (Hopper and newer), ratios 0-1 over gpm_interval_seconds; None on the first
    # tick and where GPM is not supported. Compute instances of one GPU instance share its figures.
    gpm_interval_seconds: float | None = None
    graphics_active_ratio: float | None = None
    sm_active_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None


@dataclass(slots=True)
class DeviceReadings:
    """One tick's readings of one GPU, in base units."""

    # The driver's utilization samples newer than the last tick: (driver µs, ratio 0-1). None when
    # this GPU keeps no such buffer (not supported, MIG); () when it has nothing new (an idle GPU).
    new_utilization_samples: tuple[tuple[int, float], ...] | None = ()
    # True for the first samples this agent read from the GPU: the driver's whole buffer, which holds
    # up to some 20 s from before the agent started (and that a previous agent may have counted).
    utilization_samples_from_history: bool = False
    rate_utilization_ratio: float | None = None  # the instantaneous rate, used when no samples are new
    energy_counter_joules: float | None = None  # the driver's counter: resets when the driver reloads
    clock_event_mask: int | None = None
    pcie: PcieReading | None = None
    nvml_processes: list[RawProcess] = field(default_factory=list)
    # The driver's per-process SM utilization samples newer than the last tick: pid -> ((driver µs,
    # ratio 0-1), ...) in time order. A process missing from it ran no kernels in that time. None when
    # this GPU does not report them (not supported, MIG) or the call failed.
    new_process_samples: dict[int, tuple[tuple[int, float], ...]] | None = None
    process_samples_from_history: bool = False  # as utilization_samples_from_history
    # Plain readings: the Snapshot's fields of the same names. power_limit_watts, memory_clock_hertz,
    # ecc_uncorrected_errors_total and the video engines' ratios are read with the health readings
    # (the video engines also every tick while in use, see health.read_video) and repeated between.
    memory_utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    ecc_uncorrected_errors_total: int | None = None
    # The time between the two GPM samples the GPM ratios below cover, in seconds: consecutive readings
    # cover consecutive intervals. None when no GPM sample was taken this tick (nvml.gpm_interval: the
    # ratios are then those of the last sample, repeated) or it gave no ratios.
    gpm_interval_seconds: float | None = None
    # GPM (Hopper and newer; None elsewhere, on MIG, and until two samples were taken): ratios 0-1.
    sm_active_ratio: float | None = None
    sm_occupancy_ratio: float | None = None
    tensor_active_ratio: float | None = None
    dram_active_ratio: float | None = None
    fp16_active_ratio: float | None = None
    fp32_active_ratio: float | None = None
    fp64_active_ratio: float | None = None
    # Video engines over the driver's last sample period, ratios 0-1.
    encoder_utilization_ratio: float | None = None
    decoder_utilization_ratio: float | None = None
    # NVLink data counters summed over the links, bytes (the driver's counters; None without NVLink).
    nvlink_transmit_bytes_total: float | None = None
    nvlink_receive_bytes_total: float | None = None
    # Per link, only with nvml.nvlink_per_link: link -> {"transmit_bytes": .., "receive_bytes": ..}.
    nvlink_link_bytes: Mapping[int, Mapping[str, float]] | None = None
    # The health readings below are read every nvml.health_interval (the throttle counters every
    # nvml.throttle_interval); between reads each tick repeats the last values read.
    # Seconds the clocks were held below their target, by reason (NVML's violation counters).
    clock_throttle_seconds_total: Mapping[str, float] | None = None
    remapped_rows_correctable_total: int | None = None
    remapped_rows_uncorrectable_total: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failed: bool | None = None
    ecc_corrected_errors_total: int | None = None
    pcie_replays_total: int | None = None
    pcie_errors_total: Mapping[str, int] | None = None  # by error type
    memory_temperature_celsius: float | None = None
    nvlink_active_links: int | None = None
    nvlink_errors_total: Mapping[str, int] | None = None  # by error type, summed over the links
    # Per link, only with nvml.nvlink_per_link: link -> error type -> count.
    nvlink_link_errors_total: Mapping[int, Mapping[str, int]] | None = None
    # The GPU's MIG devices (MIG mode only); () off MIG.
    mig_readings: tuple[MigDeviceReadings, ...] = ()
