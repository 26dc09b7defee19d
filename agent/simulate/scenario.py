"""The scenario schema: what a simulated node's GPUs do over time (format: docs/scenarios.md).

Loading from files and bundled names is in loader.py.

Every model forbids unknown keys, so a typo is refused with its key path instead of silently
falling back to a default. Times are scenario seconds; with ``loop`` (the default) every per-GPU
time (phases, lost windows, Xid events, failures, process start/stop) repeats each ``duration``.
"""

from __future__ import annotations

import itertools
import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gpuscope.common.config_types import ByteSize, Duration, Section
from gpuscope.nvml.clock_events import CLOCK_EVENT_REASONS
from gpuscope.simulate.patterns import Pattern, SteadyPattern
from gpuscope.simulate.units import Fraction, OptionalDuration, PositiveDuration

_GiB = 1024**3
_MiB = 1024**2

# Per-device C functions of the fake library; a scenario may make any of them fail (``failures``).
DEVICE_FUNCTIONS = frozenset({
    "nvmlDeviceGetIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMigMode", "nvmlDeviceGetSamples", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetFieldValues",
    "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetTotalEccErrors", "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleGet", "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetSupportedEventTypes", "nvmlDeviceRegisterEvents", "nvmlDeviceGetViolationStatus",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetEncoderUtilization",
    "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkErrorCounter",
    "nvmlDeviceGetMaxMigDeviceCount", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlGpmMigSampleGet",
})
PCIE_ERROR_TYPES = ("correctable", "non_fatal", "fatal", "receiver", "bad_tlp", "bad_dllp", "lcrc",
                    "naks_received", "naks_sent", "unsupported_request")
NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")
MIG_PROFILE = r"^([1-7]c\.)?[1-8]g\.[1-9][0-9]*gb(\+me)?$"  # a compute instance: "1c.3g.40gb"
REASON_BITS = {name: bit for bit, name in CLOCK_EVENT_REASONS.items()}
# "hang": the call does not return while the window lasts (a stuck driver, as around Xid 79).
FailureCode = Literal["unknown", "not_supported", "timeout", "no_permission", "gpu_is_lost", "no_data",
                      "hang"]
MAX_COMM_NAME = 15  # Linux truncates a thread's comm name (what psutil's name() shows) to 15 chars


class _Model(Section):
    model_config = ConfigDict(populate_by_name=True)  # "from" is a Python keyword: also as from_


class DriverSpec(_Model):
    version: str = "550.90.07"
    nvml_version: str = "12.550.90.07"
    available_after: OptionalDuration = Field(0.0, description="Absolute seconds; null/'never': never.")
    # Absolute seconds before which nvmlDeviceGetCount fails (a driver still settling at boot).
    count_fails_until: Duration = 0.0


class MemorySpec(_Model):
    total: ByteSize = 80 * _GiB
    reserved: ByteSize = 512 * _MiB
    base_used: ByteSize = 0  # used by something other than the listed processes (e.g. a leaked context)


class PowerSpec(_Model):
    limit_w: float = Field(700.0, gt=0)
    idle_w: float = Field(70.0, ge=0)
    busy_w: float = Field(620.0, ge=0)  # draw at utilization 1; clipped to the limit (power cap)


class TemperatureSpec(_Model):
    idle_c: float = 32.0
    busy_c: float = 68.0


class ClockSpec(_Model):
    sm_mhz: int = Field(1980, gt=0)
    sm_idle_mhz: int = Field(345, gt=0)
    mem_mhz: int = Field(2619, gt=0)


class PcieRates(_Model):
    tx_bytes_per_s: ByteSize = 256 * _MiB
    rx_bytes_per_s: ByteSize = 1 * _GiB


class PcieSpec(PcieRates):
    counters: bool = True  # NVML_FI_DEV_PCIE_COUNT_* byte counters; False: only GetPcieThroughput


class GpmLevels(_Model):
    """GPM activity per unit of utilization: SM_UTIL = sm_active x utilization x 100, and so on."""

    sm_active: Fraction = 0.85
    sm_occupancy: Fraction = 0.5
    tensor_active: Fraction = 0.6
    dram_active: Fraction = 0.45


class GpmSpec(GpmLevels):
    supported: bool = True
    # Non-tensor floating-point pipes' activity, per unit of SM activity.
    fp16_active: Fraction = 0.02
    fp32_active: Fraction = 0.12
    fp64_active: Fraction = 0.0


class HealthSpec(_Model):
    """The hardware health counters the GPU reports (constant over the scenario)."""

    remapped_rows_correctable: int = Field(0, ge=0)
    remapped_rows_uncorrectable: int = Field(0, ge=0)
    row_remap_pending: bool = False
    row_remap_failed: bool = False
    ecc_corrected: int = Field(0, ge=0)
    pcie_replays: int = Field(0, ge=0)
    pcie_errors: dict[str, int] = {}  # type -> count; the others 0
    memory_temperature_offset_c: float = -6.0  # memory temperature = GPU temperature + offset
    encoder: bool = False  # an NVENC engine (H100 has decoders only)

    @field_validator("pcie_errors")
    @classmethod
    def _pcie_types(cls, errors: dict[str, int]) -> dict[str, int]:
        unknown = [k for k in errors if k not in PCIE_ERROR_TYPES]
        if unknown or any(v < 0 for v in errors.values()):
            raise ValueError(f"pcie_errors: types are {', '.join(PCIE_ERROR_TYPES)}, counts >= 0")
        return errors


class NvlinkSpec(_Model):
    """NVLink links (0: none, as on a PCIe card: NVML answers NOT_SUPPORTED)."""

    links: int = Field(0, ge=0, le=18)
    down: list[int] = []  # links that are not up
    # Data over all links per unit of utilization, bytes a second (spread evenly over the up links).
    tx_bytes_per_s: ByteSize = 120 * _GiB
    rx_bytes_per_s: ByteSize = 120 * _GiB
    # Error counts by type, on link ``errors_link``.
    errors: dict[str, int] = {}
    errors_link: int = Field(0, ge=0)

    @field_validator("errors")
    @classmethod
    def _types(cls, errors: dict[str, int]) -> dict[str, int]:
        unknown = [k for k in errors if k not in NVLINK_ERROR_TYPES]
        if unknown or any(v < 0 for v in errors.values()):
            raise ValueError(f"errors: types are {', '.join(NVLINK_ERROR_TYPES)}, counts >= 0")
        return errors

    @model_validator(mode="after")
    def _links_exist(self) -> NvlinkSpec:
        if any(link >= self.links for link in self.down) or (self.errors and self.errors_link >= self.links):
            raise ValueError("down and errors_link must name links below 'links'")
        return self


class EccSpec(_Model):
    supported: bool = True
    uncorrected_volatile: int = Field(0, ge=0)


class Window(_Model):
    from_: Duration = Field(alias="from")
    to: OptionalDuration = None  # open-ended

    @model_validator(mode="after")
    def _ordered(self) -> Window:
        if self.to is not None and self.to <= self.from_:
            raise ValueError("'to' must be after 'from'")
        return self

    def contains(self, t: float) -> bool:
        return self.from_ <= t and (self.to is None or t < self.to)


class XidSpec(_Model):
    at: Duration
    code: int = Field(gt=0)


class ErrorsSpec(_Model):
    """Hardware errors the GPU counts from ``at`` on: added to its counters (the health spec's and the
    NVLink spec's, on its ``errors_link``), as a fault would raise them."""

    at: Duration
    nvlink: dict[str, int] = {}  # NVLink error type -> count
    pcie: dict[str, int] = {}  # PCIe error type -> count
    pcie_replays: int = Field(0, ge=0)
    ecc_uncorrected: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _types(self) -> ErrorsSpec:
        if any(k not in NVLINK_ERROR_TYPES for k in self.nvlink) or any(v < 0 for v in self.nvlink.values()):
            raise ValueError(f"nvlink: types are {', '.join(NVLINK_ERROR_TYPES)}, counts >= 0")
        if any(k not in PCIE_ERROR_TYPES for k in self.pcie) or any(v < 0 for v in self.pcie.values()):
            raise ValueError(f"pcie: types are {', '.join(PCIE_ERROR_TYPES)}, counts >= 0")
        return self


class FailureSpec(Window):
    from_: Duration = Field(0.0, alias="from")
    function: str
    error: FailureCode = "unknown"

    @field_validator("function")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in DEVICE_FUNCTIONS:
            raise ValueError(f"unknown per-device NVML function {name!r} (docs/scenarios.md lists them)")
        return name


def _reasons(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in REASON_BITS]
    if unknown:
        raise ValueError(f"unknown clock event reason(s) {unknown} (known: {', '.join(REASON_BITS)})")
    return names


class ProcessSpec(_Model):
    name: str = Field(min_length=1)
    pid: int | None = Field(None, gt=0)
    spawn: bool = False  # start a real helper process named ``name`` and report its pid
    kind: Literal["compute", "graphics"] = "compute"
    memory: ByteSize = 0
    sm_share: Fraction | None = None  # share of the GPU's utilization; default: 1 / processes on the GPU
    utilization: Pattern | None = None  # the process's own pattern instead of a share
    start: Duration = 0.0
    stop: OptionalDuration = None
    mig_device: int | None = Field(None, ge=0)  # the index in the GPU's mig_devices it runs on

    @model_validator(mode="after")
    def _pid_or_spawn(self) -> ProcessSpec:
        if self.spawn:
            if self.pid is not None:
                raise ValueError("'pid' is not allowed with spawn: true (the helper's real pid is reported)")
            if len(self.name) > MAX_COMM_NAME or "/" in self.name:
                raise ValueError(f"a spawned process name must be 1-{MAX_COMM_NAME} chars without '/'")
        elif self.pid is None:
            raise ValueError("'pid' is required unless spawn: true")
        if self.stop is not None and self.stop <= self.start:
            raise ValueError("'stop' must be after 'start'")
        return self

    def active(self, t: float) -> bool:
        return self.start <= t and (self.stop is None or t < self.stop)


# A Kubernetes object name, as a DNS subdomain: lower-case letters, digits, '-' and '.', at most 253
# characters, starting and ending with a letter or digit.
_K8S_NAME = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"


class PodSpec(_Model):
    """A pod container the (simulated) kubelet allocated the GPU (or MIG device) to."""

    namespace: str = Field("default", pattern=_K8S_NAME)
    pod: str = Field(pattern=_K8S_NAME)
    container: str = Field(pattern=_K8S_NAME)


class MigDeviceSpec(_Model):
    """A MIG device of a GPU in MIG mode: a compute instance of a GPU instance. By default each is a
    GPU instance of its own (id: its index + 1) with one compute instance (id 0); MIG devices that name
    the same ``gpu_instance`` are compute instances of one GPU instance, which the first of them
    describes (memory, activity)."""

    profile: str = Field(pattern=MIG_PROFILE)  # e.g. 1g.10gb, 3g.40gb; 1c.3g.40gb: a compute instance
    memory: ByteSize | None = None  # default: the profile's size
    # The instance's activity (GPM graphics activity; SM, tensor and DRAM activity as gpm's levels).
    utilization: Pattern = SteadyPattern(level=0.0)
    pods: list[PodSpec] = []
    gpu_instance: int | None = Field(None, ge=1, le=14)
    compute_instance: int = Field(0, ge=0, le=7)

    @property
    def memory_total(self) -> int:
        if self.memory is not None:
            return int(self.memory)
        gigabytes = re.search(r"([0-9]+)gb", self.profile)
        assert gigabytes is not None  # the pattern above requires it
        return int(gigabytes.group(1)) * _GiB - 512 * _MiB


class PhaseSpec(_Model):
    """From ``from`` until the next phase, override the GPU's dynamic settings (merged key by key)."""

    from_: Duration = Field(alias="from")
    utilization: Pattern | None = None
    power: PowerSpec | None = None
    temperature: TemperatureSpec | None = None
    clocks: ClockSpec | None = None
    pcie: PcieRates | None = None
    gpm: GpmLevels | None = None
    clock_event_reasons: list[str] | None = None

    @field_validator("clock_event_reasons")
    @classmethod
    def _check_reasons(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else _reasons(names)


class GpuSpec(_Model):
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str | None = None  # default: derived from the scenario name and GPU index
    pci_bus_id: str | None = None  # default: 00000000:XX:00.0 from the index
    pci_device_id: int = 0x233010DE
    memory: MemorySpec = MemorySpec()
    power: PowerSpec = PowerSpec()
    temperature: TemperatureSpec = TemperatureSpec()
    clocks: ClockSpec = ClockSpec()
    pcie: PcieSpec = PcieSpec()
    gpm: GpmSpec = GpmSpec()
    ecc: EccSpec = EccSpec()
    health: HealthSpec = HealthSpec()
    nvlink: NvlinkSpec = NvlinkSpec()
    mig: Literal["enabled", "disabled", "unsupported"] = "disabled"
    mig_devices: list[MigDeviceSpec] = []  # with mig: enabled
    utilization: Pattern = SteadyPattern(level=0.0)
    clock_event_reasons: list[str] = []
    phases: list[PhaseSpec] = []
    lost: list[Window] = []
    xid: list[XidSpec] = []
    errors: list[ErrorsSpec] = []  # hardware errors counted from a moment on
    failures: list[FailureSpec] = []
    processes: list[ProcessSpec] = []
    # Served by a simulated kubelet pod-resources socket (several: a time-sliced GPU).
    pods: list[PodSpec] = []

    @field_validator("clock_event_reasons")
    @classmethod
    def _check_reasons(cls, names: list[str]) -> list[str]:
        return _reasons(names)

    @field_validator("mig", mode="before")
    @classmethod
    def _mig_bool(cls, value: object) -> object:
        if isinstance(value, bool):  # "mig: true" reads naturally
            return "enabled" if value else "disabled"
        return value

    @field_validator("phases")
    @classmethod
    def _phases_ordered(cls, phases: list[PhaseSpec]) -> list[PhaseSpec]:
        starts = [p.from_ for p in phases]
        if any(b <= a for a, b in itertools.pairwise(starts)):
            raise ValueError("phases must be in increasing order of 'from'")
        return phases

    @model_validator(mode="after")
    def _mig_devices_fit(self) -> GpuSpec:
        if self.mig_devices and self.mig != "enabled":
            raise ValueError("mig_devices needs mig: enabled")
        if len(self.mig_devices) > 7:
            raise ValueError("a GPU has at most 7 MIG devices")
        for j, proc in enumerate(self.processes):
            if proc.mig_device is not None and proc.mig_device >= len(self.mig_devices):
                raise ValueError(f"processes[{j}].mig_device: {proc.mig_device} is not an index of "
                                 "mig_devices")
        ids = [(m.gpu_instance or i + 1, m.compute_instance) for i, m in enumerate(self.mig_devices)]
        if len(set(ids)) != len(ids):
            raise ValueError("two MIG devices with the same GPU and compute instance ids")
        first_of_instance = {gi: m for (gi, _), m in reversed(list(zip(ids, self.mig_devices, strict=True)))}
        if sum(m.memory_total for m in first_of_instance.values()) > self.memory.total:
            raise ValueError("the MIG devices' memory exceeds memory.total")
        return self

    @model_validator(mode="after")
    def _memory_fits(self) -> GpuSpec:
        used = self.memory.reserved + self.memory.base_used + sum(p.memory for p in self.processes)
        if used > self.memory.total:
            raise ValueError("reserved + base_used + process memory exceeds memory.total")
        return self


class Scenario(_Model):
    name: str = ""  # default: the file's name
    description: str = ""
    duration: PositiveDuration = 300.0
    loop: bool = True
    seed: int = 0
    driver: DriverSpec = DriverSpec()
    gpus: list[GpuSpec] = []

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        problems = []
        # One helper per spawned name: a name listed on two GPUs is the same process on both.
        spawned: dict[str, bool] = {}
        for i, gpu in enumerate(self.gpus):
            for j, proc in enumerate(gpu.processes):
                if spawned.setdefault(proc.name, proc.spawn) != proc.spawn:
                    problems.append(f"gpus[{i}].processes[{j}]: {proc.name!r} is spawned on one GPU and "
                                    "not on another (one name, one process)")
            if self.loop:  # a time past the loop's end would silently never happen
                times = [(f"phases[{k}].from", p.from_) for k, p in enumerate(gpu.phases)]
                times += [(f"lost[{k}].from", w.from_) for k, w in enumerate(gpu.lost)]
                times += [(f"xid[{k}].at", x.at) for k, x in enumerate(gpu.xid)]
                times += [(f"failures[{k}].from", f.from_) for k, f in enumerate(gpu.failures)]
                times += [(f"processes[{k}].start", p.start) for k, p in enumerate(gpu.processes)]
                problems += [f"gpus[{i}].{key}: {t:g}s is not within the {self.duration:g}s loop (duration)"
                             for key, t in times if t >= self.duration]
        if problems:
            raise ValueError("\n".join(problems))
        return self
